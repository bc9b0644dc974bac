"""``make bench``: run every suite in its own process and write the report.

Writes ``benchmarks/results/results.json`` (every row), ``docs/benchmark-report.md`` (the
summary, the chart and two tables per suite: ratios, targets and whether each is met;
then the times and notes) and ``docs/assets/benchmark-report.png`` (every ratio as a bar,
with its target).
``python -m benchmarks.run --report-only`` redraws the report from the saved rows.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from benchmarks._report import bar_chart, markdown

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
CHART = "assets/benchmark-report.png"


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

    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = f"{platform.machine()}, {os.cpu_count()} cores; CPU backend"
    header = (
        f"# Benchmark report\n\n{stamp}; jax {jax.__version__}; "
        f"Python {platform.python_version()}; {machine}. Written by `make bench` "
        "(`benchmarks/run.py`); what each suite measures is in [Benchmarks](benchmarks.md). "
        "Ratios are medians of per-round ratios over interleaved rounds "
        "(lower is faster for ours)."
    )
    (DOCS / "benchmark-report.md").write_text(markdown(rows, header, CHART))
    bar_chart(rows, DOCS / CHART, f"jaxoverride against raw JAX and its peers ({machine})")
    print(f"wrote {DOCS / 'benchmark-report.md'} and {DOCS / CHART}")


if __name__ == "__main__":
    main()
