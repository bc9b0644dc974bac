"""The flagship solver with a Flax NNX model captured by closure.

``fpsolve`` knows nothing about NNX: it calls ``jaxoverride.jit``, ``lax.while_loop``
and ``jacfwd``. The fixed-point map here is an ``nnx.Module`` that also counts its
calls in a Variable. Without ``jaxoverride_nnx`` the solver fails
(``TraceContextError``: the counter cannot be written from inside the trace, under raw
``jax.*`` and ``nnx.*`` alike). Inside ``jaxoverride_nnx.track(model)`` it runs
unchanged, the counter ends at the number of evaluations eager Python would have made,
and the solution equals raw JAX's for the same weights.

Run it with ``python examples/fixed_point_nnx.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jaxoverride as jo
import jaxoverride_nnx
from _demo import UNROLLED_STEPS, Problem, Row, make_problem, max_gap, timed
from fpsolve import fixed_point

METHODS = ("forward", "anderson", "newton")


class DenseMap(nnx.Module):
    """``f(z, x) = tanh(z W + x U + b)`` as NNX layers, counting its evaluations."""

    def __init__(self, n: int, d: int, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(n, n, use_bias=False, rngs=rngs)
        self.inject = nnx.Linear(d, n, rngs=rngs)
        self.calls = nnx.Variable(jnp.array(0))

    def __call__(self, z: jax.Array, x: jax.Array) -> jax.Array:
        self.calls[...] += 1
        return jnp.tanh(self.hidden(z) + self.inject(x))

    @classmethod
    def from_problem(cls, problem: Problem) -> DenseMap:
        """The layers with the problem's weights (``nnx.Linear`` uses the same layout)."""
        model = cls(problem.n, problem.U.shape[0], nnx.Rngs(0))
        model.hidden.kernel[...] = problem.W
        model.inject.kernel[...] = problem.U
        assert model.inject.bias is not None  # nnx.Linear's bias is optional; it has one
        model.inject.bias[...] = problem.b
        return model


def run(problem: Problem) -> list[Row]:
    """One row per method: the NNX model inside the unchanged solver."""
    model = DenseMap.from_problem(problem)

    def f(z: jax.Array, x: jax.Array) -> jax.Array:
        return model(z, x)

    z0 = jnp.zeros(problem.n)
    rows = []
    with jaxoverride_nnx.track(model):
        for method in METHODS:
            # One compiled call of the whole solve, timed as for every framework.
            # The map writes state (its call counter). Closure conversion, which the
            # implicit gradient needs, makes a function pure, so the adapter refuses a
            # write inside it: this forward-only demo keeps the bare loop.
            solve = jo.jit(lambda x, m=method: fixed_point(f, z0, x, method=m, implicit=False))
            solution, ms = timed(lambda solve=solve: solve(problem.x))
            rows.append(Row("nnx", method, int(solution.iterations), float(solution.residual), ms,
                            np.asarray(solution.value)))  # fmt: skip
    return rows


def counted_solve(model: DenseMap, problem: Problem) -> Any:
    """Forward iteration, eager, of the tracked model: its counter counts every call."""
    with jaxoverride_nnx.track(model):
        return fixed_point(
            lambda z, x: model(z, x),
            jnp.zeros(problem.n),
            problem.x,
            method="forward",
            jit=False,
            implicit=False,
        )


def gradient_gap(problem: Problem) -> float:
    """Implicit (fpsolve's default) against unrolled gradients w.r.t. the module's Params.

    The map reads the layers but not the call counter: a write inside it could not come
    out of the closure conversion that the implicit gradient uses (the adapter refuses it).
    """
    model = DenseMap.from_problem(problem)
    f = lambda z, x: jnp.tanh(model.hidden(z) + model.inject(x))
    z0 = jnp.zeros(problem.n)

    def loss(module: DenseMap, **options: Any) -> jax.Array:
        del module  # the map reads the tracked model, which jo.grad differentiates
        # The solver's own jo.jit runs inside the jo.jit of the gradient below.
        return jnp.sum(fixed_point(f, z0, problem.x, **options).value ** 2)

    with jaxoverride_nnx.track(model):
        implicit = jo.jit(lambda: jo.grad(lambda m: loss(m, method="anderson"))(model))()
        unrolled = jo.jit(
            lambda: jo.grad(lambda m: loss(m, method="unrolled", max_iter=UNROLLED_STEPS))(model)
        )()
    return max_gap(implicit, unrolled)


def main() -> None:
    problem = make_problem()
    model = DenseMap.from_problem(problem)
    try:
        fixed_point(lambda z, x: model(z, x), jnp.zeros(problem.n), problem.x, implicit=False)
    except Exception as error:  # what happens without the adapter
        print(f"without track: {type(error).__name__}")
    solution = counted_solve(model, problem)
    print(
        f"forward iteration: {int(solution.iterations)} steps, the model counted "
        f"{int(model.calls[...])} calls (1 per step)"
    )
    for row in run(problem):
        print(
            f"{row.method:9s} {row.iterations:4d} iterations  residual {row.residual:.2e}  "
            f"{row.wall_ms:.3f} ms"
        )


if __name__ == "__main__":
    main()
