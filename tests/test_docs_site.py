"""The documentation site builds strictly, and a broken reference fails the build.

Runs ``mkdocs build --strict`` (what ``make docs`` and CI run) with this Python
environment into a temporary directory.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENTRY = re.compile(r"^::: ([\w.]+)\s*$|\[\]\(\)\{#([\w.]+)\}", re.MULTILINE)


def _generator_packages() -> list[str]:
    """The packages that docs/gen_api.py indexes, one table each."""
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "docs" / "gen_api.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PACKAGES


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_strict_build_passes(tmp_path: Path):
    site = tmp_path / "site"
    result = _build(ROOT / "mkdocs.yml", site)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "WARNING" not in result.stderr, result.stderr[-4000:]

    core = (site / "reference" / "jaxoverride.html").read_text()
    assert 'id="jaxoverride.override_context"' in core  # rendered by mkdocstrings
    assert 'id="jaxoverride.jit"' in core  # the neutral names' anchors
    # Examples are highlighted doctests, not quoted prose: docs/reference/_griffe_style.py.
    assert '<span class="gp">&gt;&gt;&gt; </span>' in core
    assert "<blockquote>" not in core
    index = (site / "api.html").read_text()
    assert 'href="reference/jaxoverride.html#jaxoverride.override_context"' in index
    # Each package's table sits in the api-index block whose names never wrap mid-word
    # (docs/stylesheets/extra.css; the theme alone splits OVERRIDEABLE over two lines).
    blocks = re.findall(r'<div class="api-index">\s*<table>', index)
    assert len(blocks) == index.count("<table>") == len(_generator_packages()), len(blocks)
    css = (site / "stylesheets" / "extra.css").read_text()
    assert re.search(r"\.api-index td:first-child code \{[^}]*white-space: nowrap", css)
    assert 'href="stylesheets/extra.css"' in index
    # Every entry of every reference page made it into the site (none dropped for lack
    # of a docstring, none unresolved).
    for page in sorted((ROOT / "docs" / "reference").glob("*.md")):
        html = (site / "reference" / f"{page.stem}.html").read_text()
        for block, anchor in ENTRY.findall(page.read_text()):
            assert f'id="{block or anchor}"' in html, f"{block or anchor} is not on {page.name}"
    for page in ("quickstart", "faq", "model-authors", "benchmarks"):
        assert (site / f"{page}.html").is_file()


def test_the_site_opens_from_disk(tmp_path: Path):
    """No directory-style links: every internal link names an existing file."""
    site = tmp_path / "site"
    assert _build(ROOT / "mkdocs.yml", site).returncode == 0
    link = re.compile(r'href="([^"#:?]+)(?:#[^"]*)?"')
    checked = 0
    for html in site.rglob("*.html"):
        if html.name == "404.html":  # served at any depth, so its links are site-absolute
            continue
        for target in link.findall(html.read_text()):
            if target.startswith("//"):
                continue
            resolved = (html.parent / target).resolve()
            assert resolved.exists(), f"{html.relative_to(site)} links to {target}"
            assert not resolved.is_dir(), f"{html.relative_to(site)} links to a folder: {target}"
            checked += 1
    assert checked > 500
    # The offline plugin: on a file:// page the theme loads the search index as a script,
    # not with a fetch that such a page may not make, through the iframe-worker shim.
    assert (site / "search" / "search_index.js").is_file()
    assert "iframe-worker/shim" in (site / "index.html").read_text()


def test_broken_links_anchors_and_references_fail_the_build(tmp_path: Path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text(
        "# Broken\n\n"
        "[a page](missing.md), [an anchor](#nowhere), "
        "[a name][jaxoverride.no_such_name].\n"
    )
    config = tmp_path / "mkdocs.yml"
    config.write_text(f"INHERIT: {ROOT / 'mkdocs.yml'}\ndocs_dir: {docs}\nnav:\n  - index.md\n")
    result = _build(config, tmp_path / "site")
    assert result.returncode != 0
    for culprit in ("missing.md", "#nowhere", "jaxoverride.no_such_name"):
        assert culprit in result.stderr, result.stderr[-4000:]
