"""The benchmark report: Markdown tables and a PNG bar chart of every ratio.

``benchmarks.run`` writes both into ``docs/`` so that the report is a page of the docs
site and reads the same on GitHub: ``docs/benchmark-report.md`` and
``docs/assets/benchmark-report.png``.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

_AT_MOST = re.compile(r"<= ([\d.]+)x$")
_FASTER = re.compile(r">= ([\d.]+)x faster$")
_MILLISECONDS = re.compile(r"<= ([\d.]+) ms$")
_MET = {True: "yes", False: "**no**", None: ""}


def target_ratio(row: dict[str, Any]) -> float | None:
    """The largest ratio (ours / baseline) that meets the row's target, if it has one."""
    target = row["target"]
    if target == "equal":
        return 1.0
    if match := _AT_MOST.match(target):
        return float(match[1])
    if match := _FASTER.match(target):
        return 1.0 / float(match[1])
    if match := _MILLISECONDS.match(target):
        # An absolute budget for ours, put on the ratio scale of this row's baseline.
        return float(match[1]) * 1e3 / row["baseline_us"]
    return None


def summary(rows: list[dict[str, Any]]) -> str:
    """One line: how many targets are met, and which are not."""
    judged = [row for row in rows if row["met"] is not None]
    missed = [f"{row['suite']}: {row['case']}" for row in judged if not row["met"]]
    line = f"**{len(judged) - len(missed)} of {len(judged)} targets met.**"
    if missed:
        line += " Missed: " + "; ".join(missed) + "."
    return line


def markdown(rows: list[dict[str, Any]], header: str, chart: str) -> str:
    """The report page: a header, the summary, the chart and one table per suite."""
    lines = [header, "", summary(rows), "", f"![Every ratio against its target]({chart})", ""]
    for suite in dict.fromkeys(row["suite"] for row in rows):
        lines += [
            f"## {suite}",
            "",
            "| case | ours | baseline | ours (µs) | baseline (µs) | ratio | target | met | note |",
            "|---|---|---|---:|---:|---:|---|---|---|",
        ]
        lines += [
            f"| {row['case']} | {row['ours']} | {row['baseline']} | {row['ours_us']:.2f} | "
            f"{row['baseline_us']:.2f} | {row['ratio']:.3f} | {row['target']} | "
            f"{_MET[row['met']]} | {row['note']} |"
            for row in rows
            if row["suite"] == suite
        ]
        lines.append("")
    return "\n".join(lines)


def bar_chart(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """A horizontal bar per row on a log scale, coloured by whether its target is met,
    with the target drawn as a black tick and parity (1.0) as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on CI machines
    import matplotlib.pyplot as plt

    colours = {True: "#2e7d32", False: "#c62828", None: "#9e9e9e"}
    labels = [
        textwrap.fill(f"{row['suite']}: {row['case']} ({row['ours']} / {row['baseline']})", 80)
        for row in rows
    ]
    positions = list(range(len(rows)))[::-1]
    figure, axes = plt.subplots(figsize=(13, 0.4 * len(rows) + 1.6))
    axes.barh(positions, [row["ratio"] for row in rows], color=[colours[r["met"]] for r in rows])
    for position, row in zip(positions, rows, strict=True):
        limit = target_ratio(row)
        if limit is not None:
            axes.plot([limit], [position], marker="|", markersize=14, color="black", mew=2)
        axes.annotate(
            f"  {row['ratio']:.3g}",
            (max(row["ratio"], limit or 0.0), position),
            va="center",
            fontsize=7,
        )
    axes.axvline(1.0, color="black", linestyle="--", linewidth=0.8)
    axes.set_xscale("log")
    axes.set_yticks(positions, labels, fontsize=7)
    axes.set_ylim(-0.7, len(rows) - 0.3)
    axes.set_xlabel("time ratio, ours / baseline (log scale; left of 1 is faster)")
    axes.set_title(title, fontsize=10)
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=colours[True], label="target met"),
        plt.Rectangle((0, 0), 1, 1, color=colours[False], label="target missed"),
        plt.Rectangle((0, 0), 1, 1, color=colours[None], label="information, no target"),
        plt.Line2D([], [], marker="|", color="black", linestyle="", markersize=10, label="target"),
    ]
    axes.legend(handles=handles, loc="lower right", fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
