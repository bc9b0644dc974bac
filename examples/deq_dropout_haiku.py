"""The DEQ classifier of ``deq_dropout.py`` in Haiku: ``hk.dropout`` and ``hk.BatchNorm``
inside the fixed-point map, the solve declared with ``jaxoverride.solve_state()``.

The modules are built outside the map and called inside it (the solver traces the map
more than once; Haiku would name each construction anew). ``jaxoverride_haiku.context()``
runs init's creation pass and lets the solver's ``jit``, loops and implicit
differentiation through ``hk.transform_with_state``.
"""

from __future__ import annotations

from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp

import deq_dropout as task
import jaxoverride as jo
import jaxoverride_haiku
from fpsolve import fixed_point

SOLVER = {"method": "anderson", "implicit": True}  # how training solves (and differentiates)


def deq(
    x: jax.Array, training: bool, solver: dict[str, Any] = SOLVER, rng: str = "per_solve"
) -> jax.Array:
    """The logits of ``x``: a fixed point of dropout, a dense layer and BatchNorm. ``rng``
    is the declared rng semantics (``"per_evaluation"``: eager Python's, for the figure)."""
    small = hk.initializers.RandomNormal(0.2 / task.HIDDEN**0.5)  # a contraction at the start
    hidden = hk.Linear(task.HIDDEN, with_bias=False, w_init=small, name="hidden")
    inject = hk.Linear(task.HIDDEN, name="inject")
    norm = hk.BatchNorm(True, True, decay_rate=task.MOMENTUM, name="norm")
    readout = hk.Linear(task.CLASSES, name="readout")

    def cell(z: jax.Array, u: jax.Array) -> jax.Array:
        if training:
            z = hk.dropout(hk.next_rng_key(), task.RATE, z)
        return jnp.tanh(norm(hidden(z) + u, is_training=training))

    z0 = jnp.zeros((x.shape[0], task.HIDDEN))
    with jo.solve_state(rng=rng):  # default: one mask per solve, statistics at the solution
        z = fixed_point(task.watched(cell), z0, inject(x), **solver).value
    return readout(z)


model = hk.transform_with_state(deq)


def train(steps: int = 40, learning_rate: float = 0.02) -> tuple[list[float], float]:
    """Trains a fresh classifier; returns the loss before each step and after the last,
    and the accuracy on held-out data in inference mode (the running statistics)."""
    x, y = task.data()
    with jaxoverride_haiku.context():
        params, state = model.init(jax.random.key(0), x, True)

        def loss_fn(params: Any, state: Any, key: jax.Array) -> Any:
            logits, state = model.apply(params, state, key, x, True)
            return task.cross_entropy(logits, y), state

        params, state, losses = task.train_functional(loss_fn, params, state, steps, learning_rate)
        x_test, y_test = task.data(task.HELD_OUT, seed=1)
        logits, _ = jax.jit(model.apply, static_argnums=4)(params, state, None, x_test, False)
    return losses, task.accuracy(logits, y_test)


def residual_curves() -> dict[str, list[float]]:
    """One forward solve of a fresh model in training mode, recorded per iteration, with
    a new mask per evaluation and with one mask per solve."""
    x, _ = task.data()
    curves = {}
    with jaxoverride_haiku.context():
        forward = hk.transform_with_state(lambda x, rng: deq(x, True, task.FIGURE_SOLVER, rng))
        params, state = forward.init(jax.random.key(0), x, "per_solve")
        for rng in task.SEMANTICS:
            with task.recording() as residuals:
                forward.apply(params, state, jax.random.key(1), x, rng)
            curves[rng] = residuals
    return curves
