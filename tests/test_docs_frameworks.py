"""Docs that include Flax Linen (issue 31 item 15): every place that lists the adapters,
the frameworks or what a command runs lists each of them, so that a framework added later
cannot be left out silently either."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = (ROOT / "README.md").read_text()
PYPROJECT = (ROOT / "pyproject.toml").read_text()  # read as text: tomllib is Python 3.11+
ADAPTERS = sorted(p.name for p in (ROOT / "adapters").glob("jaxoverride_*"))
# The stateful frameworks, as the docs name them, by the adapter that handles them.
FRAMEWORKS = {"jaxoverride_haiku": "Haiku", "jaxoverride_nnx": "NNX", "jaxoverride_linen": "Linen"}


def _line(text: str, start: str) -> str:
    [line] = [line for line in text.splitlines() if line.lstrip().startswith(start)]
    return line


def test_make_demo_is_described_as_what_it_runs():
    demo = (ROOT / "examples" / "fixed_point.py").read_text()
    runs = set(re.findall(r'_optional\("fixed_point_(\w+)"\)', demo))
    assert runs == {"haiku", "nnx", "linen"}
    for text in (README, (DOCS / "quickstart.md").read_text()):
        line = _line(text, "make demo")
        for name in FRAMEWORKS.values():
            assert name in line, (name, line)
    makefile = (ROOT / "Makefile").read_text()
    extras = re.search(r'\.installed-demo:.*\n\t\$\(PIP\) -e "\.\[([\w,]+)\]"', makefile)
    assert extras is not None and set(extras[1].split(",")) == runs


def test_the_all_extra_is_described_as_what_it_holds():
    held = re.search(r'^all = \["jaxoverride\[([\w,]+)\]"\]$', PYPROJECT, re.MULTILINE)
    assert held is not None and set(held[1].split(",")) == {"haiku", "nnx", "linen", "debug"}
    line = _line(README, 'pip install -e ".[all]"')
    for word in ("Haiku", "NNX", "Linen", "debug"):
        assert word in line, line
    assert "Linen" in _line((DOCS / "quickstart.md").read_text(), 'pip install "jaxoverride[all]"')


def test_the_readme_lists_every_adapter_in_its_layout_and_documentation():
    layout = README[README.index("## Layout") :]
    documentation = README[README.index("## Documentation") : README.index("## Layout")]
    for adapter in ADAPTERS:
        assert f"adapters/{adapter}/" in layout, adapter
    for adapter, name in FRAMEWORKS.items():
        page = adapter.removeprefix("jaxoverride_")
        assert f"[{name}]" in documentation, name
        assert f"[{page}]: https://jaxoverride.github.io/jaxoverride/{page}.html" in README


def test_the_recipes_line_names_every_framework_the_recipes_train():
    recipes = (DOCS / "recipes.md").read_text()
    sections = re.findall(r"^## (?:Flax )?(\w+)$", recipes, re.MULTILINE)
    line = README[README.index("[DEQ and neural ODE recipes][recipes] are") :].split("\n\n")[0]
    for section in sections:
        assert section in line, (section, line)
    assert {"Haiku", "NNX", "Linen"} <= set(sections)


@pytest.mark.parametrize(
    ("page", "needle"),
    [
        ("index.md", "[Linen](linen.md)"),
        ("index.md", "a Linen model"),
        ("model-authors.md", "[`jaxoverride_linen`](linen.md)"),
        ("model-authors.md", "## One library, five models"),
        ("model-authors.md", "**Linen**:"),
        ("quickstart.md", "### 4. A Flax Linen model calls the library"),
        ("training-through-a-solver.md", "| Linen (`jaxoverride_linen`) |"),
        ("troubleshooting.md", "## Flax Linen: tracers returned as parameters"),
    ],
)
def test_the_pages_include_linen(page, needle):
    assert needle in (DOCS / page).read_text()


def test_model_authors_counts_the_models_it_shows():
    text = (DOCS / "model-authors.md").read_text()
    shown = re.findall(r"^\*\*(\w+)\*\*:", text, re.MULTILINE)
    words = {4: "four", 5: "five", 6: "six"}
    assert f"## One library, {words[len(shown)]} models" in text, shown


def test_the_wheel_describes_linen():
    assert re.search(r'^description = ".*Flax Linen.*"$', PYPROJECT, re.MULTILINE)
    keywords = re.search(r"^keywords = \[(.*)\]$", PYPROJECT, re.MULTILINE)
    assert keywords is not None and '"linen"' in keywords[1]


REPOSITORY_LINK = re.compile(
    r"\[`(?:examples|tests)/[\w./]+`\]\(https://github\.com/jaxoverride/jaxoverride/[^)]+\)"
)


def test_linen_page_points_pip_users_only_to_what_they_have():
    text = (DOCS / "linen.md").read_text()
    # A path into the repository, which pip users lack, is given only as a link to it.
    assert not re.findall(r"\b(?:examples|tests)/", REPOSITORY_LINK.sub("", text))
    assert "recipes.md#flax-linen" in text
    # The diffrax #115 'after' program is a python block that the docs tests run.
    assert "```text\nimport jaxoverride as jo" not in text
    marker = "<!-- docs-test: fresh interpreter, diffrax-115 -->\n```python\nimport jaxoverride"
    assert marker in text


def test_existing_libraries_says_where_a_diffrax_callback_write_runs():
    text = (DOCS / "existing-libraries.md").read_text()
    assert "`DirectAdjoint` or `ForwardMode`" in text
    assert "once per vector-field evaluation" in text
    assert "<!-- docs-test: fresh interpreter, diffrax-direct-adjoint -->" in text
