"""Implicit differentiation under ``jaxoverride_nnx.track``.

The implicit-layers solver (``_implicit_solver``) runs unchanged on a closure-captured
module: ``jo.grad`` w.r.t. the module equals backpropagation through the unrolled loop,
eager and under ``jo.jit``, and is never stale after the weights change. A custom rule's
primal function may write tracked state (written back once per call); a write inside a
closure-converted function is refused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import _implicit_solver as solver
import jaxoverride as jo
import jaxoverride_nnx
from jaxoverride_nnx import PureFunctionWriteError

X = jnp.linspace(-1.0, 1.0, 4)


class DEQ(nnx.Module):
    def __init__(self, solve):
        self.layer = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
        self.layer.kernel[...] *= 0.3
        self.solve = solve

    def __call__(self, x):
        return jnp.sum(self.solve(lambda z, x: jnp.tanh(self.layer(z) + x), jnp.zeros(4), x) ** 2)


def _gradient(model, jit):
    grad = lambda: jo.grad(lambda m: m(X))(model)
    with jaxoverride_nnx.track(model):
        return jo.jit(grad)() if jit else grad()


@pytest.mark.parametrize("jit", [False, True], ids=["grad", "jit-grad"])
def test_grad_wrt_the_module_equals_the_unrolled_one_and_is_never_stale(jit):
    implicit, unrolled = DEQ(solver.fixed_point), DEQ(solver.unrolled)
    for _ in range(2):
        got, expected = _gradient(implicit, jit), _gradient(unrolled, jit)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
        assert float(jnp.abs(got["layer"]["kernel"][...]).sum()) > 0
        for model in (implicit, unrolled):  # new weights: the next gradient must see them
            model.layer.kernel[...] *= 0.5


def test_a_rule_may_write_tracked_state_once_per_call():
    counter = nnx.Variable(jnp.array(0))
    f = jo.custom_vjp(lambda x: jnp.sin(x))

    def fwd(x):
        counter[...] += 1
        return jnp.sin(x), x

    f.defvjp(fwd, lambda x, g: (jnp.cos(x) * g,))

    def primal(x):
        counter[...] += 1
        return jnp.sin(x)

    g = jo.custom_vjp(primal)
    g.defvjp(fwd, lambda x, t: (jnp.cos(x) * t,))
    with jaxoverride_nnx.track(counter):
        with jax.checking_leaks():
            g(X)
            assert int(counter[...]) == 1
            jo.jit(lambda: g(X))()
            assert int(counter[...]) == 2
            gradient = jo.grad(lambda x: g(x).sum())(X)
            assert int(counter[...]) == 3, "fwd ran once for the gradient"
    np.testing.assert_allclose(gradient, jnp.cos(X), rtol=1e-6)


def test_a_write_inside_closure_convert_is_refused_and_nothing_changes():
    counter = nnx.Variable(jnp.array(0))

    def f(z, x):
        counter[...] += 1
        return jnp.tanh(z + x)

    with jaxoverride_nnx.track(counter):
        with pytest.raises(PureFunctionWriteError, match="closure_convert"):
            solver.fixed_point(f, jnp.zeros(4), X)
    assert int(counter[...]) == 0


def test_a_jit_inside_the_implicit_solve_under_a_jitted_gradient():
    """The solver's own ``jo.jit`` traced first under ``jo.jit(jo.grad)``: ``bwd`` is traced
    in that jit's transpose, and used to see the Variables' values of another trace (and
    to fail lowering with "No constant handler for DynamicJaxprTracer")."""
    inner = jo.jit(solver.fixed_point, static_argnums=0)
    implicit, unrolled = DEQ(lambda f, z0, x: inner(f, z0, x)), DEQ(solver.unrolled)
    with jax.checking_leaks():
        got, expected = _gradient(implicit, jit=True), _gradient(unrolled, jit=True)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_a_write_in_bwd_is_refused_and_nothing_changes():
    counter = nnx.Variable(jnp.array(0))
    f = jo.custom_vjp(lambda x: jnp.sin(x))

    def bwd(x, g):
        counter[...] += 1
        return (jnp.cos(x) * g,)

    f.defvjp(lambda x: (jnp.sin(x), x), bwd)
    with jaxoverride_nnx.track(counter):
        for grad in (jo.grad(lambda x: f(x).sum()), jo.jit(jo.grad(lambda x: f(x).sum()))):
            with pytest.raises(PureFunctionWriteError, match=r"bwd.*wrote.*Variable"):
                grad(X)
            assert int(counter[...]) == 0
