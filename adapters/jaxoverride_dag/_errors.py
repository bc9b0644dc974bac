"""Errors that name the path of what went wrong, and how to describe a path."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from jax import tree_util as jtu

from jaxoverride import errors
from jaxoverride_dag._kinds import ARRAY, IDENTITYLESS, NODE, STATIC, kind_of_node


class _Described(Protocol):
    """What these messages read of a plan (``_plan.Plan``, which imports this module)."""

    n_dyn: int
    statics: tuple[Any, ...]
    label: str
    style: str

    def decode(self, dyn: Sequence[Any], statics: Sequence[Any] | None = None) -> Any: ...


class SharingError(errors.SharingError):
    """A sharing pattern that a transform cannot honour.

    The DAG case of ``jaxoverride.errors.SharingError``.

    Raised when a loop body changes which nodes its carry shares (or its static data), when
    branches share nodes differently, or when one shared array gets two mapped axes (array
    sharing that differs is de-shared, with no error). The message names the path and fix.

    Example:
      >>> import jax.numpy as jnp, jaxoverride as jo, jaxoverride_dag as dag
      >>> node = {"w": jnp.ones(2)}  # one node, mapped two ways: its identity would be lost
      >>> with dag.context():
      ...     try:
      ...         jo.vmap(lambda a, b: a["w"] + b["w"], in_axes=(0, None))(node, node)
      ...     except dag.SharingError as error:
      ...         print(str(error)[:57])
      jaxoverride_dag.vmap: one array is shared by args[0]['w']
    """


def format_path(path: tuple[Any, ...], style: str, label: str) -> str:
    """``args[0]['w']`` for a call's ``(args, kwargs)`` pair, ``carry[1].x`` otherwise."""
    if style == "call" and path:
        head, rest = path[0], path[1:]
        return ("args" if getattr(head, "idx", None) == 0 else "kwargs") + jtu.keystr(rest)
    return label + jtu.keystr(path)


class _Probe:
    __slots__ = ()

    def __repr__(self) -> str:
        return "<probe>"


def paths_of_slots(plan: _Described, dyn_marks: list[Any], static_marks: list[Any]) -> list[tuple]:
    """``(path, leaf)`` for every position of ``plan`` decoded with the given leaves."""
    tree = plan.decode(dyn_marks, static_marks)
    return jtu.tree_flatten_with_path(tree)[0]


def unhashable_static(plan: _Described, error: TypeError) -> TypeError:
    """The error for a plan that cannot key the cache; it names the culprit's path."""
    bad = None
    for index, value in enumerate(plan.statics):
        try:
            hash(value)
        except TypeError:
            bad = index
            break
    if bad is None:
        return TypeError(
            f"jaxoverride_dag: the {plan.label} cannot key the compile cache: {error}. A "
            "pytree node's auxiliary data (what its flatten function returns besides the "
            "children) must be hashable, as jax.jit requires too. Fix: return a tuple or a "
            "frozen object as auxiliary data."
        )
    value = plan.statics[bad]
    probe = _Probe()
    statics: list[Any] = list(plan.statics)
    statics[bad] = probe
    where = "?"
    for path, leaf in paths_of_slots(plan, [None] * plan.n_dyn, statics):
        if leaf is probe:
            where = format_path(path, plan.style, plan.label)
            break
    text = repr(value)
    text = text if len(text) <= 80 else text[:77] + "..."
    return TypeError(
        f"jaxoverride_dag: the non-array leaf at {where} ({plan.label}) is unhashable: "
        f"{type(value).__name__} {text}. Non-array leaves are static data and are part of the "
        "compile cache key, so they must be hashable. Fix: make its class hashable (define "
        "__hash__ with __eq__, or use a frozen dataclass), register the class as a pytree node "
        "so that the arrays inside are traced, or pass the data as an array."
    )


def _signature(tree: Any, arrays: bool = True) -> list[tuple[tuple[Any, ...], tuple[str, Any]]]:
    """The expanded tree in preorder: for each position, what is there and what it shares.

    With ``arrays=False`` the sharing of array leaves is left out (where it may differ).
    """
    out: list[tuple[tuple[Any, ...], tuple[str, Any]]] = []
    first: dict[int, tuple[Any, ...]] = {}

    def walk(x: Any, path: tuple[Any, ...]) -> None:
        k = kind_of_node(x)
        if k > ARRAY or (k == ARRAY and arrays):
            earlier = first.get(id(x))
            if earlier is not None:
                out.append((path, ("shared", earlier)))
                return
            first[id(x)] = path
        if k in (NODE, IDENTITYLESS):
            one_level = jtu.tree_structure(x, is_leaf=lambda y: y is not x)
            out.append((path, ("node", one_level)))
            for key_path, child in jtu.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)[0]:
                walk(child, path + key_path)
        elif k == STATIC:
            out.append((path, ("static", x)))
        else:
            out.append((path, ("traced", None)))

    walk(tree, ())
    return out


def _same(a: tuple[str, Any], b: tuple[str, Any]) -> bool:
    if a[0] != b[0]:
        return False
    if a[0] == "static":
        try:
            return a[1] is b[1] or bool(a[1] == b[1])
        except Exception:
            return False
    return a[1] == b[1]


def _describe(entry: tuple[str, Any] | None, style: str, label: str) -> str:
    if entry is None:
        return "nothing"
    what, value = entry
    if what == "shared":
        return f"the same object as at {format_path(value, style, label)}"
    if what == "node":
        return f"a node of structure {value} (not shared with an earlier position)"
    if what == "static":
        text = repr(value)
        return f"the static value {text if len(text) <= 60 else text[:57] + '...'}"
    return "an array (not shared with an earlier position)"


def pattern_mismatch(
    api: str,
    what: str,
    before: Any,
    after: Any,
    *,
    style: str = "tree",
    label: str = "",
    before_name: str,
    after_name: str,
    fix: str,
    arrays: bool = True,
) -> SharingError:
    """The error for two trees that should have the same sharing pattern and do not.

    With ``arrays=False`` only nodes and static leaves are compared: the sharing of array
    leaves may differ.
    """
    label = label or what
    a, b = _signature(before, arrays), _signature(after, arrays)
    for index in range(max(len(a), len(b))):
        left = a[index] if index < len(a) else None
        right = b[index] if index < len(b) else None
        if left is None or right is None or left[0] != right[0] or not _same(left[1], right[1]):
            path = (left or right or ((), None))[0]
            where = format_path(path, style, label)
            return SharingError(
                f"jaxoverride_dag.{api}: the sharing pattern of the {what} must be the same in "
                f"{before_name} and {after_name}, but at {where} {before_name} has "
                f"{_describe(left and left[1], style, label)} while {after_name} has "
                f"{_describe(right and right[1], style, label)}. {fix}"
            )
    return SharingError(
        f"jaxoverride_dag.{api}: the {what} of {before_name} and {after_name} differ in their "
        f"static data or structure. {fix}"
    )
