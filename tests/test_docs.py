"""Every ``python`` code block in the docs and the README runs, file by file, in order."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text())


def test_the_docs_have_code_to_run():
    assert sum(len(blocks(page)) for page in PAGES) >= 8


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p)], ids=lambda p: p.name)
def test_code_blocks_run(page: Path):
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    for index, source in enumerate(blocks(page)):
        code = compile(source, f"{page.name}[block {index}]", "exec")
        exec(code, namespace)


def test_api_reference_is_current():
    """docs/api.md is generated from the packages; regenerate it after changing the API."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "docs" / "gen_api.py")
    assert spec is not None and spec.loader is not None
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert (ROOT / "docs" / "api.md").read_text() == generator.render(), (
        "docs/api.md is out of date: run `.venv/bin/python docs/gen_api.py`"
    )
