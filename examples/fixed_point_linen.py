"""The flagship solver inside a Flax Linen module.

``fpsolve`` is unchanged: it calls ``jaxoverride.jit``, ``jaxoverride.lax.while_loop``
and ``jaxoverride.jacfwd``. With ``jaxoverride_linen.install()``, the fixed-point map may
call the Linen submodules of the module that runs the solver: ``model.init`` creates
their parameters through the solver's ``jit`` and ``while_loop`` (and, for Newton,
``jacfwd``), once and under the names Linen gives them outside a loop, and
``model.apply`` with the problem's weights finds the same fixed point as raw JAX.

Run it with ``python examples/fixed_point_linen.py``, or through ``fixed_point.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jaxoverride_linen
from _demo import UNROLLED_STEPS, Problem, Row, make_problem, max_gap, timed
from fpsolve import fixed_point

METHODS = ("forward", "anderson", "newton")


class FixedPointLayer(nn.Module):
    """``z* = tanh(z* W + x U + b)``, the map's layers defined in ``setup``."""

    n: int
    method: str = "anderson"
    max_iter: int = 200

    def setup(self) -> None:
        self.recurrent = nn.Dense(self.n)  # W and b
        self.injection = nn.Dense(self.n, use_bias=False)  # U

    def cell(self, z: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.tanh(self.recurrent(z) + self.injection(x))

    def solve(self, x: jax.Array) -> Any:
        """The solver's whole ``Solution``: value, iterations and residual."""
        z0 = jnp.zeros(self.n)
        return fixed_point(self.cell, z0, x, method=self.method, max_iter=self.max_iter)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.solve(x).value


def variables_of(problem: Problem) -> dict[str, Any]:
    """The problem's weights as the layer's variables (``nn.Dense`` is ``x @ kernel + bias``)."""
    return {
        "params": {
            "recurrent": {"kernel": problem.W, "bias": problem.b},
            "injection": {"kernel": problem.U},
        }
    }


def run(problem: Problem) -> list[Row]:
    """One row per method: the Linen layer's compiled apply through the unchanged solver."""
    rows = []
    variables = variables_of(problem)
    with jaxoverride_linen.context():
        for method in METHODS:
            layer = FixedPointLayer(problem.n, method)
            created = layer.init(jax.random.PRNGKey(0), problem.x)
            if jax.tree.map(jnp.shape, created) != jax.tree.map(jnp.shape, variables):
                raise AssertionError(f"linen/{method}: init created {created}")
            # One compiled call of the whole solve, timed as for every framework.
            apply = jax.jit(lambda v, x, layer=layer: layer.apply(v, x, method="solve"))
            solution, ms = timed(lambda apply=apply: apply(variables, problem.x))
            rows.append(Row("linen", method, int(solution.iterations), float(solution.residual),
                            ms, np.asarray(solution.value)))  # fmt: skip
    return rows


def gradient_gap(problem: Problem) -> float:
    """Implicit (fpsolve's default) against unrolled gradients w.r.t. the layer's params."""
    variables = variables_of(problem)

    def loss(params: Any, layer: FixedPointLayer) -> jax.Array:
        # Linen types apply's result loosely (it may be a pair); this call returns z*.
        return jnp.sum(cast(jax.Array, layer.apply({"params": params}, problem.x)) ** 2)

    implicit_layer = FixedPointLayer(problem.n, "anderson")
    unrolled_layer = FixedPointLayer(problem.n, "unrolled", max_iter=UNROLLED_STEPS)
    with jaxoverride_linen.context():
        implicit = jax.jit(jax.grad(lambda p: loss(p, implicit_layer)))(variables["params"])
        unrolled = jax.jit(jax.grad(lambda p: loss(p, unrolled_layer)))(variables["params"])
    return max_gap(implicit, unrolled)


def main() -> None:
    problem = make_problem()
    layer = FixedPointLayer(problem.n)
    try:
        jax.jit(layer.init)(jax.random.PRNGKey(0), problem.x)
    except Exception as error:  # what happens without the adapter
        print(f"without jaxoverride_linen: {type(error).__name__}")
    for row in run(problem):
        print(
            f"{row.method:9s} {row.iterations:4d} iterations  residual {row.residual:.2e}  "
            f"{row.wall_ms:.3f} ms"
        )
    print(f"max |grad_implicit - grad_unrolled| = {gradient_gap(problem):.2e}")


if __name__ == "__main__":
    main()
