"""The problem every framework solves in the flagship demo, and how a result is reported.

The map is ``f(z, x) = tanh(z @ W + x @ U + b)``: one dense layer on ``z`` plus an input
injection, in the ``(in, out)`` weight layout that ``hk.Linear`` and ``nnx.Linear`` share.
``W`` is scaled to spectral radius 0.95, so plain iteration is slow and acceleration pays.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def dense_map(z: jax.Array, args: tuple[jax.Array, ...]) -> jax.Array:
    """The fixed-point map with its weights passed explicitly: ``args = (W, U, b, x)``."""
    W, U, b, x = args
    return jnp.tanh(z @ W + x @ U + b)


@dataclass(frozen=True, eq=False)
class Problem:
    W: jax.Array  # (n, n)
    U: jax.Array  # (d, n)
    b: jax.Array  # (n,)
    x: jax.Array  # (d,)

    @property
    def n(self) -> int:
        return self.W.shape[0]

    @property
    def args(self) -> tuple[jax.Array, ...]:
        return (self.W, self.U, self.b, self.x)


def make_problem(n: int = 32, d: int = 8, seed: int = 0) -> Problem:
    kw, ku, kb, kx = jax.random.split(jax.random.PRNGKey(seed), 4)
    w = np.asarray(jax.random.normal(kw, (n, n)))
    # Spectral radius 0.95 and a weak input: the map is nearly linear and slowly
    # contracting, so plain iteration needs ~100 steps and acceleration pays.
    w = 0.95 * w / np.max(np.abs(np.linalg.eigvals(w)))
    return Problem(
        W=jnp.asarray(w, jnp.float32),
        U=0.2 * jax.random.normal(ku, (d, n)) / np.sqrt(d),
        b=0.01 * jax.random.normal(kb, (n,)),
        x=jax.random.normal(kx, (d,)),
    )


@dataclass
class Row:
    """One line of the demo table."""

    framework: str
    method: str
    iterations: int
    residual: float
    wall_ms: float
    solution: np.ndarray


def timed(run: Callable[[], Any], repeats: int = 5) -> tuple[Any, float]:
    """Runs ``run`` once to compile, then returns its result and the best wall time in ms."""
    result = jax.block_until_ready(run())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        result = jax.block_until_ready(run())
        best = min(best, time.perf_counter() - start)
    return result, best * 1e3


UNROLLED_STEPS = 300  # spectral radius 0.95: 0.95**300 < 1e-6, so the unrolled scan converged


def report_training(name: str, losses: list[float], every: int = 3) -> None:
    """Prints the loss curve of a training run, and fails unless it at least halved the loss.

    Args:
      name: what was trained (say, which gradient), printed first.
      losses: the loss before each step, and after the last.
      every: print every ``every``-th loss, then the last.
    """
    shown = ", ".join(f"{loss:.4f}" for loss in losses[::every])
    print(f"{name:9s} loss: {shown} ... {losses[-1]:.4f}")
    if not losses[-1] < 0.5 * losses[0]:
        raise AssertionError(f"{name}: the loss did not decrease enough: {losses}")


def max_gap(a: Any, b: Any) -> float:
    """The largest absolute difference between two pytrees of arrays."""
    gaps = jax.tree.map(lambda x, y: jnp.max(jnp.abs(x - y)), a, b)
    return float(max(jax.tree.leaves(gaps)))
