"""Griffe extension: reads this project's Google-style docstrings as written.

The docstrings in ``src/`` and ``adapters/`` are also ``help()`` text and doctests, so
they use two conventions that griffe's Google parser reads differently:

- ``Example:`` (singular) heads the runnable example; griffe only knows ``Examples:``
  and would render the doctest as quoted prose.
- ``f, init, xs: as for jax.lax.scan.`` documents several parameters in one Args
  entry; griffe would take ``f, init, xs`` for one unknown parameter.

This rewrites both in the text griffe parses, before parsing, so every parameter is
still checked against the signature (a misspelt name still fails the strict build).
Loaded from ``mkdocs.yml`` (``extensions:``); not a page.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_SECTION = re.compile(r"^(?P<indent>\s*)(?P<title>[A-Z][\w ]*):\s*$")
_GROUPED = re.compile(r"^(?P<indent>\s+)(?P<names>\w+(?:\s*,\s*\w+)+):\s*(?P<desc>.*)$")


def restyle(text: str) -> str:
    """The docstring ``text`` with ``Example:`` renamed and grouped parameters split."""
    lines: list[str] = []
    section: str | None = None
    section_indent = -1
    for line in text.splitlines():
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if stripped and indent <= section_indent:
            section, section_indent = None, -1
        header = _SECTION.match(line)
        if header and section is None:
            section, section_indent = header["title"], indent
            if header["title"] == "Example":
                line = f"{header['indent']}Examples:"
            lines.append(line)
            continue
        grouped = _GROUPED.match(line) if section in ("Args", "Arguments") else None
        if grouped:
            names = [name.strip() for name in grouped["names"].split(",")]
            lines += [f"{grouped['indent']}{name}: {grouped['desc']}" for name in names]
            continue
        lines.append(line)
    return "\n".join(lines)


class ProjectDocstrings(griffe.Extension):
    """Applies ``restyle`` to the docstring of every object griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = restyle(obj.docstring.value)
