"""``jo.make_jaxpr`` and the custom rules Equinox relies on, under ``jaxoverride_nnx.track``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.core import Tracer, eval_jaxpr

import jaxoverride as jo
import jaxoverride_nnx as jon

X = jnp.linspace(-1.0, 1.0, 3)


class Layer(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.arange(9.0).reshape(3, 3) / 10)
        self.calls = nnx.Variable(jnp.array(0))

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.tanh(x @ self.w[...])


def test_make_jaxpr_reads_tracked_variables_as_raw_jax_reads_explicit_arrays():
    layer = Layer()
    with jon.track(layer), jax.checking_leaks():
        closed = jo.make_jaxpr(layer)(X)
    w = layer.w[...]
    expected = jax.make_jaxpr(lambda x: jnp.tanh(x @ w))(X)
    assert str(closed) == str(expected)
    np.testing.assert_array_equal(closed.consts[0], w)


def test_make_jaxpr_is_never_stale_after_the_weights_change():
    """JAX caches a trace by the function's identity; the override traces a fresh one."""
    layer = Layer()
    make = jo.make_jaxpr(layer)
    with jon.track(layer):
        first = make(X)
        layer.w[...] = 2 * layer.w[...]
        second = make(X)
    np.testing.assert_array_equal(second.consts[0], layer.w[...])
    assert not np.allclose(first.consts[0], second.consts[0])


def test_make_jaxpr_under_grad_hoists_the_perturbed_weights():
    """The jaxpr's constants are the enclosing trace's values: evaluating it inside
    ``jo.grad`` gives the gradient with respect to the module, as closure conversion needs."""
    layer = Layer()

    def loss(module: Layer) -> jax.Array:
        closed = jo.make_jaxpr(module)(X)
        (out,) = eval_jaxpr(closed.jaxpr, closed.consts, X)
        return jnp.sum(out**2)

    with jon.track(layer):
        grads = jo.grad(loss)(layer)
    expected = jax.grad(lambda w: jnp.sum(jnp.tanh(X @ w) ** 2))(layer.w[...])
    np.testing.assert_allclose(grads["w"][...], expected, rtol=1e-6)


def test_make_jaxpr_refuses_a_write_and_leaves_the_module_as_it_was():
    layer = Layer()

    def counted(x: jax.Array) -> jax.Array:
        layer.calls[...] += 1
        return layer(x)

    with jon.track(layer):
        with pytest.raises(jon.PureFunctionWriteError, match=r"Layer\.calls.*fixed outputs"):
            jo.make_jaxpr(counted)(X)
    assert int(layer.calls[...]) == 0
    assert not isinstance(layer.calls[...], Tracer)


def test_custom_vjp_backward_pass_with_a_neutral_loop_under_jit_of_grad():
    """JAX runs a rule's backward pass while it transposes; a neutral loop in it must not
    carry the tracked Variables (the enclosing trace's values) in as constants."""
    layer = Layer()

    @jo.custom_vjp
    def double(v):
        return 2 * v

    def fwd(v):
        return 2 * v, None

    def bwd(_, g):
        total = jo.lax.fori_loop(0, 2, lambda i, acc: acc + g, jnp.zeros_like(g))
        return (total,)

    double.defvjp(fwd, bwd)

    def loss(module: Layer, x: jax.Array) -> jax.Array:
        return jnp.sum(double(module(x)) ** 2)

    with jon.track(layer):
        state, gx = jo.jit(jo.grad(loss, argnums=(0, 1)))(layer, X)
    w = layer.w[...]
    rw, rx = jax.grad(lambda w, x: jnp.sum((2 * jnp.tanh(x @ w)) ** 2), argnums=(0, 1))(w, X)
    np.testing.assert_allclose(state["w"][...], rw, rtol=1e-6)
    np.testing.assert_allclose(gx, rx, rtol=1e-6)


def test_custom_jvp_rule_is_not_called_when_only_tracked_variables_are_perturbed():
    """As in raw JAX, a ``custom_jvp`` rule runs only for tangents of its own arguments.
    Equinox's ``nondifferentiable`` (in every ``filter_custom_vjp``) has a rule that raises:
    under ``jo.grad`` with respect to a module it must not run (lineax, diffrax)."""
    w = nnx.Param(jnp.array(2.0))

    def scale(x, message, y):
        return x * y

    guarded = jo.custom_jvp(scale, nondiff_argnums=(1,))

    def rule(message, primals, tangents):
        raise RuntimeError(message)

    guarded.defjvp(rule)
    with jon.track(w):
        grad = jo.grad(lambda v: v[...] * guarded(3.0, "rule called", 4.0))(w)
        np.testing.assert_allclose(grad[...], 12.0)
        with pytest.raises(RuntimeError, match="rule called"):  # an argument's tangent: it runs
            jo.grad(lambda x: w[...] * guarded(x, "rule called", 4.0))(3.0)
