"""``python -m benchmarks.run`` (``make bench``): its options are checked before anything runs.

``--help`` used to run the whole suite and overwrite the committed results, since unknown
arguments were ignored. Now the command line is argparse's: ``--help`` prints the options
and exits 0, a misspelt option exits 2, and neither measures or writes anything.
``--suite`` runs some suites and keeps the saved rows of the others.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from benchmarks import run

ROOT = Path(__file__).resolve().parent.parent
WRITTEN = [
    ROOT / "benchmarks" / "results" / "results.json",
    ROOT / "docs" / "benchmark-report.md",
]


def _command(*args: str) -> subprocess.CompletedProcess[str]:
    before = {path: path.stat().st_mtime_ns for path in WRITTEN if path.exists()}
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])},
    )
    after = {path: path.stat().st_mtime_ns for path in WRITTEN if path.exists()}
    assert after == before, "the command wrote the committed results or report"
    return result


def test_help_lists_the_options_and_runs_nothing():
    result = _command("--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: python -m benchmarks.run")
    options = ("--report-only", "--gpu", "--newest", "--quick", "--results", "--deadline")
    for option in (*options, "--suite"):
        assert option in result.stdout, option
    assert "core, haiku" in result.stdout  # the suites --suite accepts
    assert "bench_core:" not in result.stdout  # no suite ran


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--report-onyl"], "unrecognized arguments: --report-onyl"),
        (["--suite", "nope"], "unknown suite 'nope'; the suites are: core, haiku"),
        (["--deadline", "soon"], "expected a number of seconds >= 0, got 'soon'"),
        (["--report-only", "--quick"], "--report-only measures nothing"),
        (["--gpu", "--newest"], "--gpu and --newest name different reports"),
    ],
)
def test_a_wrong_command_line_exits_2_with_the_reason_and_runs_nothing(
    args: list[str], message: str
) -> None:
    result = _command(*args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert message in result.stderr, result.stderr
    assert result.stdout == ""


def _row(suite: str, case: str) -> dict[str, Any]:
    return {"suite": suite, "case": case, "ours": "o", "baseline": "b", "ours_us": 1.0,
            "baseline_us": 1.0, "ratio": 1.0, "target": "", "met": None, "note": ""}  # fmt: skip


@pytest.fixture
def fake_suites(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Suites that return one row named "new" (``bench_dag`` fails), a report and charts
    written under ``tmp_path``; the list of the suites run."""
    ran: list[str] = []

    def run_suite(suite: str, quick: bool) -> list[dict[str, Any]]:
        ran.append(suite)
        if suite == "bench_dag":
            raise subprocess.CalledProcessError(1, suite)
        return [_row(suite.removeprefix("bench_"), "new")]

    monkeypatch.setattr(run, "_run_suite", run_suite)
    monkeypatch.setattr(run, "DOCS", tmp_path)
    monkeypatch.setattr(run, "bar_charts", lambda *args, **kwargs: [])
    return ran


def test_selected_suites_replace_their_rows_and_keep_the_others(
    tmp_path: Path, fake_suites: list[str]
) -> None:
    results = tmp_path / "results.json"
    old = [_row("core", "old"), _row("haiku", "old"), _row("dag", "old"), _row("nnx", "old")]
    results.write_text(json.dumps(old))
    run.main(["--suite", "nnx", "--suite", "bench_haiku", "--suite", "dag",
              "--results", str(results)])  # fmt: skip
    assert fake_suites == ["bench_nnx", "bench_haiku", "bench_dag"]
    saved = [(row["suite"], row["case"]) for row in json.loads(results.read_text())]
    # In SUITES order; dag failed, so its saved row stays.
    assert saved == [("core", "old"), ("haiku", "new"), ("nnx", "new"), ("dag", "old")]
    assert (tmp_path / "benchmark-report.md").exists()


def test_a_full_run_measures_every_suite_in_order(tmp_path: Path, fake_suites: list[str]) -> None:
    results = tmp_path / "results.json"
    results.write_text(json.dumps([_row("gone", "old")]))
    run.main(["--quick", "--results", str(results)])
    assert fake_suites == run.SUITES
    saved = [row["suite"] for row in json.loads(results.read_text())]
    assert saved == [s.removeprefix("bench_") for s in run.SUITES if s != "bench_dag"]


def test_the_report_names_the_python_and_the_versions_it_ran_on(
    tmp_path: Path, fake_suites: list[str]
) -> None:
    from importlib import metadata

    run.main(["--suite", "core", "--results", str(tmp_path / "results.json")])
    page = (tmp_path / "benchmark-report.md").read_text()
    line = next(line for line in page.splitlines() if line.startswith("Ran on "))
    assert line == run.ran_on()
    assert line.startswith(f"Ran on Python {sys.version.split()[0]} with ")
    for name in ("jax", "jaxlib", "flax", "dm-haiku"):  # all installed by `.[test]`
        assert f"{name} {metadata.version(name)}" in line, line


def test_report_only_keeps_the_ran_on_line_of_the_run_that_measured(
    tmp_path: Path, fake_suites: list[str]
) -> None:
    results = tmp_path / "results.json"
    results.write_text(json.dumps([_row("core", "old")]))
    measured = (
        "2026-01-01 00:00 UTC; jax 0.12.0.1; Python 3.12.1; x86_64, 2 cores; CPU backend. "
        "Written by `make bench`."
    )
    ran_on = "Ran on Python 3.12.1 with jax 0.12.0.1, jaxlib 0.12.0.1, flax 0.12.12."
    (tmp_path / "benchmark-report.md").write_text(
        f"# Benchmark report\n\n{measured}\n\n{ran_on}\n\n**old summary**\n"
    )
    run.main(["--report-only", "--results", str(results)])
    page = (tmp_path / "benchmark-report.md").read_text()
    assert page.startswith(f"# Benchmark report\n\n{measured}\n\n{ran_on}\n\n"), page
    assert page.count("Ran on ") == 1 and fake_suites == []


def test_a_suite_run_alone_keeps_the_header_and_says_when_it_was_measured(
    tmp_path: Path, fake_suites: list[str]
) -> None:
    results = tmp_path / "results.json"
    results.write_text(json.dumps([_row("core", "old"), _row("nnx", "old")]))
    measured = (
        "2026-01-01 00:00 UTC; jax 0.12.0.1; Python 3.12.1; x86_64, 2 cores; CPU backend. "
        "Written by `make bench`."
    )
    (tmp_path / "benchmark-report.md").write_text(
        f"# Benchmark report\n\n{measured}\n\n**old summary**\n"
    )
    run.main(["--suite", "nnx", "--results", str(results)])
    page = (tmp_path / "benchmark-report.md").read_text()
    # the rest was measured then: the header stays that run's
    assert page.startswith(f"# Benchmark report\n\n{measured}\n\n"), page
    core, nnx = page.split("## core")[1].split("## nnx")
    assert "Measured alone" not in core
    stamp = next(line for line in nnx.splitlines() if line.startswith("Measured alone"))
    assert stamp.startswith("Measured alone (`--suite nnx`): 20")
    assert f"Python {sys.version.split()[0]}" in stamp and "jax " in stamp
    saved = {row["suite"]: row for row in json.loads(results.read_text())}
    assert "measured" in saved["nnx"] and "measured" not in saved["core"]
