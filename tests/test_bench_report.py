"""The benchmark report: targets read back from their text, and the committed report
consistent with the committed measurements."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmarks._report import (
    CONTENT_PIXELS,
    absolute_budget,
    bar_charts,
    budget_unit,
    chart_figure,
    chart_path,
    markdown,
    measured,
    suites,
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
    [
        ("<= 1.05x", 1.05),
        (">= 10x faster", 0.1),
        ("equal", 1.0),
        ("<= 30 ms", 15.0),
        ("<= 500 µs", 0.25),
        ("<= 2 s", 1000.0),
        ("<= 5 MiB", None),  # not a time: no ratio to the baseline's microseconds
        ("", None),
    ],
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
    body = markdown(ROWS, "HEADER", "assets").split("\n", 1)[1]
    assert page.endswith(body), "regenerate with `python -m benchmarks.run --report-only`"
    assets = ROOT / "docs" / "assets"
    committed = sorted(p.name for p in assets.glob("benchmark-report*.png"))
    assert committed == sorted(Path(chart_path("assets", s)).name for s in suites(ROWS))
    assert all((assets / name).stat().st_size > 10_000 for name in committed)


def test_charts_are_pngs_one_per_suite(tmp_path):
    rows = [row("<= 1.05x", 1.02, True), row("", 3.0), row("<= 1x", 0.5, True, suite="t")]
    paths = bar_charts(rows, tmp_path, "title")
    assert [p.name for p in paths] == ["benchmark-report-s.png", "benchmark-report-t.png"]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("suite", suites(ROWS))
def test_chart_text_is_legible_at_page_width(suite):
    """Every label, tick and annotation shows at 10 px or more on a 1280 px page, and inside
    the image; every panel has its own labelled axis, and the chart is no taller than a
    screen."""
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    rows = [r for r in ROWS if r["suite"] == suite]
    figure = chart_figure(rows, "title")
    try:
        pixels_per_point = CONTENT_PIXELS / figure.get_figwidth() / 72
        assert figure.get_figheight() * pixels_per_point * 72 <= 800
        renderer = figure.canvas.get_renderer()
        hidden = set()
        for axes in figure.axes:
            assert axes.get_xlabel(), "every panel labels its axis"
            low, high = axes.get_xlim()
            # Tick labels of ticks outside the axis' range exist but are not drawn.
            hidden |= {
                id(label)
                for label in axes.get_xticklabels(which="both")
                if not low <= label.get_position()[0] <= high
            }
            shown = [t for t in axes.get_xticklabels() if t.get_text() and id(t) not in hidden]
            assert len(shown) >= 2, f"{suite}: a panel with fewer than two tick labels"
        texts = [
            t
            for t in figure.findobj(Text)
            if t.get_text() and t.get_visible() and id(t) not in hidden
        ]
        assert len(texts) > 2 * len(rows)  # a label and a value per row, at least
        smallest = min(t.get_fontsize() for t in texts)
        assert smallest * pixels_per_point >= 10, (
            f"{smallest} pt is {smallest * pixels_per_point:.1f} px"
        )
        for text in texts:
            box = text.get_window_extent(renderer)
            assert figure.bbox.x0 <= box.x0 and box.x1 <= figure.bbox.x1 + 1, text.get_text()
    finally:
        plt.close(figure)


def test_times_and_ratios_are_on_separate_axes():
    """The import-time row's budget (<= 30 ms) is drawn in milliseconds, not as a ratio."""
    import matplotlib.pyplot as plt

    rows = [r for r in ROWS if r["suite"] == "core"]
    timed = [r for r in rows if budget_unit(r)]
    assert [r["target"] for r in timed] == ["<= 30 ms"]
    figure = chart_figure(rows, "title")
    try:
        ratios, times = figure.axes
        assert ratios.get_xscale() == "log" and "ratio" in ratios.get_xlabel()
        assert times.get_xscale() == "linear" and "milliseconds" in times.get_xlabel()
        labels = lambda axes: " ".join(t.get_text() for t in axes.texts)
        assert timed[0]["case"] in labels(times)
        assert timed[0]["case"] not in labels(ratios)
        (bar,) = times.patches
        assert bar.get_width() == pytest.approx(timed[0]["ours_us"] / 1e3)
        assert len(ratios.patches) == len(rows) - 1
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


@pytest.mark.parametrize(
    ("variant", "title", "backend"),
    [("gpu", "GPU", "GPU backend"), ("newest", "newest set", "Python 3.12")],
)
def test_committed_variant_report_is_drawn_from_its_own_rows(variant, title, backend):
    """The GPU run's page and charts (``benchmarks.run --gpu``), and the newest set's
    (``--newest``), sit beside the CPU ones, drawn from ``results-<variant>.json``, with
    their own chart names."""
    rows = json.loads((ROOT / "benchmarks" / "results" / f"results-{variant}.json").read_text())
    page = (ROOT / "docs" / f"benchmark-report-{variant}.md").read_text()
    assert page.startswith(f"# Benchmark report, {title}\n\n") and backend in page
    body = markdown(rows, "HEADER", "assets", f"benchmark-{variant}").split("\n", 1)[1]
    assert page.endswith(body), (
        f"regenerate with `python -m benchmarks.run --{variant} --report-only`"
    )
    assets = ROOT / "docs" / "assets"
    committed = sorted(p.name for p in assets.glob(f"benchmark-{variant}-*.png"))
    prefix = f"benchmark-{variant}"
    expected = sorted(Path(chart_path("assets", s, prefix)).name for s in suites(rows))
    assert committed == expected


@pytest.mark.parametrize(
    ("target", "budget"),
    [
        ("<= 30 ms", (30.0, "ms")),
        ("<= 5 MiB", (5.0, "MiB")),
        ("<= 64 KiB", (64.0, "KiB")),
        ("<= 500 µs", (500.0, "µs")),
        ("<= 2 s", (2.0, "s")),
        ("<= 1.05x", None),
        (">= 10x faster", None),
        ("equal", None),
        ("", None),
    ],
)
def test_absolute_budgets_are_read_with_their_unit(target, budget):
    assert absolute_budget(row(target)) == budget


def _cases(axes: object) -> list[str]:
    """The cases a panel labels (each value written after a bar starts with spaces)."""
    texts = [t.get_text() for t in axes.texts]  # type: ignore[attr-defined]
    return [text.split(" (")[0] for text in texts if not text.startswith(" ")]


def test_every_absolute_unit_is_drawn_on_an_axis_of_its_own():
    """Rows with budgets in ms, MiB, KiB, µs and s: one panel per unit, each labelled with
    its unit and holding only its rows, the bar in that unit; ratios stay on their own."""
    import matplotlib.pyplot as plt

    rows = [
        row("<= 1.05x", 1.02, True, case="ratio"),
        row("<= 30 ms", 0.1, True, case="import", ours_us=12_000.0),
        row("<= 5 MiB", 1.8, True, case="memory", ours_us=0.28),
        row("<= 64 KiB", 1.0, False, case="buffer", ours_us=80.0),
        row("<= 500 µs", 0.5, True, case="dispatch", ours_us=120.0),
        row("<= 2 s", 0.5, True, case="compile", ours_us=1.5e6),
        row("<= 40 ms", 0.1, False, case="import 2", ours_us=45_000.0),
    ]
    figure = chart_figure(rows, "title")
    try:
        panels = figure.axes
        assert len(panels) == 6
        ratios, *absolute = panels
        assert ratios.get_xscale() == "log" and "ratio" in ratios.get_xlabel()
        assert _cases(ratios) == ["ratio"]
        expected = {
            "milliseconds": (["import", "import 2"], [12.0, 45.0]),
            "MiB": (["memory"], [0.28]),
            "KiB": (["buffer"], [80.0]),
            "microseconds": (["dispatch"], [120.0]),
            "seconds": (["compile"], [1.5]),
        }
        for axes in absolute:
            unit = axes.get_xlabel().split(" (")[0]
            cases, widths = expected.pop(unit)
            assert axes.get_xscale() == "linear"
            assert _cases(axes) == cases
            assert [p.get_width() for p in axes.patches] == pytest.approx(widths)
        assert not expected, f"units without a panel: {sorted(expected)}"
    finally:
        plt.close(figure)


def test_memory_budget_is_drawn_in_mib_not_on_the_ratio_axis():
    """The Haiku suite's memory row (``<= 5 MiB``) gets a MiB panel, its bar in MiB."""
    import matplotlib.pyplot as plt

    rows = [r for r in ROWS if r["suite"] == "haiku"]
    memory = [r for r in rows if budget_unit(r) == "MiB"]
    assert len(memory) == 1 and budget_unit(memory[0]) == "MiB"
    figure = chart_figure(rows, "title")
    try:
        ratios, mebibytes = figure.axes
        assert "ratio" in ratios.get_xlabel() and mebibytes.get_xlabel().startswith("MiB")
        labels = lambda axes: " ".join(t.get_text() for t in axes.texts)
        assert memory[0]["case"] in labels(mebibytes)
        assert memory[0]["case"] not in labels(ratios)
        (bar,) = mebibytes.patches
        assert bar.get_width() == pytest.approx(measured(memory[0])) == memory[0]["ours_us"]
        assert len(ratios.patches) == len(rows) - 1
    finally:
        plt.close(figure)


def test_every_suite_is_described_on_the_benchmarks_page():
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    described = {line.split("`")[1] for line in page.splitlines() if line.startswith("| `bench_")}
    on_disk = {path.stem for path in (ROOT / "benchmarks").glob("bench_*.py")}
    assert on_disk == described, f"docs/benchmarks.md's suite table differs: {on_disk ^ described}"
