"""Laying a tree of shardings or partition specs over a plan's traced leaves.

``jit``'s and ``shard_map``'s shardings and specs describe the caller's tree; the adapter
passes a shared array once, so it gets the value above its positions: ``None`` gives way
to a sharding given elsewhere, and two different ones are a ``SharingError``.
"""

from __future__ import annotations

from typing import Any

from jaxoverride_dag._axes import spread
from jaxoverride_dag._plan import Plan


class _ConflictError(Exception):
    pass


def _unspecified_gives_way(a: Any, b: Any) -> Any:
    if a is None:
        return b
    if b is None:
        return a
    raise _ConflictError


def spread_shardings(
    plan: Plan, prefix: Any, *, api: str, what: str, noun: str = "sharding"
) -> tuple[Any, ...]:
    """One sharding (or spec, or ``None``) per traced leaf of ``plan``.

    Args:
      plan: the plan of the tree that ``prefix`` describes.
      prefix: a tree prefix of the decoded tree; shardings, specs and ``None`` are leaves.
      api, what, noun: for messages, such as ``"jit"``, ``"in_shardings"``, ``"sharding"``.

    Returns:
      The value above each traced leaf.

    Raises:
      SharingError: one shared array is under two different non-``None`` values.
    """
    try:
        return spread(plan, prefix, api=api, what=what, noun=noun, merge=_unspecified_gives_way)
    except _ConflictError:
        # Again without merging, for the error that names both positions.
        return spread(plan, prefix, api=api, what=what, noun=noun)


def positional_prefix(value: Any, count: int, api: str, what: str) -> tuple[Any, ...]:
    """``in_shardings`` as a tuple with one entry per positional argument, as JAX wants it."""
    if isinstance(value, list):
        value = tuple(value)
    if not isinstance(value, tuple) or len(value) != count:
        got = (
            f"a tuple of length {len(value)}" if isinstance(value, tuple) else type(value).__name__
        )
        raise ValueError(
            f"jaxoverride_dag.{api}: {what} must be a single sharding or a tuple with one "
            f"entry per positional (non-static) argument; got {got} for {count} "
            f"argument(s). Fix: give {count} entries, one per argument."
        )
    return value
