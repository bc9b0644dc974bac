"""The flagship demo (``make demo``): one solver library, every framework.

``fpsolve`` is written only against jaxoverride's neutral API. This script runs the
same solver on the same fixed-point problem with raw JAX, with lazily initialised
weights under ``jaxoverride_plain``, inside ``hk.transform`` with a Haiku module, and
with a closure-captured Flax NNX module, then prints whether the solutions agree and
how many iterations and how much wall time each took.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jaxoverride as jo
import jaxoverride_plain as plain
from _demo import Problem, Row, dense_map, make_problem, timed
from fpsolve import fixed_point

METHODS = ("forward", "anderson", "newton")
TOLERANCE = 1e-4


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


def _optional(module: str) -> Callable[[Problem], list[Row]] | None:
    """The runner of an adapter demo, or None when its framework is not installed."""
    try:
        return importlib.import_module(module).run
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
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
