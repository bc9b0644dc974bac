"""The flagship solver inside ``hk.transform``, with a Haiku module in the fixed-point map.

``fpsolve`` is unchanged: it calls ``jaxoverride.jit``, ``jaxoverride.lax.while_loop``
and ``jaxoverride.jacfwd``. With ``jaxoverride_haiku.context()`` active, the map may be a
Haiku module: init creates its parameters through the solver's ``jit`` and ``while_loop``
(and, for Newton, ``jacfwd``), and apply with the problem's weights finds the same fixed
point as raw JAX. Run it directly for a small table, or through ``fixed_point.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jaxoverride_haiku as joh
from _demo import UNROLLED_STEPS, Problem, Row, make_problem, max_gap, timed
from fpsolve import fixed_point

METHODS = ("forward", "anderson", "newton")


class DenseMap(hk.Module):
    """``f(z, x) = tanh(z @ W + x @ U + b)`` as a Haiku module."""

    def __init__(self, n: int, name: str = "dense_map"):
        super().__init__(name=name)
        self.recurrent = hk.Linear(n, name="recurrent")  # W and b
        self.injection = hk.Linear(n, with_bias=False, name="injection")  # U

    def __call__(self, z: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.tanh(self.recurrent(z) + self.injection(x))


def problem_params(problem: Problem) -> hk.Params:
    """The problem's weights in the layout ``DenseMap`` creates at init."""
    return {
        "dense_map/~/recurrent": {"w": problem.W, "b": problem.b},
        "dense_map/~/injection": {"w": problem.U},
    }


def model(n: int, method: str, max_iter: int = 200) -> hk.Transformed:
    """A deep-equilibrium layer: the fixed point of ``DenseMap`` for the input ``x``."""

    def solve(x: jax.Array):
        layer = DenseMap(n)  # built outside the map: built inside, each call would add one
        f = lambda z, x: layer(z, x)
        return fixed_point(f, jnp.zeros(n), x, method=method, max_iter=max_iter)

    return hk.transform(solve)


def run(problem: Problem) -> list[Row]:
    """Init and apply through the unchanged solver; apply uses the problem's weights."""
    rows = []
    params = problem_params(problem)
    for method in METHODS:
        deq = model(problem.n, method)
        with joh.context():
            created = jax.jit(deq.init)(jax.random.PRNGKey(0), problem.x)
            shapes = jax.tree.map(jnp.shape, created)
            if shapes != jax.tree.map(jnp.shape, params):
                raise AssertionError(f"haiku/{method}: init created {shapes}")
            apply = jax.jit(deq.apply)
            solution, ms = timed(lambda apply=apply: apply(params, None, problem.x))
        rows.append(Row("haiku", method, int(solution.iterations), float(solution.residual), ms,
                        np.asarray(solution.value)))  # fmt: skip
    return rows


def gradient_gap(problem: Problem) -> float:
    """Implicit (fpsolve's default) against unrolled gradients w.r.t. the Haiku params."""
    params = problem_params(problem)

    def grad(deq: hk.Transformed) -> hk.Params:
        loss = lambda params: jnp.sum(deq.apply(params, None, problem.x).value ** 2)
        return jax.jit(jax.grad(loss))(params)

    with joh.context():
        implicit = grad(model(problem.n, "anderson"))
        unrolled = grad(model(problem.n, "unrolled", max_iter=UNROLLED_STEPS))
    return max_gap(implicit, unrolled)


if __name__ == "__main__":
    for row in run(make_problem()):
        print(f"{row.framework:6s} {row.method:9s} {row.iterations:4d} iterations, "
              f"residual {row.residual:.1e}, {row.wall_ms:.3f} ms")  # fmt: skip
