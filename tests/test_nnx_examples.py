"""The NNX examples: the flagship solver agrees with raw JAX, and the DEQ layer learns."""

from __future__ import annotations

import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))

import deq_nnx  # noqa: E402
import fixed_point_nnx  # noqa: E402
from _demo import make_problem  # noqa: E402
from _examples import check_fixed_point_rows  # noqa: E402


def test_fixed_point_rows_match_raw_jax():
    check_fixed_point_rows(fixed_point_nnx, "nnx", same_iterations=False)


def test_fixed_point_counts_every_evaluation():
    problem = make_problem()
    model = fixed_point_nnx.DenseMap.from_problem(problem)
    solution = fixed_point_nnx.counted_solve(model, problem)
    assert int(model.calls[...]) == int(solution.iterations)


def test_deq_training_lowers_the_loss():
    for gradient in ("implicit", "unrolled"):
        losses = deq_nnx.train(gradient, steps=3)
        assert losses[-1] < 0.5 * losses[0], (gradient, losses)
