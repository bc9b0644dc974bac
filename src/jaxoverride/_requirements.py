"""The supported versions: jaxoverride's own requirements, read from its installed
distribution's metadata (``Requires-Dist``), so that ``pyproject.toml`` stays the one place
that states them."""

from __future__ import annotations

import re
from typing import NamedTuple

_REQUIREMENT = re.compile(
    r"^\s*(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(?P<specifiers>[^;]*)"
    r"(?:;\s*(?P<marker>.*))?$"
)
_EXTRA = re.compile(r"""extra\s*==\s*['"](?P<extra>[^'"]+)['"]""")
_SPECIFIER = re.compile(r"^\s*(?P<op>~=|==|!=|<=|>=|<|>)\s*(?P<version>\S+)\s*$")


class Requirement(NamedTuple):
    """One ``Requires-Dist`` entry: a distribution, its range, and the extra that asks for
    it (None for a requirement of the core)."""

    distribution: str
    specifiers: str  # as written: ">=0.8.1,<0.12"
    extra: str | None


def parse(line: str) -> Requirement | None:
    """A ``Requires-Dist`` line as a ``Requirement``; None for one this reader does not
    understand (a URL, a marker other than an extra).

    Example:
      >>> parse("dm-haiku<0.1,>=0.0.15; extra == 'haiku'")
      Requirement(distribution='dm-haiku', specifiers='<0.1,>=0.0.15', extra='haiku')
    """
    match = _REQUIREMENT.match(line)
    if match is None or "@" in match["specifiers"]:
        return None
    marker = (match["marker"] or "").strip()
    extra = _EXTRA.fullmatch(marker)
    if marker and extra is None:
        return None
    specifiers = match["specifiers"].strip().strip("()").replace(" ", "")
    return Requirement(match["name"], specifiers, extra["extra"] if extra else None)


def requirements(distribution: str = "jaxoverride") -> list[Requirement] | None:
    """The requirements of the installed ``distribution``; None where it is not installed
    (run from a source tree)."""
    import importlib.metadata  # here, not at import: it costs ``import jaxoverride`` time

    try:
        lines = importlib.metadata.requires(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    return [found for found in map(parse, lines) if found is not None]


def _release(version: str) -> tuple[int, ...]:
    match = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(part) for part in match[0].split(".")) if match else ()


def _compare(left: tuple[int, ...], right: tuple[int, ...]) -> int:
    width = max(len(left), len(right))
    left, right = left + (0,) * (width - len(left)), right + (0,) * (width - len(right))
    return (left > right) - (left < right)


def satisfies(version: str, specifiers: str) -> bool:
    """Whether ``version`` is inside ``specifiers`` (``">=0.8.1,<0.12"``), comparing
    release numbers.

    Example:
      >>> satisfies("0.10.2", ">=0.8.1,<0.12"), satisfies("0.12.0", ">=0.8.1,<0.12")
      (True, False)
    """
    installed = _release(version)
    for specifier in filter(None, specifiers.split(",")):
        match = _SPECIFIER.match(specifier)
        if match is None:
            continue
        order = _compare(installed, _release(match["version"]))
        op = match["op"]
        if op == "~=":
            bound = _release(match["version"])
            ok = order >= 0 and installed[: len(bound) - 1] == bound[:-1]
        else:
            ok = {
                "==": order == 0,
                "!=": order != 0,
                "<=": order <= 0,
                ">=": order >= 0,
                "<": order < 0,
                ">": order > 0,
            }[op]
        if not ok:
            return False
    return True
