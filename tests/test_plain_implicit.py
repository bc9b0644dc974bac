"""Implicit differentiation with lazily created parameters (``jaxoverride_plain``).

Each new name creates its parameters in a creation pass outside every trace, once, and
init returns exactly what apply returns. Checked inside ``jax.checking_leaks()``. (Without
the plain overrides every case but ``rule_vjp``/``rule_jvp`` creates a tracer: JAX calls
an eager custom rule's primal function eagerly, so those two are init-safe either way and
check only that the override keeps them so.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import _implicit_solver as solver
import jaxoverride as jo
import jaxoverride_plain as plain

W0 = jax.random.normal(jax.random.PRNGKey(0), (4, 4)) * 0.3


class LazyLayer:
    """A layer whose weight is created the first time it runs at init, counting creations."""

    def __init__(self) -> None:
        self.params: dict[str, jax.Array] = {}
        self.created = 0

    def __call__(self, z, x):
        if plain.is_initializing() and "w" not in self.params:
            # Computed here, so that creating it inside a trace would store a tracer.
            w = jax.random.normal(jax.random.PRNGKey(0), (4, 4)) * 0.3
            assert not isinstance(w, jax.core.Tracer), "created inside a trace"
            self.params["w"] = w
            self.created += 1
        return jnp.tanh(self.params["w"] @ z + x)


def _run(fn, layer, x, *, init):
    with jax.checking_leaks(), plain.context():
        if init:
            with plain.init_context():
                return fn(layer, x)
        return fn(layer, x)


def implicit(layer, x):
    return solver.fixed_point(layer, jnp.zeros(4), x)


def implicit_jit(layer, x):
    return jo.jit(lambda x: solver.fixed_point(layer, jnp.zeros(4), x))(x)


def closure_converted(layer, x):
    converted, constants = jo.closure_convert(lambda z: layer(z, x), x)
    return converted(x, *constants)


def rule_vjp(layer, x):
    f = jo.custom_vjp(lambda x: layer(x, x))
    f.defvjp(lambda x: (layer(x, x), x), lambda x, g: (g,))
    return f(x) + jo.grad(lambda x: f(x).sum())(x)


def rule_jvp(layer, x):
    f = jo.custom_jvp(lambda x: layer(x, x))
    f.defjvps(lambda t, out, x: t)
    return f(x) + jo.jvp(f, (x,), (jnp.ones_like(x),))[1]


def root(layer, x):
    newton = lambda f, z0: jax.lax.fori_loop(0, 20, lambda _, z: z - f(z) * 0.5, z0)
    return jo.lax.custom_root(lambda z: z - layer(z, x), x, newton, lambda g, y: y)


def linear_solve(layer, x):
    solve = lambda matvec, b: jax.lax.fori_loop(0, 30, lambda _, z: z + 0.5 * (b - matvec(z)), b)
    return jo.lax.custom_linear_solve(lambda v: v + 0.1 * layer(v, x), x, solve, symmetric=True)


def jaxpr_of(layer, x):
    return str(jo.make_jaxpr(lambda x: layer(x, x))(jax.ShapeDtypeStruct((4,), jnp.float32)))


CALLS = [implicit, implicit_jit, closure_converted, rule_vjp, rule_jvp, root, linear_solve]


@pytest.mark.parametrize("call", CALLS, ids=lambda call: call.__name__)
def test_init_creates_once_and_returns_what_apply_returns(call):
    layer, x = LazyLayer(), jnp.linspace(-1.0, 1.0, 4)
    initialised = _run(call, layer, x, init=True)
    assert layer.created == 1
    np.testing.assert_array_equal(layer.params["w"], W0)
    applied = _run(call, layer, x, init=False)
    np.testing.assert_allclose(initialised, applied, rtol=1e-6)
    assert layer.created == 1


def test_make_jaxpr_creates_on_concrete_zeros():
    layer = LazyLayer()
    text = _run(jaxpr_of, layer, None, init=True)
    assert layer.created == 1
    assert text == _run(jaxpr_of, layer, None, init=False)
    assert "tanh" in text


def test_without_init_context_the_names_are_jax():
    layer = LazyLayer()
    layer.params["w"] = W0
    x = jnp.linspace(-1.0, 1.0, 4)
    with plain.context():
        inside = implicit(layer, x)
    np.testing.assert_array_equal(inside, implicit(layer, x))


def test_implicit_gradient_with_plain_parameters_equals_the_unrolled_one():
    layer, x = LazyLayer(), jnp.linspace(-1.0, 1.0, 4)
    _run(implicit, layer, x, init=True)

    def loss(solve, x):
        return jnp.sum(solve(layer, jnp.zeros(4), x) ** 2)

    with plain.context():
        implicit_grad = jo.jit(jo.grad(lambda x: loss(solver.fixed_point, x)))(x)
    unrolled_grad = jax.grad(lambda x: loss(solver.unrolled, x))(x)
    np.testing.assert_allclose(implicit_grad, unrolled_grad, rtol=1e-4, atol=1e-6)
