"""The docs run and the reference is complete.

Every ``python`` code block of README.md and of every page under docs/ (subdirectories
included) runs, page by page, blocks in order, in one namespace per page. Every public
name of every package has an entry in the API reference, and docs/api.md, the index
generated from the packages, is current.
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
# ``::: package.name`` blocks, and ``[](){#package.name}`` anchors for the neutral names
# (their docstrings are JAX's, so the reference points to JAX's documentation instead).
ENTRY = re.compile(r"^::: ([\w.]+)\s*$|\[\]\(\)\{#([\w.]+)\}", re.MULTILINE)


def blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text())


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


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p)], ids=_label)
def test_code_blocks_run(page: Path):
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    for index, source in enumerate(blocks(page)):
        code = compile(source, f"{_label(page)}[block {index}]", "exec")
        exec(code, namespace)


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
