"""``examples/deq_dropout.py``: a DEQ classifier with dropout and BatchNorm in its map, in
Haiku, Linen and NNX, under ``jaxoverride.solve_state``: one mask per solve converges where
a mask per evaluation does not, the classifier trains, and the checked-in figure is the
example's."""

from __future__ import annotations

from typing import Any

import pytest

import _examples  # noqa: F401  (puts examples/ on the path)
import deq_dropout

_CURVES: dict[str, dict[str, list[float]]] = {}


def curves_of(framework: str) -> dict[str, list[float]]:
    """``framework``'s residual curves, computed once per test session."""
    if framework not in _CURVES:
        _CURVES[framework] = deq_dropout.modules()[framework].residual_curves()
    return _CURVES[framework]


@pytest.mark.parametrize("framework", deq_dropout.FRAMEWORKS)
def test_one_mask_per_solve_converges_and_a_mask_per_evaluation_does_not(framework: str):
    per_solve, per_evaluation = (curves_of(framework)[k] for k in ("per_solve", "per_evaluation"))
    # The same first step (the same entry state), then one keeps its map and converges.
    assert per_solve[0] == pytest.approx(per_evaluation[0])
    assert len(per_solve) < deq_dropout.FIGURE_ITERATIONS / 2, per_solve
    assert per_solve[-1] <= 1e-6
    # A new mask at each evaluation: the map moves by the dropout noise at every step.
    assert len(per_evaluation) == deq_dropout.FIGURE_ITERATIONS
    assert min(per_evaluation[1:]) > 1e-2, per_evaluation


def test_the_example_draws_the_checked_in_figure(tmp_path: Any):
    drawn = tmp_path / "figure.png"
    deq_dropout.draw_figure({name: curves_of(name) for name in deq_dropout.FRAMEWORKS}, drawn)
    assert drawn.stat().st_size > 10_000
    assert deq_dropout.FIGURE.is_file(), "run python examples/deq_dropout.py to draw it"
    assert deq_dropout.FIGURE.stat().st_size > 10_000


@pytest.mark.parametrize("framework", deq_dropout.FRAMEWORKS)
def test_the_classifier_trains_with_dropout_and_batchnorm_in_the_solve(framework: str):
    losses, held_out = deq_dropout.modules()[framework].train(steps=4)
    assert losses[-1] < 0.8 * losses[0], losses
    assert held_out > 0.5  # three classes: chance is 1/3; inference uses the running stats
