"""Counts and lists in messages: "1 transform", "2 transforms", "a, b, c, ..."."""

from __future__ import annotations

from collections.abc import Sequence


def counted(count: int, singular: str, plural: str | None = None) -> str:
    """``count`` and the noun phrase (``plural``, by default ``singular + "s"``) that
    agrees with it.

    Example:
      >>> from jaxoverride._words import counted
      >>> counted(1, "of them would be a tracer", "of them would be tracers")
      '1 of them would be a tracer'
      >>> counted(2, "module")
      '2 modules'
    """
    noun = singular if count == 1 else (plural if plural is not None else singular + "s")
    return f"{count} {noun}"


def listed(items: Sequence[str], shown: int = 3) -> str:
    """The first ``shown`` of ``items``, comma-separated, and ``", ..."`` for any more."""
    return ", ".join(items[:shown]) + (", ..." if len(items) > shown else "")
