"""The figures quoted in the docs' prose are the benchmark report's.

Every measured figure a page quotes (a ratio such as ``1.15x``, a time in µs) is listed in
``FIGURES`` with the report rows it comes from (``benchmarks/results/results.json``, which
``docs/benchmark-report.md`` is drawn from), and must agree with them to within
``TOLERANCE``: rounding, and the noise of one ``make bench`` run against the next. After
``make bench`` moves a number further than that, this test names the sentence to update.
Every ``Nx`` figure (or with a multiplication sign) on every page is either such a figure
or a target, and every target quoted is one the report judges.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
ROWS: list[dict] = json.loads((ROOT / "benchmarks" / "results" / "results.json").read_text())
TOLERANCE = 0.05  # relative
# Pages that are generated from the results, or that quote no measurement.
GENERATED = {
    "benchmark-report.md",
    "benchmark-report-gpu.md",
    "benchmark-report-newest.md",
    "api.md",
}
CODE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
MULTIPLE = re.compile(r"(?<![\w.])\d+(?:\.\d+)?x(?![\w])")
TARGET = re.compile(r"(?:≤|<=|≥|>=|target(?: of)?)\s?(\d+(?:\.\d+)?)\s?x")


def prose(page: Path) -> str:
    """The page without its code blocks, every run of whitespace one space, and the
    multiplication sign and the en dash written as ``x`` and ``-``."""
    text = page.read_text().replace("\u00d7", "x").replace("\u2013", "-")
    return re.sub(r"\s+", " ", CODE.sub(" ", text))


def row(suite: str, case: str, ours: str | None = None, baseline: str | None = None) -> dict:
    found = [
        r
        for r in ROWS
        if r["suite"] == suite
        and r["case"] == case
        and (ours is None or r["ours"] == ours)
        and (baseline is None or r["baseline"] == baseline)
    ]
    assert len(found) == 1, (suite, case, ours, baseline, found)
    return found[0]


def case_starting(suite: str, prefix: str) -> str:
    """The case of the one row whose name starts with ``prefix``: the name of a case that
    says how it is measured (how many processes) changes with the method."""
    (case,) = {r["case"] for r in ROWS if r["suite"] == suite and r["case"].startswith(prefix)}
    return case


def ratio(*key: str | None) -> float:
    return row(*key)["ratio"]  # type: ignore[arg-type]


def ratio_and_target(suite: str, case: str) -> tuple[float, float]:
    """The ratio of a row of the report, and its target (``<= 1.05x`` is 1.05)."""
    found = row(suite, case)
    return found["ratio"], float(found["target"].removeprefix("<= ").removesuffix("x"))


def forwarder_cost() -> float:
    """The cost of any Python-level forwarder, which the report states in a note."""
    note = row("core", "jit dispatch, installed, when=lambda: False")["note"]
    match = re.search(r"about ([\d.]+)x measured for any forwarder", note)
    assert match is not None, note
    return float(match[1])


def scoped_installs() -> list[float]:
    return [
        ratio("core", "jit dispatch, jaxoverride_haiku.install(), outside transform"),
        ratio("core", "jit dispatch, scoped install, outside its scope"),
        ratio("haiku", "jit dispatch, install() active, outside transform"),
    ]


def scoped_install_range() -> tuple[float, float]:
    """The cheapest and the dearest of ``scoped_installs``, as design.md and faq.md quote them."""
    installs = scoped_installs()
    return min(installs), max(installs)


def predicate_ratio() -> tuple[float]:
    """The cost of an install whose ``when`` is false, as design.md and faq.md quote it."""
    return (ratio(*_CORE_PREDICATE),)


def demo_unrolled_steps() -> float:
    source = (ROOT / "examples" / "_demo.py").read_text()
    match = re.search(r"^UNROLLED_STEPS = (\d+)", source, re.MULTILINE)
    assert match is not None
    return float(match[1])


def deq_unrolled_steps() -> float:
    (case,) = [r["case"] for r in ROWS if r["suite"] == "implicit" and "-step solve" in r["case"]]
    match = re.search(r"(\d+)-step solve", case)
    assert match is not None
    return float(match[1])


@dataclass(frozen=True)
class Figure:
    page: str
    pattern: str
    """A regex over the page's prose (whitespace collapsed), one group per number."""
    expected: Callable[[], tuple[float, ...]]
    exact: bool = False


_CORE_PREDICATE = ("core", "jit dispatch, installed, when=lambda: False")
_HAIKU = ("forward", "anderson", "newton")
_TINY = "tiny (Linear + counter): cache-hit call"
_MLP = "MLP 50 x Linear: cache-hit call"
_DAG = {
    "i": "(i) one array",
    "ii": "(ii) dict of 200 arrays",
    "iii": "(iii) Equinox MLP, depth 20",
}


def _dag_pair(case: str) -> tuple[float, float]:
    return (
        ratio("dag", case, None, "jax.jit"),
        ratio("dag", case, None, "eqx.filter_jit"),
    )


FIGURES = [
    Figure(
        "dag.md",
        r"\| \(i\) one array \| ([\d.]+)x \| <= 1\.05x \| ([\d.]+)x \|",
        lambda: _dag_pair(_DAG["i"]),
    ),
    Figure(
        "dag.md",
        r"\| \(ii\) a dict of 200 arrays \| ([\d.]+)x \| <= 1\.05x \| ([\d.]+)x \|",
        lambda: _dag_pair(_DAG["ii"]),
    ),
    Figure(
        "dag.md",
        r"\| \(iii\) an Equinox MLP of depth 20 \| ([\d.]+)x \| <= 1\.05x \| ([\d.]+)x \|",
        lambda: _dag_pair(_DAG["iii"]),
    ),
    Figure(
        "dag.md",
        r"referenced 8 times \| ([\d.]+)x \(([\d.]+)x faster\) \| >= 5x faster \| ([\d.]+)x \|",
        lambda: (
            (big := _dag_pair("(iv) one 64 MB numpy array x8"))[0],
            1 / big[0],
            big[1],
        ),
    ),
    Figure(
        "dag.md",
        r"\(([\d.]+) µs against ([\d.]+) µs in medians of the rounds",
        lambda: (
            (r := row("dag", _DAG["i"], None, "jax.jit"))["ours_us"],
            r["baseline_us"],
        ),
    ),
    Figure(
        "design.md",
        r"costs ([\d.]+)x `jax.jit\(f\)` when idle",
        lambda: (ratio("core", "jit dispatch, nothing active"),),
    ),
    Figure("design.md", r"however minimal, costs about ([\d.]+)x", lambda: (forwarder_cost(),)),
    Figure("design.md", r"\(([\d.]+)x with `when=lambda: False`\)", predicate_ratio),
    Figure("design.md", r"cost ([\d.]+)-([\d.]+)x outside their scopes", scoped_install_range),
    Figure(
        "design.md",
        r"calls \(([\d.]+)x in `make bench`, within its target of ([\d.]+)x\)",
        lambda: ratio_and_target("core", case_starting("core", "raw jax.jit dispatch, ")),
    ),
    Figure("faq.md", r"costs about ([\d.]+)x `jax.jit` with `when=lambda: False`", predicate_ratio),
    Figure(
        "faq.md", r"([\d.]+)-([\d.]+)x for `jaxoverride_haiku.install\(\)`", scoped_install_range
    ),
    Figure(
        "haiku.md",
        r"\| compiled apply, `jax.jit\(model.apply\)` \| ([\d.]+) / ([\d.]+) / ([\d.]+) \|",
        lambda: tuple(ratio("haiku", f"compiled apply, {m}") for m in _HAIKU),
    ),
    Figure(
        "haiku.md",
        r"\| `jax.jit\(model.init\)`: trace, compile, run \| ([\d.]+) / ([\d.]+) / ([\d.]+) \|",
        lambda: tuple(
            ratio("haiku", f"init jax.jit(init), trace+compile+run, {m}") for m in _HAIKU
        ),
    ),
    Figure(
        "haiku.md",
        r"\| eager `model.init` \(information\) \| ([\d.]+)x / ([\d.]+)x / ([\d.]+)x \|",
        lambda: tuple(ratio("haiku", f"init eager, {m}") for m in _HAIKU),
    ),
    Figure(
        "haiku.md",
        r"outside transforms: ([\d.]+)x `jax.jit` \(target ([\d.]+)x",
        lambda: ratio_and_target("haiku", "jit dispatch, install() active, outside transform"),
    ),
    Figure(
        "haiku.md",
        r"`jo.install\(mapping, when=...\)` does, costs ([\d.]+)x: any Python-level dispatch "
        r"costs about (\d+) %",
        lambda: (ratio(*_CORE_PREDICATE), round((forwarder_cost() - 1) * 100)),
    ),
    Figure(
        "nnx.md",
        r"a Linear with a call counter ([\d.]+)x \(([\d.]+) µs against ([\d.]+) µs\)",
        lambda: (
            (r := row("nnx", _TINY, "jo.jit + track"))["ratio"],
            r["ours_us"],
            r["baseline_us"],
        ),
    ),
    Figure(
        "nnx.md",
        r"\(100 arrays\) ([\d.]+)x",
        lambda: (ratio("nnx", _MLP, "jo.jit + track", "jax.jit (flat list)"),),
    ),
    Figure(
        "nnx.md",
        r"`nnx.jit` costs ([\d.]+)x on the Linear and ([\d.]+)x on the MLP, "
        r"where `jo.jit` is ([\d.]+)x faster",
        lambda: (
            ratio("nnx", _TINY, "nnx.jit"),
            ratio("nnx", _MLP, "nnx.jit"),
            1 / ratio("nnx", _MLP, "jo.jit + track", "nnx.jit"),
        ),
    ),
    Figure(
        "nnx.md",
        r"`nnx.cached_partial` costs ([\d.]+)x and `nnx.jit_partial` ([\d.]+)x",
        lambda: (
            ratio("nnx", _MLP, "nnx.cached_partial"),
            ratio("nnx", _MLP, "nnx.jit_partial"),
        ),
    ),
    Figure(
        "training-through-a-solver.md",
        r"backpropagating through (\d+) unrolled steps",
        lambda: (demo_unrolled_steps(),),
        exact=True,
    ),
    Figure(
        "benchmarks.md",
        r"implicit against (\d+) unrolled steps",
        lambda: (deq_unrolled_steps(),),
        exact=True,
    ),
]


def _page(name: str) -> Path:
    return ROOT / name if name == "README.md" else DOCS / name


@pytest.mark.parametrize("figure", FIGURES, ids=[f"{f.page}:{f.pattern[:40]}" for f in FIGURES])
def test_quoted_figures_agree_with_the_report(figure: Figure):
    text = prose(_page(figure.page))
    matches = re.findall(figure.pattern, text)
    assert len(matches) == 1, f"{figure.page}: {figure.pattern!r} matched {len(matches)} times"
    quoted = matches[0] if isinstance(matches[0], tuple) else (matches[0],)
    expected = figure.expected()
    assert len(quoted) == len(expected)
    for said, measured in zip(quoted, expected, strict=True):
        if figure.exact:
            assert float(said) == measured, f"{figure.page} says {said}, the source {measured}"
        else:
            assert float(said) == pytest.approx(measured, rel=TOLERANCE), (
                f"{figure.page} says {said} where the report has {measured:.3g}: "
                "update the sentence to the current report"
            )


def _pages() -> list[Path]:
    return [ROOT / "README.md"] + [
        page for page in sorted(DOCS.glob("*.md")) if page.name not in GENERATED
    ]


def _report_targets() -> set[float]:
    targets = set()
    for r in ROWS:
        if match := re.match(r"(?:<=|>=) ([\d.]+)x", r["target"]):
            targets.add(float(match[1]))
    return targets


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_every_multiple_quoted_is_checked_or_a_target(page: Path):
    """A new ``Nx`` figure must be added to ``FIGURES`` (or be a target the report judges)."""
    text = prose(page)
    covered = [
        match.span()
        for figure in FIGURES
        if _page(figure.page) == page
        for match in re.finditer(figure.pattern, text)
    ]
    targets = _report_targets()
    for match in TARGET.finditer(text):
        assert float(match[1]) in targets, (
            f"{page.name}: the target {match[0]!r} is none of the report's targets"
        )
        covered.append(match.span())
    unchecked = [
        text[max(0, m.start() - 40) : m.end() + 10]
        for m in MULTIPLE.finditer(text)
        if not any(start <= m.start() and m.end() <= end for start, end in covered)
    ]
    assert not unchecked, f"{page.name}: figures not checked against the report: {unchecked}"


def test_the_checked_figures_cover_the_pages_that_quote_measurements():
    assert {f.page for f in FIGURES} >= {
        "dag.md",
        "design.md",
        "faq.md",
        "haiku.md",
        "nnx.md",
        "training-through-a-solver.md",
    }
