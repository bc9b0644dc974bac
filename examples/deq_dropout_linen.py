"""The DEQ classifier of ``deq_dropout.py`` in Flax Linen: ``nn.Dropout`` and
``nn.BatchNorm`` inside the fixed-point map, the solve declared with
``jaxoverride.solve_state()``.

The submodules are declared in ``nn.compact``, outside the map, and the map calls them.
``jaxoverride_linen.context()`` lets Linen's bound variables (the ``"params"``, the
``"batch_stats"`` collection, the ``"dropout"`` rng stream) through the solver's ``jit``,
loops and implicit differentiation.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import deq_dropout as task
import jaxoverride as jo
import jaxoverride_linen
from fpsolve import fixed_point

SOLVER = {"method": "anderson", "implicit": True}  # how training solves (and differentiates)


class DEQ(nn.Module):
    """The logits of ``x``: a fixed point of dropout, a dense layer and BatchNorm."""

    solver: Any = None  # fixed_point's options; None: SOLVER
    rng: str = "per_solve"  # the declared rng semantics ("per_evaluation" for the figure)

    @nn.compact
    def __call__(self, x: jax.Array, training: bool) -> jax.Array:
        small = nn.initializers.normal(0.2 / task.HIDDEN**0.5)  # a contraction at the start
        hidden = nn.Dense(task.HIDDEN, use_bias=False, kernel_init=small, name="hidden")
        inject = nn.Dense(task.HIDDEN, name="inject")
        norm = nn.BatchNorm(use_running_average=not training, momentum=task.MOMENTUM, name="norm")
        dropout = nn.Dropout(task.RATE, deterministic=not training)
        readout = nn.Dense(task.CLASSES, name="readout")
        cell = lambda z, u: jnp.tanh(norm(hidden(dropout(z)) + u))
        z0 = jnp.zeros((x.shape[0], task.HIDDEN))
        with jo.solve_state(rng=self.rng):  # default: one mask per solve, stats at the solution
            z = fixed_point(task.watched(cell), z0, inject(x), **(self.solver or SOLVER)).value
        return readout(z)


def train(steps: int = 40, learning_rate: float = 0.02) -> tuple[list[float], float]:
    """Trains a fresh classifier; returns the loss before each step and after the last,
    and the accuracy on held-out data in inference mode (the running statistics)."""
    model = DEQ()
    x, y = task.data()
    with jaxoverride_linen.context():
        keys = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
        variables = model.init(keys, x, True)
        params, stats = variables["params"], variables["batch_stats"]

        def loss_fn(params: Any, stats: Any, key: jax.Array) -> Any:
            logits, updates = model.apply(
                {"params": params, "batch_stats": stats}, x, True,
                rngs={"dropout": key}, mutable=["batch_stats"],
            )  # fmt: skip
            return task.cross_entropy(logits, y), updates["batch_stats"]

        params, stats, losses = task.train_functional(loss_fn, params, stats, steps, learning_rate)
        x_test, y_test = task.data(task.HELD_OUT, seed=1)
        infer = jax.jit(lambda v, x: model.apply(v, x, False))
        logits = infer({"params": params, "batch_stats": stats}, x_test)
    return losses, task.accuracy(logits, y_test)


def residual_curves() -> dict[str, list[float]]:
    """One forward solve of a fresh model in training mode, recorded per iteration, with
    a new mask per evaluation and with one mask per solve."""
    x, _ = task.data()
    model = DEQ(task.FIGURE_SOLVER)
    curves = {}
    with jaxoverride_linen.context():
        variables = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x, True)
        for rng in task.SEMANTICS:
            with task.recording() as residuals:
                model.clone(rng=rng).apply(
                    variables, x, True, rngs={"dropout": jax.random.key(1)}, mutable=["batch_stats"]
                )
            curves[rng] = residuals
    return curves
