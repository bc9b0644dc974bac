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
    """The report page: a header, the summary, the chart and two tables per suite.

    The verdicts (ratio, target, met) and the raw times with their notes are separate
    tables, so that neither is wider than the page and the verdicts stay in view.
    """
    lines = [header, "", summary(rows), "", f"![Every ratio against its target]({chart})", ""]
    for suite in dict.fromkeys(row["suite"] for row in rows):
        chosen = [row for row in rows if row["suite"] == suite]
        lines += [
            f"## {suite}",
            "",
            "| case | ours / baseline | ratio | target | met |",
            "|---|---|---:|---|---|",
        ]
        lines += [
            f"| {row['case']} | {row['ours']} / {row['baseline']} | {row['ratio']:.3f} | "
            f"{row['target']} | {_MET[row['met']]} |"
            for row in chosen
        ]
        lines += [
            "",
            "| case | ours | ours (µs) | baseline (µs) | note |",
            "|---|---|---:|---:|---|",
        ]
        lines += [
            f"| {row['case']} | {row['ours']} | {row['ours_us']:.2f} | {row['baseline_us']:.2f} | "
            f"{row['note']} |"
            for row in chosen
        ]
        lines.append("")
    return "\n".join(lines)


CONTENT_PIXELS = 688
"""The docs theme's content column, and so the chart, is this wide on a 1280 px page (Chromium)."""
# Drawn 6.88 inches wide, an inch is then 100 px on screen and the smallest text (8 pt)
# about 11 px. Labels go on their own lines above each bar, across the full width, instead
# of taking half the width as tick labels.
_WIDTH_INCHES = 6.88
_SMALLEST_POINTS = 8
_LABEL_CHARACTERS = 96  # about the widest 8 pt line that fits in the axes
_ROW_INCHES = 0.42
_LINE_ROWS = 0.45  # the height of one more label line, in rows


def bar_chart(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Draws ``chart_figure(rows, title)`` into the PNG file ``path``."""
    import matplotlib.pyplot as plt

    figure = chart_figure(rows, title)
    path.parent.mkdir(parents=True, exist_ok=True)
    # 2x the on-screen size, so that the text stays sharp on high-density screens.
    figure.savefig(path, dpi=200)
    plt.close(figure)


def chart_figure(rows: list[dict[str, Any]], title: str) -> Any:
    """A horizontal bar per row on a log scale, coloured by whether its target is met,
    with the target drawn as a black tick and parity (1.0) as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on CI machines
    import matplotlib.pyplot as plt
    from matplotlib.transforms import blended_transform_factory

    small = _SMALLEST_POINTS
    colours = {True: "#2e7d32", False: "#c62828", None: "#9e9e9e"}
    labels = [
        textwrap.fill(
            f"{row['suite']}: {row['case']} ({row['ours']} / {row['baseline']})",
            _LABEL_CHARACTERS,
        )
        for row in rows
    ]
    # Bottom to top, each row as tall as its label needs.
    positions, top = [], 0.0
    for label in reversed(labels):
        positions.append(top)
        top += 1.0 + _LINE_ROWS * label.count("\n")
    positions.reverse()
    figure, axes = plt.subplots(figsize=(_WIDTH_INCHES, _ROW_INCHES * top + 1.9))
    axes.barh(
        positions,
        [row["ratio"] for row in rows],
        height=0.45,
        color=[colours[r["met"]] for r in rows],
    )
    label_at = blended_transform_factory(axes.transAxes, axes.transData)
    for position, row, label in zip(positions, rows, labels, strict=True):
        axes.text(
            0.005,
            position + 0.3,
            label,
            transform=label_at,
            va="bottom",
            fontsize=small,
            # The label stays legible where it crosses the parity line or a target tick.
            bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5, "alpha": 0.85},
        )
        limit = target_ratio(row)
        if limit is not None:
            axes.plot([limit], [position], marker="|", markersize=11, color="black", mew=2)
        axes.annotate(
            f"  {row['ratio']:.3g}",
            (max(row["ratio"], limit or 0.0), position),
            va="center",
            fontsize=small,
        )
    axes.axvline(1.0, color="black", linestyle="--", linewidth=0.8)
    axes.set_xscale("log")
    axes.set_yticks([])
    axes.set_ylim(-0.6, top - 0.1)
    axes.tick_params(axis="x", labelsize=small)
    axes.xaxis.set_tick_params(labeltop=True, top=True)
    axes.set_xlabel(
        "time ratio, ours / baseline (log scale; left of 1 is faster)", fontsize=small + 1
    )
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=colours[True], label="target met"),
        plt.Rectangle((0, 0), 1, 1, color=colours[False], label="target missed"),
        plt.Rectangle((0, 0), 1, 1, color=colours[None], label="information, no target"),
        plt.Line2D([], [], marker="|", color="black", linestyle="", markersize=10, label="target"),
    ]
    axes.set_title(title, fontsize=small + 2, pad=46)
    axes.legend(
        handles=handles,
        loc="lower center",
        bbox_to_anchor=(0.5, 1.0),
        ncols=4,
        fontsize=small,
        frameon=False,
        borderaxespad=2.4,
    )
    figure.tight_layout()
    return figure
