"""A DEQ classifier with dropout and BatchNorm inside its fixed-point map, in Haiku, Linen
and NNX, trained through ``fpsolve`` under ``jaxoverride.solve_state``.

The layer's output is the fixed point ``z* = tanh(BN(dropout(z*) W + x U))``: the
dropout and the BatchNorm sit *inside* the map that the solver evaluates many times. In
eager Python every evaluation would draw a new dropout mask (the map changes at every
iteration, so there is no fixed point to converge to) and update the running statistics
(one EMA update per iteration, not per training step). Wrapping the solver call in
``jaxoverride.solve_state()`` declares the semantics a DEQ wants: **one dropout mask per
solve** (every evaluation draws the same keys; the next call gets new ones) and the
**statistics at the solution** (the running mean and variance take one update, the one
made by the solve's last evaluation, at ``z*``). The model code is otherwise the
framework's own: ``hk.dropout`` and ``hk.BatchNorm``, ``nn.Dropout`` and
``nn.BatchNorm``, ``nnx.Dropout`` and ``nnx.BatchNorm``.

Each framework's model lives in its own file (``deq_dropout_haiku.py``,
``deq_dropout_linen.py``, ``deq_dropout_nnx.py``); this one holds the task, the residual
recorder and the figure. ``python examples/deq_dropout.py`` trains the three classifiers
(loss falling, held-out accuracy with the running statistics) and redraws
``docs/assets/solve-state-residual.png``: the residual per iteration of one forward solve
with per-evaluation masks against one mask per solve, in each framework.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))

HIDDEN, INPUTS, CLASSES = 16, 4, 3
EXAMPLES, HELD_OUT = 128, 256
RATE = 0.1  # dropout rate
MOMENTUM = 0.9  # the running statistics' EMA: new = MOMENTUM * old + (1 - MOMENTUM) * batch
FIGURE = Path(__file__).resolve().parent.parent / "docs" / "assets" / "solve-state-residual.png"
FIGURE_ITERATIONS = 60  # the forward solve's max_iter in the figure
FIGURE_SOLVER = {"method": "forward", "implicit": False, "max_iter": FIGURE_ITERATIONS, "tol": 1e-6}
SEMANTICS = ("per_evaluation", "per_solve")  # the figure's two rng declarations
FRAMEWORKS = ("haiku", "linen", "nnx")


def data(examples: int = EXAMPLES, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    """A synthetic 3-class task: the label is the largest of three nonlinear scores."""
    x = jax.random.normal(jax.random.key(seed), (examples, INPUTS))
    a = jax.random.normal(jax.random.key(42), (INPUTS, CLASSES))
    return x, jnp.argmax(jnp.sin(1.5 * x @ a) + 0.5 * x @ a, axis=1)


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """The mean softmax cross entropy."""
    log_p = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_p, labels[:, None], axis=1))


def train_functional(
    loss_fn: Callable[..., Any], params: Any, state: Any, steps: int, learning_rate: float
) -> tuple[Any, Any, list[float]]:
    """Trains a functional model (Haiku, Linen) with adam, a compiled step per key:
    ``loss_fn(params, state, key)`` returns the loss and the new state. Returns the
    parameters, the state, and the loss before each step and after the last."""
    import optax

    optimizer = optax.adam(learning_rate)

    @jax.jit
    def step(params: Any, state: Any, opt_state: Any, key: jax.Array) -> Any:
        (loss, state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, state, key)
        updates, opt_state = optimizer.update(grads, opt_state)
        return optax.apply_updates(params, updates), state, opt_state, loss

    opt_state, losses = optimizer.init(params), []
    for key in jax.random.split(jax.random.key(1), steps + 1):
        params, state, opt_state, loss = step(params, state, opt_state, key)
        losses.append(float(loss))
    return params, state, losses


def accuracy(logits: jax.Array, labels: jax.Array) -> float:
    return float(jnp.mean(jnp.argmax(logits, axis=1) == labels))


_residuals: list[list[float]] | None = None


def watched(cell: Callable[[jax.Array, Any], jax.Array]) -> Callable[[jax.Array, Any], jax.Array]:
    """``cell``, which inside ``recording()`` also records ``||f(z) - z|| / max(1, ||z||)``
    at each evaluation (a host callback): for the forward method, the residual per
    iteration. Outside ``recording()`` it is ``cell`` itself."""
    if _residuals is None:
        return cell
    sink = _residuals

    def recorded(z: jax.Array, args: Any) -> jax.Array:
        fz = cell(z, args)
        residual = jnp.linalg.norm(fz - z) / jnp.maximum(1.0, jnp.linalg.norm(z))
        jax.debug.callback(lambda r: sink[-1].append(float(r)), residual)
        return fz

    return recorded


@contextmanager
def recording() -> Iterator[list[float]]:
    """The residuals the watched maps record inside the block, one per evaluation."""
    global _residuals
    previous, _residuals = _residuals, [[]]
    try:
        yield _residuals[0]
    finally:
        jax.effects_barrier()
        _residuals = previous


def draw_figure(curves: dict[str, dict[str, list[float]]], path: Path = FIGURE) -> None:
    """Draws ``curves[framework][semantics]`` (residual per iteration) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7.0, 3.6))
    colours: dict[str, str] = dict(
        zip(FRAMEWORKS, ("tab:blue", "tab:orange", "tab:green"), strict=True)
    )
    styles = {
        "per_evaluation": ("--", "a new mask per evaluation"),
        "per_solve": ("-", "one mask per solve"),
    }
    for framework, by_semantics in curves.items():
        for semantics, residuals in by_semantics.items():
            style, label = styles[semantics]
            axis.semilogy(
                range(1, len(residuals) + 1), residuals, style,
                color=colours[framework], label=f"{framework}: {label}",
            )  # fmt: skip
    axis.set_xlabel("forward iteration")
    axis.set_ylabel("relative residual ||f(z) - z||")
    axis.set_title("A DEQ with dropout and BatchNorm in its map: one forward solve")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=8, ncol=2)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=150)
    plt.close(figure)


def modules() -> dict[str, Any]:
    """Each framework's model module (imported here: each imports its framework)."""
    import deq_dropout_haiku
    import deq_dropout_linen
    import deq_dropout_nnx

    return {"haiku": deq_dropout_haiku, "linen": deq_dropout_linen, "nnx": deq_dropout_nnx}


def residual_curves() -> dict[str, dict[str, list[float]]]:
    """One forward solve of each framework's freshly initialised DEQ, in training mode,
    under ``solve_state(rng="per_evaluation")`` and under ``solve_state()``."""
    return {name: module.residual_curves() for name, module in modules().items()}


def main() -> None:
    from _demo import report_training

    for name, module in modules().items():
        losses, held_out = module.train()
        report_training(name, losses)
        print(f"{name:9s} held-out accuracy (running statistics): {held_out:.2f}")
    draw_figure(residual_curves())
    print(f"wrote {FIGURE}")


if __name__ == "__main__":
    main()
