"""Timing helpers shared by the benchmark suites.

Every measurement interleaves the candidates round by round, in alternating order, so
that drift of the machine (frequency, other processes) and the place in a round hit all
of them alike, and reports the median
over rounds of the per-round ratio to the baseline. Suites return ``Row`` objects;
``benchmarks.run`` runs each suite in its own process and writes the report.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class Row:
    """One line of the report: our time against a baseline, as a ratio, with its target."""

    suite: str
    case: str
    ours: str
    baseline: str
    ours_us: float
    baseline_us: float
    ratio: float
    target: str = ""
    met: bool | None = None
    note: str = ""


def block(value: Any) -> Any:
    """Waits for every array in ``value``, so that a timing includes the computation."""
    import jax

    return jax.block_until_ready(value)


def interleaved(
    candidates: dict[str, Callable[[], Any]],
    *,
    number: int,
    rounds: int = 25,
    warmup: int = 3,
) -> dict[str, list[float]]:
    """Seconds per call of each candidate, one entry per round; rounds interleave them.

    Every other round runs the candidates in reverse order. A candidate's time depends on
    its place in the round, not only on itself: the garbage that the one before it left
    (a collection that runs during the next one's timing), the caches it evicted. Run in
    one fixed order, two calls of the very same function measured 1.04x to 1.06x apart
    (an A/A test of eager ``lax.scan`` and of ``closure_convert``), which is as large as
    the differences that the targets judge; alternating cancels it in the median ratio.
    """
    for fn in candidates.values():
        for _ in range(warmup):
            block(fn())
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    forward = list(candidates.items())
    orders = (forward, forward[::-1])
    for round_index in range(rounds):
        for name, fn in orders[round_index % 2]:
            start = time.perf_counter()
            for _ in range(number):
                fn()
            samples[name].append((time.perf_counter() - start) / number)
    return samples


def ratio_rows(
    suite: str,
    case: str,
    samples: dict[str, list[float]],
    baseline: str,
    targets: dict[str, tuple[str, Callable[[float], bool]]] | None = None,
    note: str = "",
) -> list[Row]:
    """One ``Row`` per non-baseline candidate: median time, and median per-round ratio.

    ``targets`` maps a candidate to ``(description, predicate on the ratio)``.
    """
    targets = targets or {}
    base = samples[baseline]
    rows = []
    for name, times in samples.items():
        if name == baseline:
            continue
        ratio = statistics.median(t / b for t, b in zip(times, base, strict=True))
        description, check = targets.get(name, ("", None))
        verdict = (ratio, description, None if check is None else bool(check(ratio)))
        rows.append(median_row(suite, case, {name: times, baseline: base}, verdict, note))
    return rows


def median_row(
    suite: str,
    case: str,
    samples: dict[str, list[float]],
    verdict: tuple[float, str, bool | None],
    note: str = "",
) -> Row:
    """The row of one candidate against its baseline, from their samples.

    Args:
      suite: the suite's name.
      case: what was measured.
      samples: seconds per call or run, the candidate first and then the baseline, each
        under its label.
      verdict: the ratio of the candidate to the baseline, the target and whether it is met
        (``None``: no target).
      note: what the reader should know about the numbers.

    Returns:
      The row, with the medians of the samples in microseconds.

    Example:
      >>> median_row("core", "c", {"jo": [2e-6], "jax": [1e-6]}, (2.0, "<= 3x", True)).ratio
      2.0
    """
    (ours, ours_s), (baseline, baseline_s) = samples.items()
    ratio, target, met = verdict
    return Row(
        suite=suite,
        case=case,
        ours=ours,
        baseline=baseline,
        ours_us=statistics.median(ours_s) * 1e6,
        baseline_us=statistics.median(baseline_s) * 1e6,
        ratio=ratio,
        target=target,
        met=met,
        note=note,
    )


def guarded(suite: str, case: str, measure: Callable[[bool], list[Row]], quick: bool) -> list[Row]:
    """``measure(quick)``, or one row that says why ``case`` could not be measured.

    A suite must report, not crash, when a case cannot run (an optional library missing,
    a version that refuses the program): the report then shows the reason in its note.
    """
    try:
        return measure(quick)
    except Exception as error:
        first_line = next(iter(str(error).splitlines()), "(no message)")  # an assert has none
        why = f"{type(error).__name__}: {first_line[:160]}"
        return [Row(suite, case, "-", "-", float("nan"), float("nan"), float("nan"),
                    note=f"not measured: {why}")]  # fmt: skip


def at_most(limit: float) -> tuple[str, Callable[[float], bool]]:
    return f"<= {limit:g}x", lambda ratio: ratio <= limit


def at_least_faster(factor: float) -> tuple[str, Callable[[float], bool]]:
    """Target: ours at least ``factor`` times faster than the baseline (ratio <= 1/factor)."""
    return f">= {factor:g}x faster", lambda ratio: ratio <= 1.0 / factor


def main(run: Callable[[bool], list[Row]]) -> None:
    """Command line of a suite: ``python -m benchmarks.bench_x [--quick] [--json PATH]``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer rounds, for smoke tests")
    parser.add_argument("--json", help="write the rows here as JSON")
    options = parser.parse_args()
    rows = run(options.quick)
    if options.json:
        with open(options.json, "w") as handle:
            json.dump([asdict(row) for row in rows], handle, indent=1)
    for row in rows:
        status = {True: "met", False: "MISSED", None: ""}[row.met]
        print(
            f"{row.suite:6s} {row.case:42s} {row.ours:24s} {row.ratio:8.3f}x vs "
            f"{row.baseline:20s} {row.target:14s} {status}",
            file=sys.stderr,
        )
