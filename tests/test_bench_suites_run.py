"""Every benchmark suite runs to the end, quickly, and measures every row.

``make bench`` is not part of CI, and a suite reports a case that raises as one row
"not measured: ..." instead of crashing (``benchmarks._harness.guarded``), so a change
that breaks a benchmarked program would only show in the next report. Each suite runs
here with ``--quick`` (fewer rounds), in its own process as ``benchmarks.run`` runs it;
no timing is asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from flax import nnx

ROOT = Path(__file__).resolve().parent.parent
SUITES = sorted(path.stem for path in (ROOT / "benchmarks").glob("bench_*.py"))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not hasattr(nnx, "jit_partial"),
        reason="the benchmarks run on the newest stack (make bench uses .venv): on the "
        "oldest pins Flax has no nnx.jit_partial, one of bench_nnx's peers",
    ),
]


@pytest.mark.parametrize("suite", SUITES)
def test_the_suite_runs_and_measures_every_row(suite, tmp_path):
    out = tmp_path / "rows.json"
    env = dict(os.environ)
    env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    command = [sys.executable, "-m", f"benchmarks.{suite}", "--quick", "--json", str(out)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert rows, f"{suite} reported no rows"
    unmeasured = [row["note"] for row in rows if row["note"].startswith("not measured")]
    assert not unmeasured, f"{suite}: {unmeasured}"
