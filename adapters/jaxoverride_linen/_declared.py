"""``jaxoverride.solve_state`` at Linen's own boundaries: custom rules and conversions.

The functions JAX makes pure (closure-converted maps, custom solves, a rule's functions)
refuse writes and draws (``_guards.pure``); under a declaration what it freezes is let
through: a frozen stream draws from the entry key at the entry's counters, and a write to
a collection kept at the solution starts from the entry state and is handed out by a
converted function (``kit.declared_closure_convert``), else dropped. A custom rule keeps
the declaration found at its call, since JAX runs ``bwd`` after it exited.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, cast

from jaxoverride import adapter_kit as kit
from jaxoverride_linen import _trees as trees
from jaxoverride_linen._per_thread import local as _local

NO_DECLARATION: frozenset[tuple[str, str]] = frozenset()

SOLVE_STATE_FIX = (
    "Or declare what the solver's evaluations share around the solver call: "
    '`with jaxoverride.solve_state(rng="per_solve", state="at_solution"):` (one key '
    "per solve, the state written once at the solution); inside it these draws and writes "
    "follow the declaration."
)


def frozen(policy: kit.Participant) -> list[tuple[tuple[Any, ...], Any]]:
    """The slots ``policy`` freezes (Linen's are tuples: ``("rng", root, stream)`` and
    ``("state", root, collection, path)``, see ``LinenSource.parts``), with their values."""
    return [(cast(tuple[Any, ...], slot), value) for slot, value in policy.frozen.items()]


def allowed(policy: kit.Participant | None) -> frozenset[tuple[str, str]]:
    """``("rng", stream)`` and ``("state", collection)`` that ``policy`` freezes.

    Args:
      policy: the declaration's participant for Linen, or None.

    Returns:
      What a pure function may draw from or write under it (empty without one).

    Example:
      >>> from jaxoverride_linen import _declared
      >>> _declared.allowed(None)
      frozenset()
    """
    if policy is None:
        return NO_DECLARATION
    return frozenset((slot[0], slot[2]) for slot, _ in frozen(policy))


def frozen_collections_any(policy: kit.Participant | None) -> bool:
    """Whether ``policy`` keeps any collection at the solution."""
    return policy is not None and any(slot[0] == "state" for slot, _ in frozen(policy))


@contextlib.contextmanager
def evaluating(
    policy: kit.Participant | None, roots: Sequence[Any], install: bool = False
) -> Iterator[None]:
    """One evaluation under ``policy``: Linen's draws see it, and the streams it freezes
    start from the entry's counters (with ``install``, the frozen collections from entry).

    Args:
      policy: the declaration (``kit.Participant``), or None (then nothing changes).
      roots: the adapter's roots (``_source._Root``) the evaluation runs on.
      install: put the frozen collections' entry values live (a conversion; a rule
        receives them as its argument).

    Returns:
      A context; on exit the counters are as they were before it (the caller puts the
      variables back: ``_guards.pure``, or the threading's ``leave``).
    """
    if policy is None or not policy.frozen:
        yield
        return
    saved = [(root, trees.copy_dicts(root.counters)) for root in roots]
    entry = policy.source._entry_counters or {}
    for root in roots:
        rid = id(root.variables)
        for slot, value in frozen(policy):
            if slot[1] != rid:
                continue
            if slot[0] == "rng":
                trees.restore_stream(root.counters, entry.get(rid, {}), slot[2])
            elif install:  # the frozen collections' leaves live, as at entry
                col, path = slot[2], slot[3]
                if trees.get_path(root.variables.get(col, {}), path) is not trees.MISSING:
                    trees.put_path(root.variables[col], path, value)
    _local.declared.append(policy)
    try:
        yield
    finally:
        _local.declared.pop()
        for root, counters in saved:
            trees.restore(root.counters, counters, fresh=0)
