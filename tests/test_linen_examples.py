"""The Linen examples: the flagship solver agrees with raw JAX, and the DEQ layer learns."""

from __future__ import annotations

import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))

import deq_linen  # noqa: E402
import fixed_point_linen  # noqa: E402
import jaxoverride_linen  # noqa: E402
from _demo import make_problem  # noqa: E402
from _examples import check_fixed_point_rows  # noqa: E402


def test_fixed_point_rows_match_raw_jax():
    check_fixed_point_rows(fixed_point_linen, "linen", same_iterations=True)


def test_fixed_point_implicit_gradient_matches_unrolled():
    assert fixed_point_linen.gradient_gap(make_problem()) < 1e-3


def test_deq_training_lowers_the_loss_and_counts_every_solve():
    with jaxoverride_linen.context():
        for gradient in ("implicit", "unrolled"):
            losses = deq_linen.train(gradient, steps=3)  # asserts the solve count itself
            assert losses[-1] < 0.7 * losses[0], (gradient, losses)
        assert deq_linen.gradient_gap() < 1e-4
