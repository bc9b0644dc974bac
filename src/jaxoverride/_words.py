"""Counts in messages: "1 transform", "2 transforms"."""

from __future__ import annotations


def counted(count: int, singular: str, plural: str | None = None) -> str:
    """``count`` and the noun phrase that agrees with it.

    Args:
      count: how many.
      singular: the phrase for one (``"transform"``, ``"of them would be a tracer"``).
      plural: the phrase for any other count; by default ``singular + "s"``.

    Returns:
      ``"1 transform"``, ``"3 transforms"``.

    Example:
      >>> from jaxoverride._words import counted
      >>> counted(1, "of them would be a tracer", "of them would be tracers")
      '1 of them would be a tracer'
      >>> counted(2, "module")
      '2 modules'
    """
    noun = singular if count == 1 else (plural if plural is not None else singular + "s")
    return f"{count} {noun}"
