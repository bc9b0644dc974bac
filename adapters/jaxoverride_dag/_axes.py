"""Spreading a prefix tree (``in_axes``, ``out_axes``, donation flags) over a plan's leaves.

The prefix is laid over the *expanded* tree (a shared object at each of its positions). A
shared array under two different values is an error unless the caller merges them or
(``spread_splitting``) passes the array once per value: JAX never sees array sharing and
arrays are immutable, so splitting loses nothing. A shared *node* would lose its identity.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jax import tree_util as jtu

from jaxoverride_dag._errors import SharingError, format_path
from jaxoverride_dag._plan import Plan
from jaxoverride_dag._reshare import split_by

_UNSET: Any = object()


class _Mark:
    """Stands for traced leaf ``index`` while a prefix is laid over a plan."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __repr__(self) -> str:
        return f"<leaf {self.index}>"


def _is_none(x: Any) -> bool:
    return x is None


def spread(
    plan: Plan,
    prefix: Any,
    *,
    api: str,
    what: str,
    noun: str,
    merge: Callable[[Any, Any], Any] | None = None,
) -> tuple[Any, ...]:
    """The value of ``prefix`` above each traced leaf of ``plan``.

    Args:
      plan: the plan of the tree that ``prefix`` describes.
      prefix: a tree prefix of the decoded tree, ``None`` counting as a leaf.
      api, what, noun: for messages: ``"vmap"``, ``"in_axes"``, ``"mapped axis"``.
      merge: combines two values found for one shared leaf; without it, different
        values raise ``SharingError``.

    Returns:
      One value per traced leaf; static leaves take none.
    """
    marks = [_Mark(i) for i in range(plan.n_dyn)]
    tree = plan.decode(marks)
    prefix_leaves, prefix_def = jtu.tree_flatten(prefix, is_leaf=_is_none)
    try:
        subtrees = prefix_def.flatten_up_to(tree)
    except (ValueError, TypeError) as error:
        raise ValueError(
            f"jaxoverride_dag.{api}: {what} must be a tree prefix of the {plan.label}, but it "
            f"does not match them: {error}"
        ) from None
    values: list[Any] = [_UNSET] * plan.n_dyn
    source: list[int] = [-1] * plan.n_dyn
    for j, (value, subtree) in enumerate(zip(prefix_leaves, subtrees, strict=True)):
        for leaf in jtu.tree_leaves(subtree):
            if type(leaf) is not _Mark:
                continue
            i = leaf.index
            if values[i] is _UNSET:
                values[i], source[i] = value, j
            elif values[i] is not value and values[i] != value:
                if merge is None:
                    raise _conflict(plan, prefix, tree, i, source[i], j, api, what, noun)
                values[i] = merge(values[i], value)
    return tuple(values)


def spread_splitting(
    plan: Plan, prefix: Any, *, api: str, what: str, noun: str
) -> tuple[Plan, tuple[Any, ...]]:
    """``spread``, giving a shared array once per value it is found under.

    Returns:
      ``(plan, values)``: ``plan`` itself when no array is under two values, else the
      plan of the same form that shares an array only between positions of one value
      (pass the call's traced leaves through ``rebase(dyn, plan, returned_plan)``).

    Raises:
      SharingError: a shared node (not an array) is under two different values.
    """
    try:
        return plan, spread(plan, prefix, api=api, what=what, noun=noun)
    except SharingError:
        pass
    finest, _ = split_by(plan, None)
    # The finest plan still walks a shared node once, so a node's conflict raises here.
    values = spread(finest, prefix, api=api, what=what, noun=noun)
    split, numbers = split_by(plan, values)
    by_slot: list[Any] = [None] * split.n_dyn
    for value, slot in zip(values, numbers, strict=True):
        by_slot[slot] = value
    return split, tuple(by_slot)


def _conflict(
    plan: Plan,
    prefix: Any,
    tree: Any,
    index: int,
    first: int,
    second: int,
    api: str,
    what: str,
    noun: str,
) -> SharingError:
    prefix_paths = [path for path, _ in jtu.tree_flatten_with_path(prefix, is_leaf=_is_none)[0]]
    prefix_values = jtu.tree_leaves(prefix, is_leaf=_is_none)
    prefix_def = jtu.tree_structure(prefix, is_leaf=_is_none)
    found: dict[int, str] = {}
    for j, subtree in enumerate(prefix_def.flatten_up_to(tree)):
        if j not in (first, second) or j in found:
            continue
        for path, leaf in jtu.tree_flatten_with_path(subtree)[0]:
            if type(leaf) is _Mark and leaf.index == index:
                found[j] = format_path(prefix_paths[j] + path, plan.style, plan.label)
                break
    return SharingError(
        f"jaxoverride_dag.{api}: one array is shared by {found.get(first, '?')} and "
        f"{found.get(second, '?')}, but {what} gives them different values "
        f"({prefix_values[first]!r} and {prefix_values[second]!r}). A shared array is passed "
        f"once, so it has a single {noun}. Fix: give both positions the same {noun}, or pass "
        "two separate arrays (for example x and x.copy()) if they are meant to differ."
    )
