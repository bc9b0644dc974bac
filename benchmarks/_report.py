"""The benchmark report: Markdown tables and a PNG bar chart per suite.

``benchmarks.run`` writes both into ``docs/`` so that the report is a page of the docs
site and reads the same on GitHub: ``docs/benchmark-report.md`` and
``docs/assets/benchmark-report-<suite>.png``, each chart above its suite's tables.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

_AT_MOST = re.compile(r"<= ([\d.]+)x$")
_FASTER = re.compile(r">= ([\d.]+)x faster$")
# An absolute budget for ours, in a unit of its own: ``<= 30 ms``, ``<= 5 MiB``.
_ABSOLUTE = re.compile(r"<= ([\d.]+) ?([^\d\s.]+)$")
# Microseconds per unit of the time budgets; ``ours_us`` holds every time in microseconds.
_MICROSECONDS = {"ns": 1e-3, "µs": 1.0, "μs": 1.0, "us": 1.0, "ms": 1e3, "s": 1e6, "min": 6e7}
_UNIT_NAMES = {
    "ns": "nanoseconds",
    "µs": "microseconds",
    "μs": "microseconds",
    "us": "microseconds",
    "ms": "milliseconds",
    "s": "seconds",
    "min": "minutes",
}
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
    budget = absolute_budget(row)
    if budget is not None and budget[1] in _MICROSECONDS:
        # An absolute time budget for ours, put on the ratio scale of this row's baseline.
        return budget[0] * _MICROSECONDS[budget[1]] / row["baseline_us"]
    return None


def absolute_budget(row: dict[str, Any]) -> tuple[float, str] | None:
    """``(amount, unit)`` of a row whose target is an absolute budget for ours (``<= 30 ms``,
    ``<= 5 MiB``), not a ratio (``<= 1.05x``, ``>= 10x faster``, ``equal``); else None."""
    match = _ABSOLUTE.match(row["target"])
    if match is None or match[2] == "x":
        return None
    return float(match[1]), match[2]


def measured(row: dict[str, Any]) -> float:
    """Ours, in the unit of the row's absolute budget. ``ours_us`` holds a time in
    microseconds; a row with a budget in another unit (memory: ``<= 5 MiB``) keeps its
    measurement there in that unit, as its note says."""
    budget = absolute_budget(row)
    if budget is None:
        raise ValueError(f"{row['case']!r}: target {row['target']!r} is not an absolute budget")
    return row["ours_us"] / _MICROSECONDS.get(budget[1], 1.0)


def summary(rows: list[dict[str, Any]]) -> str:
    """One line: how many targets are met, and which are not."""
    judged = [row for row in rows if row["met"] is not None]
    missed = [f"{row['suite']}: {row['case']}" for row in judged if not row["met"]]
    line = f"**{len(judged) - len(missed)} of {len(judged)} targets met.**"
    if missed:
        line += " Missed: " + "; ".join(missed) + "."
    return line


def chart_path(directory: str, suite: str, prefix: str = "benchmark-report") -> str:
    """Where the chart of one suite goes, relative to the report page; ``prefix`` names the
    report (``benchmark-report`` on the CPU, ``benchmark-gpu`` for the GPU run)."""
    return f"{directory}/{prefix}-{suite}.png"


def suites(rows: list[dict[str, Any]]) -> list[str]:
    """The suites, in the order their rows come."""
    return list(dict.fromkeys(row["suite"] for row in rows))


def markdown(
    rows: list[dict[str, Any]], header: str, charts: str, prefix: str = "benchmark-report"
) -> str:
    """The report page: a header, the summary, and per suite its chart and two tables.

    Each suite's chart sits above its tables (``chart_path(charts, suite)``). The verdicts
    (ratio, target, met) and the raw times with their notes are separate tables, so that
    neither is wider than the page and the verdicts stay in view.
    """
    lines = [header, "", summary(rows), "", LEGEND, ""]
    for suite in suites(rows):
        chosen = [row for row in rows if row["suite"] == suite]
        lines += [
            f"## {suite}",
            "",
            f"![{suite}: each ratio against its target]({chart_path(charts, suite, prefix)})",
            "",
        ]
        if when := chosen[0].get("measured"):
            lines += [f"Measured alone (`--suite {suite}`): {when}.", ""]
        lines += [
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


LEGEND = (
    "Each suite's chart has a bar per row: green where its target is met, red where it is "
    "missed, grey for information without a target; the black tick is the target. Ratios "
    "(ours / baseline, log scale, the dashed line at 1) and absolute budgets are drawn on "
    "separate axes, one per unit (ms, MiB, ...)."
)


CONTENT_PIXELS = 688
"""The narrowest the docs theme's content column, and so each chart, is on a 1280 px page:
938 px with the table of contents in the left sidebar (``make screenshots`` prints it),
688 px with it on the right. The charts are checked legible at this width."""
# Drawn 6.88 inches wide, an inch is then at least 100 px on screen and the smallest text
# (8 pt) at least 11 px. Labels go on their own lines above each bar, across the full width, instead
# of taking half the width as tick labels.
_WIDTH_INCHES = 6.88
_SMALLEST_POINTS = 8
_LABEL_CHARACTERS = 96  # about the widest 8 pt line that fits in the axes
_ROW_INCHES = 0.38
_LINE_ROWS = 0.45  # the height of one more label line, in rows


def bar_charts(
    rows: list[dict[str, Any]], directory: Path, title: str, prefix: str = "benchmark-report"
) -> list[Path]:
    """Draws one PNG per suite, ``chart_figure(suite_rows, ...)``, into ``directory``;
    returns their paths (named by ``chart_path``)."""
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for suite in suites(rows):
        figure = chart_figure([row for row in rows if row["suite"] == suite], f"{suite}: {title}")
        path = directory / Path(chart_path(".", suite, prefix)).name
        # 2x the on-screen size, so that the text stays sharp on high-density screens.
        figure.savefig(path, dpi=200)
        plt.close(figure)
        written.append(path)
    return written


def budget_unit(row: dict[str, Any]) -> str | None:
    """The unit of the row's absolute budget (``"ms"``, ``"MiB"``), or None for a ratio
    target or none: the chart draws each unit on an axis of its own."""
    budget = absolute_budget(row)
    return None if budget is None else budget[1]


def _label(row: dict[str, Any]) -> str:
    compared = row["ours"] if budget_unit(row) else f"{row['ours']} / {row['baseline']}"
    return textwrap.fill(f"{row['case']} ({compared})", _LABEL_CHARACTERS)


def _positions(labels: list[str]) -> tuple[list[float], float]:
    """Bottom to top, each row as tall as its label needs; and the total height in rows."""
    positions, top = [], 0.0
    for label in reversed(labels):
        positions.append(top)
        top += 1.0 + _LINE_ROWS * label.count("\n")
    positions.reverse()
    return positions, top


def _panel(axes: Any, rows: list[dict[str, Any]], *, unit: str | None) -> None:
    """Bars with their labels, values and target ticks: ratios on a log axis with parity
    dashed, or (``unit``) ours in that unit against its absolute budget."""
    from matplotlib.ticker import FuncFormatter, NullFormatter
    from matplotlib.transforms import blended_transform_factory

    small = _SMALLEST_POINTS
    labels = [_label(row) for row in rows]
    positions, top = _positions(labels)
    values = [measured(row) if unit else row["ratio"] for row in rows]
    axes.barh(positions, values, height=0.45, color=[_COLOURS[r["met"]] for r in rows])
    label_at = blended_transform_factory(axes.transAxes, axes.transData)
    for position, row, label, value in zip(positions, rows, labels, values, strict=True):
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
        target = _budget(row) if unit else target_ratio(row)
        if target is not None:
            axes.plot([target], [position], marker="|", markersize=11, color="black", mew=2)
        shown = f"  {value:.3g} {unit}" if unit else f"  {value:.3g}"
        axes.annotate(shown, (max(value, target or 0.0), position), va="center", fontsize=small)
    axes.set_yticks([])
    axes.set_ylim(-0.6, top - 0.1)
    axes.tick_params(axis="x", labelsize=small)
    if unit:
        axes.set_xlim(min(0.0, *values), 1.25 * max([*values, *(_budget(r) for r in rows)]))
        name = _UNIT_NAMES.get(unit, unit)
        axes.set_xlabel(f"{name} (ours; the tick is the budget)", fontsize=small + 1)
    else:
        axes.axvline(1.0, color="black", linestyle="--", linewidth=0.8)
        axes.set_xscale("log")
        low = min([*values, *(t for r in rows if (t := target_ratio(r)) is not None)])
        high = max([*values, *(t for r in rows if (t := target_ratio(r)) is not None)])
        # Room on the right for the value written after the longest bar.
        low, high = min(low, 1.0) / 1.3, max(high, 1.0) * 1.8
        axes.set_xlim(low, high)
        axes.set_xticks(_log_ticks(low, high))
        axes.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
        axes.xaxis.set_minor_formatter(NullFormatter())
        axes.set_xlabel(
            "time ratio, ours / baseline (log scale; left of 1 is faster)", fontsize=small + 1
        )


def _log_ticks(low: float, high: float) -> list[float]:
    """Round numbers between ``low`` and ``high``, written plainly (0.5, 1, 2, 100), not as
    powers of ten: 1-1.2-1.5-2-3-5-7 steps, or 1-2-5 where those would crowd."""
    for steps in ((1, 1.2, 1.5, 2, 3, 5, 7), (1, 2, 5), (1,)):
        ticks = [m * 10.0**e for e in range(-4, 5) for m in steps if low <= m * 10.0**e <= high]
        if len(ticks) <= 8:
            return ticks
    return ticks


def _budget(row: dict[str, Any]) -> float:
    budget = absolute_budget(row)
    return budget[0] if budget else 0.0


_COLOURS = {True: "#2e7d32", False: "#c62828", None: "#9e9e9e"}


def chart_figure(rows: list[dict[str, Any]], title: str) -> Any:
    """One suite's rows as horizontal bars coloured by whether their target is met, with
    each target as a black tick: ratios on a log axis with parity (1.0) dashed, and rows
    whose target is an absolute budget in a panel per unit (milliseconds, MiB), so that no
    axis mixes units. Every panel has its own labelled axis."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on CI machines
    import matplotlib.pyplot as plt

    units = [None, *dict.fromkeys(u for row in rows if (u := budget_unit(row)) is not None)]
    groups = [
        (unit, chosen)
        for unit in units
        if (chosen := [row for row in rows if budget_unit(row) == unit])
    ]
    heights = [_positions([_label(row) for row in chosen])[1] for _, chosen in groups]
    # Each panel: its rows, plus room for its axis and label.
    inches = [_ROW_INCHES * height + 0.55 for height in heights]
    figure, panels = plt.subplots(
        len(groups),
        1,
        figsize=(_WIDTH_INCHES, sum(inches) + 0.35),
        gridspec_kw={"height_ratios": inches},
        squeeze=False,
    )
    for axes, (unit, chosen) in zip(panels[:, 0], groups, strict=True):
        _panel(axes, chosen, unit=unit)
    panels[0, 0].set_title(title, fontsize=_SMALLEST_POINTS + 2)
    figure.tight_layout()
    return figure
