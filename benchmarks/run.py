"""``make bench``: run every suite in its own process and write the report.

Writes ``benchmarks/results/results.json`` (every row), ``docs/benchmark-report.md`` (the
summary, and per suite a chart and two tables: ratios, targets and whether each is met;
then the times and notes) and ``docs/assets/benchmark-report-<suite>.png`` (each row as a
bar, with its target).
The header says when and where the rows were measured, and a line ``Ran on Python ... with
jax ..., jaxlib ..., flax ..., dm-haiku ...`` names the interpreter and the versions of JAX
and the frameworks installed (``ran_on``).
``python -m benchmarks.run --report-only`` redraws the report and the charts from the
saved rows, keeping the header (date, versions, machine) of the run that measured them.

``--gpu`` names the run made on a GPU machine: its rows go to ``results/results-gpu.json``,
its page to ``docs/benchmark-report-gpu.md`` and its charts to ``benchmark-gpu-<suite>.png``,
beside the CPU report and never over it. ``--newest`` names the CPU run on the newest set
(``make bench-newest``: ``.venv-newest``, jax 0.12 on Python 3.12): ``results-newest.json``,
``docs/benchmark-report-newest.md`` and ``benchmark-newest-<suite>.png``, likewise beside it.
``--results PATH`` writes the rows there instead
(after each suite, so that a run stopped part-way keeps the suites it finished).
``--deadline SECONDS`` runs the suites that start after that many seconds with ``--quick``
(fewer rounds), and says so in each of their rows' notes: for a machine lent for minutes.
``--suite NAME`` (repeatable: ``core``, ``haiku``, ...) runs only those suites and puts
their rows in place of theirs in the saved results, keeping every other suite's; the
header stays the one of the run that measured the rest, and each suite run alone says
under its heading when and on what it was measured.
``--help`` lists the options; an unknown one is refused before anything runs or is written.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from importlib import metadata
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
    "bench_solve_state",
]
HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
DOCS = HERE.parent / "docs"
CHARTS = "assets"  # relative to the report page
_MEASURED = re.compile(
    r"\A# Benchmark report[^\n]*\n\n(.*?)\n\n(?:(Ran on Python [^\n]*)\n\n)?", re.DOTALL
)
RAN_ON_DISTRIBUTIONS = ("jax", "jaxlib", "flax", "dm-haiku")
"""The distributions the report's "Ran on" line names, those installed."""
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


def _machine() -> str:
    import jax

    backend = jax.default_backend()
    kind = "" if backend == "cpu" else f" ({jax.devices()[0].device_kind})"
    return f"{platform.machine()}, {os.cpu_count()} cores; {backend.upper()} backend{kind}"


def ran_on() -> str:
    """The report's line naming the Python and the JAX, Flax and Haiku it ran on.

    Returns:
      ``Ran on Python 3.12.1 with jax 0.12.0.1, jaxlib 0.12.0.1, flax 0.12.12, dm-haiku
      0.0.17.``: each of ``RAN_ON_DISTRIBUTIONS`` that is installed, at its version.

    Example::

        >>> ran_on().startswith(f"Ran on Python {platform.python_version()} with jax ")
        True
    """
    versions = []
    for name in RAN_ON_DISTRIBUTIONS:
        try:
            versions.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return f"Ran on Python {platform.python_version()} with {', '.join(versions)}."


def _suite_module(name: str) -> str:
    """``core`` or ``bench_core`` to ``bench_core``; any other name is refused with the list."""
    module = name if name.startswith("bench_") else f"bench_{name}"
    if module not in SUITES:
        names = ", ".join(suite.removeprefix("bench_") for suite in SUITES)
        raise argparse.ArgumentTypeError(f"unknown suite {name!r}; the suites are: {names}")
    return module


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not seconds >= 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return seconds


def parser() -> argparse.ArgumentParser:
    """The command line of ``make bench`` (``python -m benchmarks.run``)."""
    command = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description=(
            "Run every benchmark suite, each in its own process, and write the rows "
            "(benchmarks/results/results.json), the report (docs/benchmark-report.md) and "
            "its charts (docs/assets/)."
        ),
    )
    command.add_argument(
        "--quick", action="store_true", help="fewer rounds in every suite, for smoke tests"
    )
    command.add_argument(
        "--gpu",
        action="store_true",
        help="a GPU machine's run: results-gpu.json, docs/benchmark-report-gpu.md and "
        "benchmark-gpu-*.png, beside the CPU report and never over it",
    )
    command.add_argument(
        "--newest",
        action="store_true",
        help="a CPU run on the newest set (make bench-newest): results-newest.json, "
        "docs/benchmark-report-newest.md and benchmark-newest-*.png, beside the CPU report "
        "and never over it",
    )
    command.add_argument(
        "--results",
        type=Path,
        metavar="PATH",
        help="the rows' file, written after each suite (default: results.json, or "
        "results-gpu.json with --gpu, in benchmarks/results/)",
    )
    command.add_argument(
        "--report-only",
        action="store_true",
        help="measure nothing: redraw the report and charts from the saved rows, keeping "
        "the header of the run that measured them",
    )
    command.add_argument(
        "--deadline",
        type=_seconds,
        default=math.inf,
        metavar="SECONDS",
        help="suites that start after this many seconds run with --quick, and their rows "
        "say so: for a machine lent for minutes",
    )
    command.add_argument(
        "--suite",
        dest="suites",
        action="append",
        type=_suite_module,
        metavar="NAME",
        help="run only this suite (repeatable; "
        + ", ".join(suite.removeprefix("bench_") for suite in SUITES)
        + "); the saved rows of the others are kept",
    )
    return command


def _measured_now() -> str:
    """When and on what a suite run alone (``--suite``) measured its rows."""
    import jax

    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"{stamp}; jax {jax.__version__}; Python {platform.python_version()}; {_machine()}"


def _ordered(by_suite: dict[str, list[dict]]) -> list[dict]:
    """The rows, suite by suite in ``SUITES`` order (rows of unknown suites last)."""
    order = {suite.removeprefix("bench_"): index for index, suite in enumerate(SUITES)}
    names = sorted(by_suite, key=lambda name: order.get(name, len(order)))
    return [row for name in names for row in by_suite[name]]


def main(argv: list[str] | None = None) -> None:
    """Runs the suites named on the command line (all by default) and writes the report."""
    command = parser()
    options = command.parse_args(argv)
    if options.report_only and (options.suites or options.quick or options.deadline < math.inf):
        command.error("--report-only measures nothing: drop --suite, --quick and --deadline")
    if options.gpu and options.newest:
        command.error("--gpu and --newest name different reports: give one")
    quick, gpu = options.quick, options.gpu
    variant = "gpu" if gpu else "newest" if options.newest else ""
    prefix = f"benchmark-{variant}" if variant else "benchmark-report"
    report = DOCS / (f"benchmark-report-{variant}.md" if variant else "benchmark-report.md")
    default_results = RESULTS / (f"results-{variant}.json" if variant else "results.json")
    results = Path(options.results or default_results)
    if options.report_only:
        rows = json.loads(results.read_text())
    else:
        results.parent.mkdir(parents=True, exist_ok=True)
        # With --suite, the saved rows of the suites not run stay (and those of a selected
        # suite that fails); a full run writes only what it measured.
        by_suite: dict[str, list[dict]] = {}
        if options.suites and results.exists():
            for row in json.loads(results.read_text()):
                by_suite.setdefault(row["suite"], []).append(row)
        deadline = time.perf_counter() + options.deadline
        for suite in options.suites or SUITES:
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
            for row in suite_rows if options.suites else []:
                # not the header's run: the report says when, and on what, these were
                row["measured"] = _measured_now()
            by_suite[suite.removeprefix("bench_")] = suite_rows
            rows = _ordered(by_suite)
            results.write_text(json.dumps(rows, indent=1))
            print(f"{suite}: {time.perf_counter() - start:.0f} s", flush=True)
        rows = _ordered(by_suite)
    import jax

    machine = _machine()
    title = {"gpu": "# Benchmark report, GPU", "newest": "# Benchmark report, newest set"}.get(
        variant, "# Benchmark report"
    )
    measured = _MEASURED.match(report.read_text()) if report.exists() else None
    keep_header = options.report_only or options.suites  # a part of the rows is new
    if keep_header and measured and (found := _MACHINE.search(measured[1])):
        # The rows were measured then and there, not now and here.
        # The "Ran on" line of the run that measured them, if its report had one.
        header = "\n\n".join(part for part in (title, measured[1], measured[2]) if part)
        machine = found[1]
    else:
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        command_name = "make bench-newest" if variant == "newest" else "make bench"
        header = (
            f"{title}\n\n{stamp}; jax {jax.__version__}; "
            f"Python {platform.python_version()}; {machine}. Written by `{command_name}` "
            "(`benchmarks/run.py`); what each suite measures is in [Benchmarks](benchmarks.md). "
            "Ratios are medians of per-round ratios over interleaved rounds "
            f"(lower is faster for ours).\n\n{ran_on()}"
        )
    report.write_text(markdown(rows, header, CHARTS, prefix))
    for stale in (DOCS / CHARTS).glob(f"{prefix}-*.png"):
        stale.unlink()  # a suite that is gone leaves no chart behind
    caption = f"ours against raw JAX and its peers ({machine})"
    charts = bar_charts(rows, DOCS / CHARTS, caption, prefix)
    print(f"wrote {report} and {len(charts)} charts in {DOCS / CHARTS}")


if __name__ == "__main__":
    main()
