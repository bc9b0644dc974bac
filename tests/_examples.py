"""What the tests of the flagship examples share: ``examples/`` on the path, and the check
that a framework's fixed-point rows equal the same solve on raw JAX."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
if str(EXAMPLES) not in sys.path:  # the example tests put it there before importing examples
    sys.path.insert(0, str(EXAMPLES))

from _demo import dense_map, make_problem  # noqa: E402
from fpsolve import fixed_point  # noqa: E402


def check_fixed_point_rows(example: Any, framework: str, *, same_iterations: bool) -> None:
    """``example.run`` gives one row per method of ``example.METHODS``, in order, each
    converged to raw JAX's solution (and, with ``same_iterations``, in as many steps)."""
    problem = make_problem()
    rows = example.run(problem)
    assert [row.method for row in rows] == list(example.METHODS)
    for row in rows:
        expected = fixed_point(dense_map, jnp.zeros(problem.n), problem.args, method=row.method)
        assert row.framework == framework
        np.testing.assert_allclose(row.solution, expected.value, atol=1e-5)
        if same_iterations:
            assert row.iterations == int(expected.iterations)
        assert row.residual < 1e-4
