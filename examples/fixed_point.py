"""The flagship demo (``make demo``): one solver library, every framework.

``fpsolve`` is written only against jaxoverride's neutral API. This script runs the same
solver on the same fixed-point problem with raw JAX, with lazily initialised weights
under ``jaxoverride_plain``, inside ``hk.transform`` with a Haiku module, with a
closure-captured Flax NNX module and inside a Flax Linen module, then prints whether the
solutions agree and how many iterations and how much wall time each took. Then it trains
through the solver: for each framework, the gradient of ``sum(z*^2)`` with respect to
the weights (or, for the lazily created plain weights, the input), by fpsolve's default
implicit differentiation (closure conversion and a custom VJP that solves the adjoint
fixed point), against backpropagation through an unrolled scan of 300 steps.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jaxoverride as jo
import jaxoverride_plain as plain
from _demo import UNROLLED_STEPS, Problem, Row, dense_map, make_problem, max_gap, timed
from fpsolve import fixed_point

METHODS = ("forward", "anderson", "newton")
TOLERANCE = 1e-4
GRADIENT_TOLERANCE = 1e-3


def run_jax(problem: Problem) -> list[Row]:
    """Raw JAX: the weights travel explicitly in ``args``."""
    z0 = jnp.zeros(problem.n)
    rows = []
    for method in METHODS:
        # Every framework's row times one compiled call of the whole solve.
        solve = jo.jit(lambda args, m=method: fixed_point(dense_map, z0, args, method=m))
        solution, ms = timed(lambda solve=solve: solve(problem.args))
        rows.append(Row("jax", method, int(solution.iterations), float(solution.residual), ms,
                        np.asarray(solution.value)))  # fmt: skip
    return rows


class LazyDense:
    """A Keras-style layer that creates its weights the first time it runs at init.

    Its initialiser computes (here: copies the problem's weights), so creating the
    weights inside the solver's ``jit`` or ``while_loop`` trace would store tracers;
    ``jaxoverride_plain`` creates them outside any trace instead.
    """

    def __init__(self, problem: Problem):
        self.problem = problem
        self.weights: tuple[jax.Array, ...] | None = None

    def __call__(self, z: jax.Array, x: jax.Array) -> jax.Array:
        if self.weights is None:
            if not plain.is_initializing():
                raise RuntimeError("LazyDense: run it once under init_context() first")
            p = self.problem
            self.weights = (p.W * 1.0, p.U * 1.0, p.b * 1.0)
        W, U, b = self.weights
        return jnp.tanh(z @ W + x @ U + b)


def run_plain(problem: Problem) -> list[Row]:
    """Lazily created weights: init and apply both go through the unchanged solver."""
    z0 = jnp.zeros(problem.n)
    rows = []
    for method in METHODS:
        layer = LazyDense(problem)
        with plain.context():
            with plain.init_context():
                at_init = fixed_point(layer, z0, problem.x, method=method)
            solve = jo.jit(lambda x, m=method, f=layer: fixed_point(f, z0, x, method=m))
            solution, ms = timed(lambda solve=solve: solve(problem.x))
        if not np.allclose(at_init.value, solution.value, atol=1e-6):
            raise AssertionError(f"plain/{method}: init result differs from apply")
        rows.append(Row("plain", method, int(solution.iterations), float(solution.residual), ms,
                        np.asarray(solution.value)))  # fmt: skip
    return rows


def gradient_gap_jax(problem: Problem) -> float:
    """Raw JAX: implicit against unrolled gradients w.r.t. ``(W, U, b, x)``."""
    z0 = jnp.zeros(problem.n)

    def loss(args: tuple[jax.Array, ...], **options: object) -> jax.Array:
        return jnp.sum(fixed_point(dense_map, z0, args, **options).value ** 2)  # type: ignore[arg-type]

    implicit = jax.jit(jax.grad(lambda a: loss(a, method="anderson")))(problem.args)
    unrolled = jax.grad(lambda a: loss(a, method="unrolled", max_iter=UNROLLED_STEPS))
    return max_gap(implicit, jax.jit(unrolled)(problem.args))


def gradient_gap_plain(problem: Problem) -> float:
    """Lazily created weights: implicit against unrolled gradients w.r.t. the input ``x``."""
    z0 = jnp.zeros(problem.n)
    layer = LazyDense(problem)
    with plain.context():
        with plain.init_context():
            fixed_point(layer, z0, problem.x)

        def loss(x: jax.Array, **options: object) -> jax.Array:
            return jnp.sum(fixed_point(layer, z0, x, **options).value ** 2)  # type: ignore[arg-type]

        implicit = jo.jit(jo.grad(lambda x: loss(x, method="anderson")))(problem.x)
        unrolled = jo.jit(jo.grad(lambda x: loss(x, method="unrolled", max_iter=UNROLLED_STEPS)))
        return max_gap(implicit, unrolled(problem.x))


def _optional(module: str, name: str = "run") -> Callable[[Problem], Any] | None:
    """A runner of an adapter demo, or None when its framework is not installed."""
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as error:
        print(f"(skipping {module}: {error})")
        return None


def main() -> int:
    problem = make_problem()
    runners: list[Callable[[Problem], list[Row]] | None] = [
        run_jax,
        run_plain,
        _optional("fixed_point_haiku"),
        _optional("fixed_point_nnx"),
        _optional("fixed_point_linen"),
    ]
    rows = [row for runner in runners if runner is not None for row in runner(problem)]
    reference = {row.method: row.solution for row in rows if row.framework == "jax"}
    print(f"Fixed point of z = tanh(z W + x U + b), n = {problem.n}, on {jax.devices()[0]}\n")
    print(f"{'framework':10s} {'method':9s} {'iters':>5s} {'residual':>10s} "
          f"{'max |z - z_jax|':>16s} {'wall ms':>8s}")  # fmt: skip
    agree = True
    for row in rows:
        error = float(np.max(np.abs(row.solution - reference[row.method])))
        agree &= error < TOLERANCE
        print(f"{row.framework:10s} {row.method:9s} {row.iterations:5d} {row.residual:10.2e} "
              f"{error:16.2e} {row.wall_ms:8.3f}")  # fmt: skip
    frameworks = sorted({row.framework for row in rows}, key=[r.framework for r in rows].index)
    verdict = "agree" if agree else "DISAGREE"
    print(f"\nSolutions from {', '.join(frameworks)} {verdict} (tolerance {TOLERANCE:g}).")

    print(f"\nTraining through the solver: implicit gradient (Anderson) against {UNROLLED_STEPS} "
          "unrolled steps")  # fmt: skip
    gaps = {
        "jax": gradient_gap_jax,
        "plain": gradient_gap_plain,
        "haiku": _optional("fixed_point_haiku", "gradient_gap"),
        "nnx": _optional("fixed_point_nnx", "gradient_gap"),
        "linen": _optional("fixed_point_linen", "gradient_gap"),
    }
    close = True
    for framework, measure in gaps.items():
        if measure is None:
            continue
        gap = measure(problem)
        close &= gap < GRADIENT_TOLERANCE
        print(f"{framework:10s} max |grad_implicit - grad_unrolled| = {gap:.2e}")
    verdict = "agree" if close else "DISAGREE"
    print(f"Implicit and unrolled gradients {verdict} (tolerance {GRADIENT_TOLERANCE:g}).")
    return 0 if agree and close else 1


if __name__ == "__main__":
    sys.exit(main())
