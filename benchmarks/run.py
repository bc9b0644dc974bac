"""``make bench``: run every suite in its own process and write the report.

Writes ``benchmarks/results/results.json`` (every row), ``docs/benchmark-report.md`` (the
summary, and per suite a chart and two tables: ratios, targets and whether each is met;
then the times and notes) and ``docs/assets/benchmark-report-<suite>.png`` (each row as a
bar, with its target).
``python -m benchmarks.run --report-only`` redraws the report and the charts from the
saved rows, keeping the header (date, versions, machine) of the run that measured them.

``--gpu`` names the run made on a GPU machine: its rows go to ``results/results-gpu.json``,
its page to ``docs/benchmark-report-gpu.md`` and its charts to ``benchmark-gpu-<suite>.png``,
beside the CPU report and never over it. ``--results PATH`` writes the rows there instead
(after each suite, so that a run stopped part-way keeps the suites it finished).
``--deadline SECONDS`` runs the suites that start after that many seconds with ``--quick``
(fewer rounds), and says so in each of their rows' notes: for a machine lent for minutes.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
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
_MEASURED = re.compile(r"\A# Benchmark report[^\n]*\n\n(.*?)\n\n", re.DOTALL)
_MACHINE = re.compile(r"; Python [\w.+]+; (.*?)\. Written by")


QUICK_NOTE = "quick: fewer rounds (the run's --deadline had passed)"


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


def _option(name: str) -> str | None:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else None


def _machine() -> str:
    import jax

    backend = jax.default_backend()
    kind = "" if backend == "cpu" else f" ({jax.devices()[0].device_kind})"
    return f"{platform.machine()}, {os.cpu_count()} cores; {backend.upper()} backend{kind}"


def main() -> None:
    quick = "--quick" in sys.argv
    gpu = "--gpu" in sys.argv
    prefix = "benchmark-gpu" if gpu else "benchmark-report"
    report = DOCS / ("benchmark-report-gpu.md" if gpu else "benchmark-report.md")
    default_results = RESULTS / ("results-gpu.json" if gpu else "results.json")
    results = Path(_option("--results") or default_results)
    results.parent.mkdir(parents=True, exist_ok=True)
    if "--report-only" in sys.argv:
        rows = json.loads(results.read_text())
    else:
        rows = []
        deadline = time.perf_counter() + float(_option("--deadline") or "inf")
        for suite in SUITES:
            start = time.perf_counter()
            late = not quick and start > deadline
            try:
                suite_rows = _run_suite(suite, quick or late)
            except subprocess.CalledProcessError as error:
                # One suite that cannot run here (a machine without a library, a solver that
                # does not converge in this precision) must not cost the others.
                print(f"{suite}: failed ({error}); the report goes on without it", flush=True)
                continue
            for row in suite_rows if late else []:
                row["note"] = f"{row['note']}; {QUICK_NOTE}" if row["note"] else QUICK_NOTE
            rows += suite_rows
            results.write_text(json.dumps(rows, indent=1))
            print(f"{suite}: {time.perf_counter() - start:.0f} s", flush=True)
    import jax

    machine = _machine()
    title = "# Benchmark report, GPU" if gpu else "# Benchmark report"
    measured = _MEASURED.match(report.read_text()) if report.exists() else None
    if "--report-only" in sys.argv and measured and (found := _MACHINE.search(measured[1])):
        # The rows were measured then and there, not now and here.
        header = f"{title}\n\n{measured[1]}"
        machine = found[1]
    else:
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        header = (
            f"{title}\n\n{stamp}; jax {jax.__version__}; "
            f"Python {platform.python_version()}; {machine}. Written by `make bench` "
            "(`benchmarks/run.py`); what each suite measures is in [Benchmarks](benchmarks.md). "
            "Ratios are medians of per-round ratios over interleaved rounds "
            "(lower is faster for ours)."
        )
    report.write_text(markdown(rows, header, CHARTS, prefix))
    for stale in (DOCS / CHARTS).glob(f"{prefix}-*.png"):
        stale.unlink()  # a suite that is gone leaves no chart behind
    caption = f"ours against raw JAX and its peers ({machine})"
    charts = bar_charts(rows, DOCS / CHARTS, caption, prefix)
    print(f"wrote {report} and {len(charts)} charts in {DOCS / CHARTS}")


if __name__ == "__main__":
    main()
