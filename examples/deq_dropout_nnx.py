"""The DEQ classifier of ``deq_dropout.py`` in Flax NNX: ``nnx.Dropout`` and
``nnx.BatchNorm`` inside the fixed-point map, the solve declared with
``jaxoverride.solve_state()``.

The model is an ordinary ``nnx.Module`` whose ``__call__`` hands the solver a closure
over its layers. ``jaxoverride_nnx.track(model, optimizer)`` lets ``jo.jit`` and
``jo.value_and_grad`` read and write the tracked modules (the parameters, the
``BatchStat`` variables, the dropout stream's counter) through that closure.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import deq_dropout as task
import jaxoverride as jo
import jaxoverride_nnx
from fpsolve import fixed_point

SOLVER = {"method": "anderson", "implicit": True}  # how training solves (and differentiates)


class DEQ(nnx.Module):
    """The logits of ``x``: a fixed point of dropout, a dense layer and BatchNorm."""

    def __init__(
        self, rngs: nnx.Rngs, solver: dict[str, Any] | None = None, rng: str = "per_solve"
    ):
        small = nnx.initializers.normal(0.2 / task.HIDDEN**0.5)  # a contraction at the start
        self.hidden = nnx.Linear(
            task.HIDDEN, task.HIDDEN, use_bias=False, kernel_init=small, rngs=rngs
        )
        self.inject = nnx.Linear(task.INPUTS, task.HIDDEN, rngs=rngs)
        self.norm = nnx.BatchNorm(task.HIDDEN, momentum=task.MOMENTUM, rngs=rngs)
        self.dropout = nnx.Dropout(task.RATE, rngs=rngs)
        self.readout = nnx.Linear(task.HIDDEN, task.CLASSES, rngs=rngs)
        self.solver = solver
        self.rng = rng  # the declared rng semantics ("per_evaluation" for the figure)

    def __call__(self, x: jax.Array) -> jax.Array:
        cell = lambda z, u: jnp.tanh(self.norm(self.hidden(self.dropout(z)) + u))
        z0 = jnp.zeros((x.shape[0], task.HIDDEN))
        with jo.solve_state(rng=self.rng):  # default: one mask per solve, stats at the solution
            z = fixed_point(task.watched(cell), z0, self.inject(x), **(self.solver or SOLVER)).value
        return self.readout(z)


def train(steps: int = 40, learning_rate: float = 0.02) -> tuple[list[float], float]:
    """Trains a fresh classifier; returns the loss before each step and after the last,
    and the accuracy on held-out data in inference mode (the running statistics)."""
    model = DEQ(nnx.Rngs(0, dropout=1))
    optimizer = nnx.Optimizer(model, optax.adam(learning_rate), wrt=nnx.Param)
    x, y = task.data()
    loss_fn = lambda model: task.cross_entropy(model(x), y)

    @jo.jit
    def train_step() -> jax.Array:
        loss, grads = jo.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    with jaxoverride_nnx.track(model, optimizer):
        model.train()
        losses = [float(train_step()) for _ in range(steps + 1)]
        model.eval()
        x_test, y_test = task.data(task.HELD_OUT, seed=1)
        logits = jo.jit(lambda x: model(x))(x_test)
    return losses, task.accuracy(logits, y_test)


def residual_curves() -> dict[str, list[float]]:
    """One forward solve of a fresh model in training mode, recorded per iteration, with
    a new mask per evaluation and with one mask per solve."""
    x, _ = task.data()
    solver = task.FIGURE_SOLVER
    curves = {}
    for rng in task.SEMANTICS:
        model = DEQ(nnx.Rngs(0, dropout=1), solver, rng)
        with jaxoverride_nnx.track(model), task.recording() as residuals:
            model(x)
        curves[rng] = residuals
    return curves
