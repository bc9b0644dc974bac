"""NNX transforms pass their function a copy of the module: what ``track`` can do with it.

``nnx.grad`` (and ``nnx.jit``, ``nnx.vmap``, ...) splits the module it is given and merges
a new one inside its trace. Under ``track(model)`` a neutral call in the function that
writes the copy therefore meets an untracked module: the error says that it is a copy
and where ``track`` goes (inside the function, around the neutral call), and both fixes
it names (that ``track``, or the neutral transforms) give the gradient of the unrolled
computation and count every step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxoverride as jo
import jaxoverride_nnx
from jaxoverride import lax as jlax

X = jnp.array([0.5, -1.0])
STEPS = 3


class Counted(nnx.Module):
    def __init__(self):
        self.linear = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        self.calls = nnx.Variable(jnp.array(0))

    def __call__(self, z: jax.Array) -> jax.Array:
        self.calls[...] += 1
        return jnp.tanh(self.linear(z))


def loss(model: Counted) -> jax.Array:
    return jlax.fori_loop(0, STEPS, lambda _, z: model(z), X).sum()


def loss_tracking_its_copy(model: Counted) -> jax.Array:
    with jaxoverride_nnx.track(model):  # the copy, inside the NNX transform's trace
        return loss(model)


def _reference(model: Counted) -> jax.Array:
    def unrolled(kernel, bias):
        z = X
        for _ in range(STEPS):
            z = jnp.tanh(z @ kernel + bias)
        return z.sum()

    bias = model.linear.bias
    assert bias is not None
    return jax.grad(unrolled)(model.linear.kernel[...], bias[...])


@pytest.mark.parametrize("jitted", [False, True], ids=["nnx.grad", "nnx.jit(nnx.grad)"])
def test_a_copy_written_under_track_names_the_copy_and_where_track_goes(jitted):
    model = Counted()
    grad = nnx.grad(loss)
    with jax.checking_leaks(), jaxoverride_nnx.track(model):
        with pytest.raises(jaxoverride_nnx.UntrackedModuleError) as caught:
            (nnx.jit(grad) if jitted else grad)(model)
    message = str(caught.value)
    assert "copy of the module" in message
    assert "inside the function" in message
    assert "`with jaxoverride_nnx.track(model): ...`" in message
    assert int(model.calls[...]) == 0  # left as it was


def test_both_fixes_named_give_the_unrolled_gradient_and_count_every_step():
    model = Counted()
    expected = _reference(model)
    with jax.checking_leaks(), jaxoverride_nnx.track(model):
        inside = nnx.jit(nnx.grad(loss_tracking_its_copy))(model)
        neutral = jo.jit(jo.grad(loss))(model)
    np.testing.assert_allclose(inside["linear"]["kernel"][...], expected, rtol=1e-6)
    np.testing.assert_allclose(neutral["linear"]["kernel"][...], expected, rtol=1e-6)
    assert int(model.calls[...]) == 2 * STEPS
