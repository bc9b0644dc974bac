"""Implicit differentiation inside ``hk.transform`` (``jaxoverride_haiku``).

The implicit-layers solver (``_implicit_solver``: ``closure_convert`` + ``custom_vjp``)
runs unchanged: init creates the parameters once (no ``linear_1``) and returns what
apply returns, nothing leaks, and gradients w.r.t. the params equal backpropagation
through the unrolled loop. Writes and rng draws inside a converted function are refused.
"""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import _implicit_solver as solver
import jaxoverride as jo
import jaxoverride_haiku as joh
from jaxoverride_haiku import PureFunctionWriteError

X = jnp.linspace(-1.0, 1.0, 4)


def deq(solve):
    def forward(x):
        layer = hk.Linear(4, w_init=hk.initializers.RandomNormal(0.2))
        return solve(lambda z, x: jnp.tanh(layer(z) + x), jnp.zeros(4), x)

    return hk.transform(forward)


@pytest.fixture(autouse=True)
def _haiku_context():
    with joh.context():
        yield


def test_init_creates_once_and_equals_apply():
    model = deq(solver.fixed_point)
    with jax.checking_leaks():
        params = model.init(jax.random.PRNGKey(0), X)
        applied = model.apply(params, None, X)
    assert list(params) == ["linear"]
    jitted = jax.jit(model.init)(jax.random.PRNGKey(0), X)
    assert jax.tree.structure(jitted) == jax.tree.structure(params)
    np.testing.assert_allclose(applied, model.apply(params, None, X))


def test_init_output_equals_apply_output():
    def forward(x):
        layer = hk.Linear(4, w_init=hk.initializers.RandomNormal(0.2))
        return solver.fixed_point(lambda z, x: jnp.tanh(layer(z) + x), jnp.zeros(4), x)

    model = hk.transform_with_state(forward)
    outputs = []

    def both(x):
        outputs.append(forward(x))
        return outputs[-1]

    init_model = hk.transform_with_state(both)
    params, state = init_model.init(jax.random.PRNGKey(0), X)
    at_init = outputs[-1]
    applied, _ = model.apply(params, state, None, X)
    np.testing.assert_allclose(at_init, applied, rtol=1e-6)


@pytest.mark.parametrize("jit", [False, True], ids=["grad", "jit-grad"])
def test_gradient_wrt_params_equals_the_unrolled_one(jit):
    implicit, unrolled = deq(solver.fixed_point), deq(solver.unrolled)
    params = implicit.init(jax.random.PRNGKey(0), X)

    def grad(model):
        g = jax.grad(lambda p: jnp.sum(model.apply(p, None, X) ** 2))
        return (jax.jit(g) if jit else g)(params)

    with jax.checking_leaks():
        got = grad(implicit)
    expected = grad(unrolled)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert float(jnp.abs(got["linear"]["w"]).sum()) > 0


def test_grad_of_jitted_apply():
    model = deq(solver.fixed_point)
    params = model.init(jax.random.PRNGKey(0), X)
    apply = jax.jit(model.apply)
    got = jax.grad(lambda p: jnp.sum(apply(p, None, X) ** 2))(params)
    expected = jax.grad(lambda p: jnp.sum(deq(solver.unrolled).apply(p, None, X) ** 2))(params)
    np.testing.assert_allclose(got["linear"]["w"], expected["linear"]["w"], rtol=1e-4, atol=1e-6)


def test_a_state_write_inside_closure_convert_is_refused():
    def forward(x):
        def f(z, x):
            hk.set_state("calls", hk.get_state("calls", [], init=jnp.zeros) + 1)
            return jnp.tanh(z + x)

        return solver.fixed_point(f, jnp.zeros(4), x)

    model = hk.transform_with_state(forward)
    with pytest.raises(PureFunctionWriteError, match=r"closure_convert.*'~/calls' was written"):
        model.init(jax.random.PRNGKey(0), X)


def test_an_rng_draw_inside_closure_convert_is_refused():
    def forward(x):
        f = lambda z, x: jnp.tanh(z + x + jax.random.normal(hk.next_rng_key(), z.shape))
        return solver.fixed_point(f, jnp.zeros(4), x)

    model = hk.transform(forward)
    with pytest.raises(PureFunctionWriteError, match="rng key was drawn"):
        model.apply({}, jax.random.PRNGKey(1), X)


def test_make_jaxpr_and_custom_solves_create_at_init():
    def forward(x):
        layer = hk.Linear(4, name="layer")
        text = str(jo.make_jaxpr(lambda v: layer(v))(x))
        solve = lambda matvec, b: jax.lax.fori_loop(
            0, 40, lambda _, v: v + 0.5 * (b - matvec(v)), b
        )
        root = jo.lax.custom_root(lambda v: v - 0.1 * layer(v) - x, x, solve, lambda g, y: y)
        linear = jo.lax.custom_linear_solve(lambda v: v + 0.1 * layer(v), x, solve)
        return root + linear, text

    model = hk.transform(forward)
    with jax.checking_leaks():
        params = model.init(jax.random.PRNGKey(0), X)
        out, text = model.apply(params, None, X)
    assert list(params) == ["layer"] and "dot_general" in text
    assert out.shape == (4,)
