"""The NNX examples: the flagship solver agrees with raw JAX, and the DEQ layer learns."""

from __future__ import annotations

import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))

import deq_nnx  # noqa: E402
import fixed_point_nnx  # noqa: E402
import jaxoverride_nnx  # noqa: E402
from _demo import dense_map, make_problem  # noqa: E402
from fpsolve import fixed_point  # noqa: E402


def test_fixed_point_rows_match_raw_jax():
    problem = make_problem()
    rows = fixed_point_nnx.run(problem)
    assert [row.method for row in rows] == list(fixed_point_nnx.METHODS)
    for row in rows:
        expected = fixed_point(dense_map, jnp.zeros(problem.n), problem.args, method=row.method)
        assert row.framework == "nnx"
        np.testing.assert_allclose(row.solution, expected.value, atol=1e-5)
        assert row.residual < 1e-4


def test_fixed_point_counts_every_evaluation():
    problem = make_problem()
    model = fixed_point_nnx.DenseMap.from_problem(problem)
    with jaxoverride_nnx.track(model):
        solution = fixed_point(
            lambda z, x: model(z, x),
            jnp.zeros(problem.n),
            problem.x,
            method="forward",
            jit=False,
            implicit=False,
        )
    assert int(model.calls[...]) == int(solution.iterations)


def test_deq_training_lowers_the_loss():
    for gradient in ("implicit", "unrolled"):
        losses = deq_nnx.train(gradient, steps=3)
        assert losses[-1] < 0.5 * losses[0], (gradient, losses)
