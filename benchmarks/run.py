"""``make bench``: run every suite in its own process and write the report.

Writes ``benchmarks/results/results.json`` (every row), ``docs/benchmark-report.md`` (the
summary, and per suite a chart and two tables: ratios, targets and whether each is met;
then the times and notes) and ``docs/assets/benchmark-report-<suite>.png`` (each row as a
bar, with its target).
``python -m benchmarks.run --report-only`` redraws the report and the charts from the
saved rows, keeping the header (date, versions, machine) of the run that measured them.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from benchmarks._report import bar_charts, markdown

SUITES = [
    "bench_core",
    "bench_haiku",
    "bench_nnx",
    "bench_dag",
    "bench_debug",
    "bench_implicit",
    "bench_equinox",
    "bench_equinox_nnx",
    "bench_linen",
]
HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
DOCS = HERE.parent / "docs"
CHARTS = "assets"  # relative to the report page
REPORT = DOCS / "benchmark-report.md"
_MEASURED = re.compile(r"\A# Benchmark report\n\n(.*?)\n\n", re.DOTALL)
_MACHINE = re.compile(r"; Python [\w.+]+; (.*?)\. Written by")


def _run_suite(suite: str, quick: bool) -> list[dict]:
    if not (HERE / f"{suite}.py").exists():
        return []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        command = [sys.executable, "-m", f"benchmarks.{suite}", "--json", str(out)]
        if quick:
            command.append("--quick")
        env = dict(os.environ)
        env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
        subprocess.run(command, check=True, cwd=HERE.parent, env=env)
        return json.loads(out.read_text())


def main() -> None:
    quick = "--quick" in sys.argv
    RESULTS.mkdir(exist_ok=True)
    if "--report-only" in sys.argv:
        rows = json.loads((RESULTS / "results.json").read_text())
    else:
        rows = []
        for suite in SUITES:
            rows += _run_suite(suite, quick)
        (RESULTS / "results.json").write_text(json.dumps(rows, indent=1))
    import jax

    machine = f"{platform.machine()}, {os.cpu_count()} cores; CPU backend"
    measured = _MEASURED.match(REPORT.read_text()) if REPORT.exists() else None
    if "--report-only" in sys.argv and measured and (found := _MACHINE.search(measured[1])):
        # The rows were measured then and there, not now and here.
        header = f"# Benchmark report\n\n{measured[1]}"
        machine = found[1]
    else:
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        header = (
            f"# Benchmark report\n\n{stamp}; jax {jax.__version__}; "
            f"Python {platform.python_version()}; {machine}. Written by `make bench` "
            "(`benchmarks/run.py`); what each suite measures is in [Benchmarks](benchmarks.md). "
            "Ratios are medians of per-round ratios over interleaved rounds "
            "(lower is faster for ours)."
        )
    REPORT.write_text(markdown(rows, header, CHARTS))
    for stale in (DOCS / CHARTS).glob("benchmark-report*.png"):
        stale.unlink()  # a suite that is gone leaves no chart behind
    charts = bar_charts(rows, DOCS / CHARTS, f"ours against raw JAX and its peers ({machine})")
    print(f"wrote {REPORT} and {len(charts)} charts in {DOCS / CHARTS}")


if __name__ == "__main__":
    main()
