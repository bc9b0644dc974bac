"""A deep-equilibrium (DEQ) layer in Flax Linen, trained with optax through ``fpsolve``.

The layer's output is the fixed point ``z* = tanh(z* W + x U + b)`` found by
``fpsolve.fixed_point``, whose map calls the Linen submodules defined in ``setup``; a
linear readout maps it to a prediction. Nothing in the model names jaxoverride: with
``jaxoverride_linen.context()`` (or ``install()``), ``model.init`` creates the layers'
parameters through the solver's ``jit`` and ``while_loop`` (once, under the names Linen
gives them), and ``model.apply`` runs the solve. Each call also counts its solves in a
``"counters"`` collection, written outside the solver, as any Linen state.

Two ways to get the gradient of the loss with respect to the parameters:

* ``"implicit"`` (fpsolve's default): Anderson acceleration, differentiated implicitly.
  ``fpsolve`` closure-converts the map (so the parameters it reads become explicit
  inputs) and its ``jaxoverride.custom_vjp`` solves the adjoint fixed point: the loop is
  never differentiated.
* ``"unrolled"``: the solver's ``"unrolled"`` method, a ``lax.scan`` of plain steps,
  differentiated in reverse mode.

Run it with ``python examples/deq_linen.py``; it prints the loss falling for both, and
the largest difference between the two gradients at the start.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jaxoverride_linen
from _demo import report_training
from fpsolve import fixed_point

HIDDEN, INPUTS, EXAMPLES = 8, 4, 32
UNROLLED_STEPS = 60


class DEQ(nn.Module):
    """A fixed-point layer and a readout; counts its solves in ``"counters"``."""

    gradient: str = "implicit"

    def setup(self) -> None:
        small = nn.initializers.normal(0.4 / HIDDEN**0.5)  # a contraction at the start
        self.hidden = nn.Dense(HIDDEN, use_bias=False, kernel_init=small)
        self.inject = nn.Dense(HIDDEN)
        self.readout = nn.Dense(1)
        self.solves = self.variable("counters", "solves", lambda: jnp.array(0))

    def cell(self, z: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.tanh(self.hidden(z) + self.inject(x))

    def __call__(self, x: jax.Array) -> jax.Array:
        self.solves.value += 1
        z0 = jnp.zeros((x.shape[0], HIDDEN))
        if self.gradient == "unrolled":
            z = fixed_point(self.cell, z0, x, method="unrolled", max_iter=UNROLLED_STEPS).value
        else:
            z = fixed_point(self.cell, z0, x, method="anderson").value
        return self.readout(z)[:, 0]


def data() -> tuple[jax.Array, jax.Array]:
    kx, kw = jax.random.split(jax.random.key(42))
    x = jax.random.normal(kx, (EXAMPLES, INPUTS))
    return x, jnp.sin(x @ jax.random.normal(kw, (INPUTS,)))


def loss_fn(model: DEQ, params: Any, counters: Any, x: jax.Array, y: jax.Array) -> Any:
    """The mean squared error, and the counters after the call."""
    prediction, updates = model.apply(
        {"params": params, "counters": counters}, x, mutable=["counters"]
    )
    return jnp.mean((prediction - y) ** 2), updates["counters"]


def train(gradient: str, steps: int = 15, learning_rate: float = 0.05) -> list[float]:
    """Trains a fresh layer; returns the loss before each step and after the last."""
    model = DEQ(gradient)
    x, y = data()
    optimizer = optax.adam(learning_rate)
    variables = model.init(jax.random.key(0), x)
    params, counters = variables["params"], variables["counters"]
    opt_state = optimizer.init(params)

    @jax.jit
    def train_step(params: Any, counters: Any, opt_state: Any) -> Any:
        (loss, counters), grads = jax.value_and_grad(loss_fn, argnums=1, has_aux=True)(
            model, params, counters, x, y
        )
        updates, opt_state = optimizer.update(grads, opt_state)
        return optax.apply_updates(params, updates), counters, opt_state, loss

    losses = []
    for _ in range(steps):
        params, counters, opt_state, loss = train_step(params, counters, opt_state)
        losses.append(float(loss))
    final, counters = jax.jit(loss_fn, static_argnums=0)(model, params, counters, x, y)
    losses.append(float(final))
    # init counted one solve; every step and the final loss one each.
    assert int(counters["solves"]) == steps + 2, counters
    return losses


def gradient_gap() -> float:
    """The largest difference between the implicit and the unrolled gradient at init."""
    x, y = data()
    implicit, unrolled = DEQ("implicit"), DEQ("unrolled")
    variables = implicit.init(jax.random.key(0), x)

    def grad(model: DEQ) -> Any:
        loss = lambda p: loss_fn(model, p, variables["counters"], x, y)[0]
        return jax.jit(jax.grad(loss))(variables["params"])

    gaps = jax.tree.map(lambda a, b: jnp.max(jnp.abs(a - b)), grad(implicit), grad(unrolled))
    return float(max(jax.tree.leaves(gaps)))


def main() -> None:
    with jaxoverride_linen.context():
        for gradient in ("implicit", "unrolled"):
            report_training(gradient, train(gradient))
        print(f"max |grad_implicit - grad_unrolled| at init: {gradient_gap():.2e}")


if __name__ == "__main__":
    main()
