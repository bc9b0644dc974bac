"""A deep-equilibrium (DEQ) layer in Flax NNX, trained through the unchanged solver.

The layer's output is the fixed point ``z* = tanh(z* W + x U + b)`` found by
``fpsolve.fixed_point``; a linear readout maps it to a prediction. The whole training
step, ``jaxoverride.value_and_grad`` of the loss and the ``nnx.Optimizer`` update, runs
under ``jaxoverride.jit`` and reads and writes the model and the optimizer through
closures, inside ``jaxoverride_nnx.track(model, optimizer)``.

Two ways to get the gradient of the loss with respect to the layer's weights:

* ``"implicit"`` (fpsolve's default): Anderson acceleration, differentiated implicitly.
  ``fpsolve`` closure-converts the cell (so the tracked weights it reads become explicit
  inputs) and its ``jaxoverride.custom_vjp`` solves the adjoint fixed point with the same
  solver: the loop is never differentiated, and the model needs no help.
* ``"unrolled"``: the solver's ``"unrolled"`` method, a ``lax.scan`` of plain steps,
  differentiated in reverse mode.

Run it with ``python examples/deq_nnx.py``; it prints the loss falling for both.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jaxoverride as jo
import jaxoverride_nnx
from _demo import report_training
from fpsolve import fixed_point

HIDDEN, INPUTS, EXAMPLES = 8, 4, 32


class DEQ(nnx.Module):
    """A fixed-point layer and a readout; counts how many times it is solved."""

    def __init__(self, rngs: nnx.Rngs, gradient: str = "implicit"):
        small = nnx.initializers.normal(0.4 / HIDDEN**0.5)  # a contraction at the start
        self.hidden = nnx.Linear(HIDDEN, HIDDEN, use_bias=False, kernel_init=small, rngs=rngs)
        self.inject = nnx.Linear(INPUTS, HIDDEN, rngs=rngs)
        self.readout = nnx.Linear(HIDDEN, 1, rngs=rngs)
        self.solves = nnx.Variable(jnp.array(0))
        self.gradient = gradient

    def cell(self, z: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.tanh(self.hidden(z) + self.inject(x))

    def equilibrium(self, x: jax.Array) -> jax.Array:
        self.solves[...] += 1
        z0 = jnp.zeros((x.shape[0], HIDDEN))
        if self.gradient == "unrolled":
            return fixed_point(self.cell, z0, x, method="unrolled", max_iter=30).value
        return fixed_point(self.cell, z0, x, method="anderson").value

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.readout(self.equilibrium(x))[:, 0]


def data() -> tuple[jax.Array, jax.Array]:
    kx, kw = jax.random.split(jax.random.key(42))
    x = jax.random.normal(kx, (EXAMPLES, INPUTS))
    return x, jnp.sin(x @ jax.random.normal(kw, (INPUTS,)))


def train(gradient: str, steps: int = 15, learning_rate: float = 0.05) -> list[float]:
    """Trains a fresh layer; returns the loss before each step and after the last."""
    model = DEQ(nnx.Rngs(0), gradient)
    optimizer = nnx.Optimizer(model, optax.adam(learning_rate), wrt=nnx.Param)
    x, y = data()

    def loss_fn(model: DEQ) -> jax.Array:
        return jnp.mean((model(x) - y) ** 2)

    @jo.jit
    def train_step() -> jax.Array:
        loss, grads = jo.value_and_grad(loss_fn)(model)  # grads: an nnx.State, as nnx.grad
        optimizer.update(model, grads)
        return loss

    with jaxoverride_nnx.track(model, optimizer):
        losses = [float(train_step()) for _ in range(steps)]
        losses.append(float(jo.jit(lambda: loss_fn(model))()))
    assert int(model.solves[...]) == steps + 1, "one solve per loss evaluation"
    assert int(optimizer.step[...]) == steps
    return losses


def main() -> None:
    for gradient in ("implicit", "unrolled"):
        report_training(gradient, train(gradient))


if __name__ == "__main__":
    main()
