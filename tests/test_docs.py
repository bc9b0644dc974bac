"""The docs run and the reference is complete.

Every ``python`` code block of README.md and of every page under docs/ (subdirectories
included) runs, page by page, blocks in order, in one namespace per page. A block right
after a ``<!-- docs-test: fresh interpreter, NAME -->`` line runs instead in a fresh
interpreter, with the other blocks of its page marked with the same NAME, in order: code
that must start a program (``jo.interpose_on_import`` before equinox is first imported).
Every public name of every package has an entry in the API reference, and docs/api.md,
the index generated from the packages, is current.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
MARKED_BLOCK = re.compile(
    r"^(?:<!-- docs-test: fresh interpreter, ([\w-]+) -->\n)?```python\n(.*?)^```",
    re.DOTALL | re.MULTILINE,
)
# ``::: package.name`` blocks, and ``[](){#package.name}`` anchors for the neutral names
# (their docstrings are JAX's, so the reference points to JAX's documentation instead).
ENTRY = re.compile(r"^::: ([\w.]+)\s*$|\[\]\(\)\{#([\w.]+)\}", re.MULTILINE)


def blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text())


def shared_blocks(page: Path) -> list[str]:
    """The blocks that run in the page's one namespace, in the test process."""
    return [source for fresh, source in MARKED_BLOCK.findall(page.read_text()) if not fresh]


def fresh_programs(page: Path) -> dict[str, str]:
    """Each fresh-interpreter program of the page: its marked blocks, joined in order."""
    programs: dict[str, list[str]] = {}
    for fresh, source in MARKED_BLOCK.findall(page.read_text()):
        if fresh:
            programs.setdefault(fresh, []).append(source)
    return {name: "\n".join(sources) for name, sources in programs.items()}


def _label(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_api", DOCS / "gen_api.py")
    assert spec is not None and spec.loader is not None
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    return generator


def test_the_docs_have_code_to_run():
    assert sum(len(blocks(page)) for page in PAGES) >= 30
    for name in ("quickstart.md", "model-authors.md", "faq.md", "writing-an-adapter.md"):
        assert blocks(DOCS / name), f"docs/{name} should show runnable code"


@pytest.mark.parametrize("page", [p for p in PAGES if shared_blocks(p)], ids=_label)
def test_code_blocks_run(page: Path):
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    for index, source in enumerate(shared_blocks(page)):
        code = compile(source, f"{_label(page)}[block {index}]", "exec")
        exec(code, namespace)


FRESH = [(page, name) for page in PAGES for name in fresh_programs(page)]
# Programs that fail today, each with the error it must fail with and why (the page says
# so beside the program); one that runs fails the test: drop it from here.
EXPECTED_FAILURES: dict[str, tuple[str, str]] = {}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("page", "name"), FRESH, ids=[f"{_label(page)}:{name}" for page, name in FRESH]
)
def test_fresh_interpreter_blocks_run(page: Path, name: str):
    source = fresh_programs(page)[name]
    result = subprocess.run(
        [sys.executable, "-c", source], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    if name in EXPECTED_FAILURES:
        error, reason = EXPECTED_FAILURES[name]
        assert result.returncode != 0, f"{name} runs now: drop it from EXPECTED_FAILURES"
        assert error in result.stderr, f"{_label(page)} ({name}):\n{result.stderr[-3000:]}"
        pytest.xfail(reason)
    assert result.returncode == 0, f"{_label(page)} ({name}):\n{result.stderr[-3000:]}"


def test_the_recipes_run_in_fresh_interpreters():
    """Every framework's recipe is a complete program that trains through both libraries."""
    programs = fresh_programs(DOCS / "recipes.md")
    assert {"haiku", "nnx", "linen", "plain"} <= set(programs), sorted(programs)
    for name in ("haiku", "nnx", "linen", "plain"):
        for needed in ("optx.fixed_point", "diffrax.diffeqsolve", "optax.", "unrolled_loss"):
            assert needed in programs[name], f"the {name} recipe does not use {needed}"
    # Dropout and BatchNorm inside the solve, declared, in every framework; a neural ODE
    # with BatchNorm through diffrax.
    stateful = {f"{name}-dropout" for name in ("haiku", "nnx", "linen")}
    assert stateful <= set(programs), sorted(programs)
    for name in stateful:
        for needed in ("optx.fixed_point", "jo.solve_state(", "dropout", "BatchNorm", "optax."):
            assert needed in programs[name], f"the {name} recipe does not use {needed}"
    for needed in ("diffrax.diffeqsolve", "jo.solve_state(", "BatchNorm", "optax."):
        assert needed in programs["linen-ode"], f"the neural ODE recipe does not use {needed}"
    for name, source in programs.items():
        if name != "plain":  # interposed before anything imports equinox
            first_import = re.search(r"^import (?!jaxoverride\b).*$", source, re.MULTILINE)
            assert first_import is not None
            assert source.index("jo.interpose_on_import(") < first_import.start(), name


@pytest.mark.parametrize("index", range(len(blocks(ROOT / "README.md"))))
def test_each_readme_block_runs_on_its_own(index: int):
    """A reader copies one block, not the page: each block carries its own imports."""
    source = blocks(ROOT / "README.md")[index]
    result = subprocess.run(
        [sys.executable, "-c", source], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, f"README block {index} alone:\n{result.stderr[-3000:]}"


def _documented() -> dict[str, Path]:
    entries: dict[str, Path] = {}
    for page in sorted((DOCS / "reference").glob("*.md")):
        for block, anchor in ENTRY.findall(page.read_text()):
            identifier = block or anchor
            assert identifier not in entries, f"{identifier} is documented twice"
            entries[identifier] = page
    return entries


def test_every_public_name_is_in_the_reference():
    generator = _generator()
    documented = _documented()
    missing = [
        f"{package}.{name} (add it to {_label(generator.reference_page(package))})"
        for package in generator.PACKAGES
        for name in generator.public_names(package)
        if f"{package}.{name}" not in documented
    ]
    assert not missing, "public names missing from the API reference: " + ", ".join(missing)


def test_the_reference_documents_only_public_names():
    generator = _generator()
    public = {
        f"{package}.{name}"
        for package in generator.PACKAGES
        for name in generator.public_names(package)
    }
    stray = [
        f"{identifier} in {_label(page)}"
        for identifier, page in _documented().items()
        if identifier not in public and identifier not in generator.PACKAGES
    ]
    assert not stray, "reference entries that are not public names: " + ", ".join(stray)


def test_api_index_is_current():
    """docs/api.md is generated from the packages; regenerate it after changing the API."""
    assert (DOCS / "api.md").read_text() == _generator().render(), (
        "docs/api.md is out of date: run `.venv/bin/python docs/gen_api.py`"
    )


def _site_url() -> str:
    match = re.search(r"^site_url: (\S+)$", (ROOT / "mkdocs.yml").read_text(), re.MULTILINE)
    assert match is not None, "mkdocs.yml has no site_url"
    return match[1]


def test_the_package_metadata_points_to_the_documentation():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    urls = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]
    assert urls["Documentation"] == _site_url()
    assert {"Documentation", "Repository"} <= set(urls)


def test_readme_links_work_on_a_package_index():
    """The README is the package's long description: no link may be relative, and every
    link into the documentation names a page or file of the site."""
    readme = (ROOT / "README.md").read_text()
    inline = re.findall(r"\]\(([^)\s]+)\)", readme)
    defined = re.findall(r"^\[[^\]]+\]: (\S+)$", readme, re.MULTILINE)
    autolinks = re.findall(r"<(https?://[^>]+)>", readme)
    links = inline + defined + autolinks
    assert len(defined) >= 15, defined
    relative = [link for link in links if not link.startswith(("https://", "http://"))]
    assert not relative, f"relative links break on a package index: {relative}"
    base = _site_url()
    for link in links:
        if not link.startswith(base):
            continue
        path = link[len(base) :].split("#")[0] or "index.html"
        source = DOCS / (path.removesuffix(".html") + ".md" if path.endswith(".html") else path)
        assert source.is_file(), f"{link}: no {source.relative_to(ROOT)}"


def test_messages_name_documentation_pages_by_title():
    """A repository path (docs/troubleshooting.md) means nothing to someone who installed
    the wheel: messages and docstrings name the page's title instead."""
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for folder in ("src", "adapters")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\bdocs/[\w./-]+", line)
    ]
    assert not offenders, offenders


def test_the_home_page_lists_exactly_the_neutral_names():
    import jaxoverride as jo

    page = (DOCS / "index.md").read_text()
    section = page.split("## The neutral API", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "`" in line]
    listed = [name for line in rows for name in re.findall(r"`([\w.]+)`", line.split("|")[2])]
    assert len(listed) == len(set(listed)), f"listed twice: {listed}"
    assert set(listed) == set(jo.OVERRIDEABLE), (
        f"missing: {sorted(set(jo.OVERRIDEABLE) - set(listed))}, "
        f"not overridable: {sorted(set(listed) - set(jo.OVERRIDEABLE))}"
    )
