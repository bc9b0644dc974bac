"""optimistix, lineax and diffrax, unmodified, with a Flax NNX module under ``track``.

The packages must be interposed before their first import (``jo.interpose_on_import``):
``eqx.filter_jit`` builds its ``jax.jit`` while they are imported. So each group of cases
runs in a fresh interpreter (``tests/_equinox_nnx.py``), which prints JSON; both groups
start at once. Every case compares, against the same library on explicit arrays: the
solution eagerly and under ``jo.jit`` (also after the weights change: never stale, never
retraced), ``jo.grad`` with respect to the module and the input (also under ``jo.jit``),
that no Variable is left holding a tracer, and that a callback writing a call counter is
refused with ``PureFunctionWriteError`` and leaves the counter as it was.

``jax.checking_leaks()`` is not used: it crashes inside JAX's own leak reporter on raw
optimistix. The leak check looks at every Variable and gradient leaf instead.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# Each test runs fresh interpreters that import the solver libraries: `make test-slow`.
pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("_equinox_nnx.py")
GROUPS = {
    "optimistix": [
        "fixed_point_iteration",
        "fixed_point_chord",
        "root_find_newton",
        "least_squares_gauss_newton",
    ],
    "lineax_diffrax": ["linear_solve_gmres", "neural_ode_tsit5"],
}
CASES = [case for cases in GROUPS.values() for case in cases]
TOLERANCE = 2e-5


def _pythonpath() -> str:
    root = Path(__file__).resolve().parent.parent
    return os.pathsep.join([str(root / "src"), str(root / "adapters")])


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": _pythonpath(), "XLA_FLAGS": ""}
    runs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), *cases],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for cases in GROUPS.values()
    ]
    merged: dict[str, Any] = {}
    for run in runs:
        out, err = run.communicate(timeout=900)
        assert run.returncode == 0, err[-3000:]
        merged.update(json.loads(out.strip().splitlines()[-1]))
    return merged


def _number(value: Any) -> float:
    assert isinstance(value, (int, float)), f"the step failed: {value}"
    return float(value)


@pytest.mark.parametrize("case", CASES)
def test_solution_eager_and_jitted_equal_the_explicit_reference(results, case):
    result = results[case]
    assert _number(result["eager"]) <= TOLERANCE
    assert _number(result["jit"]) <= TOLERANCE


@pytest.mark.parametrize("case", CASES)
def test_jitted_solution_is_never_stale_and_not_retraced(results, case):
    changed = results[case]["jit_after_change"]
    assert isinstance(changed, dict) and "moved" in changed, changed
    assert changed["moved"] > 1e-3  # the weights change moved the solution...
    assert changed["error"] <= TOLERANCE  # ...and the jitted solve followed it
    assert results[case]["jit_traces"] == 1  # new weights are inputs, not a retrace


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode", ["grad", "jit_grad"])
def test_gradient_wrt_module_and_input_equals_the_reference(results, case, mode):
    """For ``linear_solve_gmres`` this is the regression test of ``jo.grad`` through
    ``lineax.linear_solve`` ("No constant handler for type: LinearizeTracer")."""
    gradient = results[case][mode]
    assert isinstance(gradient, dict) and "w" in gradient, gradient
    assert gradient["norm"] > 1e-2  # a gradient that could be wrong
    assert gradient["w"] <= TOLERANCE * max(1.0, gradient["norm"])
    assert gradient["x"] <= TOLERANCE * max(1.0, gradient["norm"])
    assert gradient["leaked"] == []


@pytest.mark.parametrize("case", CASES)
def test_no_variable_is_left_holding_a_tracer(results, case):
    assert results[case]["leaked"] == []
    assert results[case]["write_leaked"] == []


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode", ["write", "write_jit"])
def test_a_state_write_in_the_callback_is_refused_clearly(results, case, mode):
    outcome = results[case][mode]
    assert isinstance(outcome, dict), f"the write was not refused: {outcome}"
    assert outcome["error"] == "jaxoverride_nnx.PureFunctionWriteError"
    assert "Cell.calls" in outcome["message"]
    assert "fixed outputs" in outcome["message"]
    assert results[case]["write_calls"] == 0  # the refusal left the counter as it was


def test_deq_optimistix_example_trains_and_matches_explicit_gradients():
    example = Path(__file__).resolve().parent.parent / "examples" / "deq_optimistix_nnx.py"
    env = {**os.environ, "PYTHONPATH": _pythonpath(), "XLA_FLAGS": ""}
    run = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, env=env, timeout=900
    )
    assert run.returncode == 0, run.stderr[-3000:]
    pattern = r"error vs explicit parameters: (\S+) \(norm (\S+)\)"
    error, norm = map(float, re.findall(pattern, run.stdout)[0])
    assert norm > 1e-3 and error <= 1e-5 * max(1.0, norm)
    losses = [float(v) for v in re.findall(r"\d+\.\d+", run.stdout.splitlines()[-1])]
    assert losses[-1] < 0.5 * losses[0]
