"""The benchmark report: targets read back from their text, and the committed report
consistent with the committed measurements."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmarks._report import (
    CONTENT_PIXELS,
    bar_chart,
    chart_figure,
    markdown,
    summary,
    target_ratio,
)

ROOT = Path(__file__).resolve().parent.parent
ROWS = json.loads((ROOT / "benchmarks" / "results" / "results.json").read_text())


def row(target: str, ratio: float = 1.0, met: bool | None = None, **extra: object) -> dict:
    base = {
        "suite": "s",
        "case": "c",
        "ours": "ours",
        "baseline": "base",
        "ours_us": 2.0,
        "baseline_us": 2000.0,
        "ratio": ratio,
        "target": target,
        "met": met,
        "note": "",
    }
    return {**base, **extra}


@pytest.mark.parametrize(
    ("target", "limit"),
    [("<= 1.05x", 1.05), (">= 10x faster", 0.1), ("equal", 1.0), ("<= 30 ms", 15.0), ("", None)],
)
def test_targets_become_ratio_limits(target, limit):
    assert target_ratio(row(target)) == (pytest.approx(limit) if limit is not None else None)


def test_every_committed_verdict_agrees_with_its_target():
    checked = 0
    for entry in ROWS:
        limit = target_ratio(entry)
        if limit is None or entry["target"] == "equal":
            continue
        assert entry["met"] == (entry["ratio"] <= limit), entry
        checked += 1
    assert checked >= 20


def test_summary_names_what_is_missed():
    rows = [row("<= 1x", met=True), row("<= 1x", met=False, case="slow"), row("")]
    assert summary(rows) == "**1 of 2 targets met.** Missed: s: slow."


def test_committed_report_is_drawn_from_committed_rows():
    page = (ROOT / "docs" / "benchmark-report.md").read_text()
    body = markdown(ROWS, "HEADER", "assets/benchmark-report.png").split("\n", 1)[1]
    assert page.endswith(body), "regenerate with `python -m benchmarks.run --report-only`"
    assert (ROOT / "docs" / "assets" / "benchmark-report.png").stat().st_size > 10_000


def test_chart_is_a_png(tmp_path):
    path = tmp_path / "chart.png"
    bar_chart([row("<= 1.05x", 1.02, True), row("", 3.0)], path, "title")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chart_text_is_legible_at_page_width():
    """Every label, tick and annotation shows at 10 px or more on a 1280 px page, and inside
    the image."""
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    figure = chart_figure(ROWS, "title")
    try:
        pixels_per_point = CONTENT_PIXELS / figure.get_figwidth() / 72
        renderer = figure.canvas.get_renderer()
        (axes,) = figure.axes
        low, high = axes.get_xlim()
        # Tick labels of ticks outside the axis' range exist but are not drawn.
        hidden = {
            id(label)
            for label in axes.get_xticklabels(which="both")
            if not low <= label.get_position()[0] <= high
        }
        texts = [
            t
            for t in figure.findobj(Text)
            if t.get_text() and t.get_visible() and id(t) not in hidden
        ]
        assert len(texts) > 2 * len(ROWS)  # a label and a value per row, at least
        smallest = min(t.get_fontsize() for t in texts)
        assert smallest * pixels_per_point >= 10, (
            f"{smallest} pt is {smallest * pixels_per_point:.1f} px"
        )
        for text in texts:
            box = text.get_window_extent(renderer)
            assert figure.bbox.x0 <= box.x0 and box.x1 <= figure.bbox.x1 + 1, text.get_text()
    finally:
        plt.close(figure)


def test_tables_keep_the_verdict_columns_narrow():
    """No table row is wider than a page: times and notes are a table of their own."""
    page = markdown(ROWS, "HEADER", "chart.png")
    headers = [line for line in page.splitlines() if line.startswith("| case |")]
    assert headers.count("| case | ours / baseline | ratio | target | met |") == len(
        {r["suite"] for r in ROWS}
    )
    assert all(len(h.split("|")) - 2 <= 6 for h in headers), headers
