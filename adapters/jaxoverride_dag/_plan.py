"""Splitting a pytree with sharing into traced leaves and a hashable plan, and back.

``encode(tree)`` returns ``(plan, dyn)``: ``dyn`` holds each distinct array once (and
each Python scalar), ``plan`` holds everything else: the structure, which positions
share one object, and the static (non-array) leaves. ``plan.decode(dyn)`` builds a
fresh tree, one new object per distinct node of the original, so that positions that
shared an object share one again, and none is the original.

A plan is a *pool program*. The pool is ``[*dyn, *statics, *groups]``; every leaf slot
of a skeleton is an index into it. The root skeleton is the tree with every shared node
cut off as a leaf; each shared node (a *group*) has its own skeleton, cut the same way.
Decoding builds the groups children first, then the root.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

from jax import tree_util as jtu

from jaxoverride_dag import _errors
from jaxoverride_dag._alias import fresh_leaves
from jaxoverride_dag._kinds import ARRAY, KINDS, NODE, SCALAR, kind

Skeleton = tuple[Any, tuple[int, ...]]  # (PyTreeDef, pool index per leaf)


def picker(indices: Sequence[int]) -> Callable[[Sequence[Any]], Sequence[Any]]:
    """A fast callable returning ``tuple(seq[i] for i in indices)``."""
    if not indices:
        return lambda seq: ()
    if len(indices) == 1:
        (index,) = indices
        return lambda seq: (seq[index],)
    return operator.itemgetter(*indices)


def run_picker(indices: Sequence[int]) -> Callable[[Sequence[Any]], Sequence[Any]]:
    """As ``picker``, for the jit hot path: by slices where ``indices`` are one or two runs
    of consecutive positions (a model's traced leaves nearly are; a slice copies them in one
    step). Each picked item gains one reference, as the hot path's counts rely on."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and runs[-1][1] == index:
            runs[-1][1] = index + 1
        else:
            runs.append([index, index + 1])
    if len(runs) == 1:
        return operator.itemgetter(slice(*runs[0]))
    if len(runs) == 2:
        (start, stop), (start2, stop2) = runs
        # ``seq`` is a tuple or a list, which concatenate; ``Sequence`` does not promise it.
        return lambda seq: seq[start:stop] + seq[start2:stop2]  # pyright: ignore[reportOperatorIssue]
    return picker(indices)


class FastInfo:
    """What the jit hot path needs to recognise an unshared tree of this plan cheaply."""

    __slots__ = ("dyn_pick", "flat", "static_pick", "static_values", "treedef")

    def __init__(self, plan: Plan):
        treedef, slots = plan.root
        n = plan.n_dyn
        self.treedef = treedef
        # A call whose positional arguments are its n traced leaves is matched by type alone.
        flat = not plan.statics and treedef == jtu.tree_structure((tuple(range(n)), {}))
        self.flat = n if flat else -1
        dyn_positions = [p for p, slot in enumerate(slots) if slot < n]
        static_positions = [p for p, slot in enumerate(slots) if slot >= n]
        self.dyn_pick = None if not static_positions else run_picker(dyn_positions)
        self.static_pick = picker(static_positions)
        self.static_values = tuple(plan.statics[slots[p] - n] for p in static_positions)


class Plan:
    """The static half of an encoded pytree: structure, sharing pattern and static leaves.

    Plans compare and hash by content, never by object ids, so that a new tree with the
    same pattern finds the caches made for an earlier one.
    """

    __slots__ = (
        "_decode",
        "_hash",
        "groups",
        "key",
        "label",
        "n_dyn",
        "order",
        "root",
        "statics",
        "style",
        "unshared",
    )

    def __init__(
        self,
        n_dyn: int,
        statics: tuple[Any, ...],
        root: Skeleton,
        groups: tuple[Skeleton, ...],
        label: str,
        style: str,
    ):
        self.n_dyn = n_dyn
        self.statics = statics
        self.root = root
        self.groups = groups
        self.label = label
        self.style = style
        static_key = tuple((type(value), value) for value in statics)
        self.key = (n_dyn, static_key, root, groups)
        self._hash: int | None = None
        self._decode: Callable[[Sequence[Any], Sequence[Any]], Any] | None = None
        self.order = _children_first(groups, n_dyn + len(statics))
        slots = root[1]
        self.unshared = not groups and [s for s in slots if s < n_dyn] == list(range(n_dyn))

    def __hash__(self) -> int:
        if self._hash is None:
            try:
                self._hash = hash(self.key)
            except TypeError as error:
                raise _errors.unhashable_static(self, error) from None
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, Plan) and self.key == other.key)

    def __repr__(self) -> str:
        return (
            f"<Plan {self.label}: {self.n_dyn} traced leaves, {len(self.statics)} static, "
            f"{len(self.groups)} shared nodes>"
        )

    def decode(self, dyn: Sequence[Any], statics: Sequence[Any] | None = None) -> Any:
        """A fresh tree with ``dyn`` as its traced leaves (and ``statics`` as its static ones)."""
        decode = self._decode
        if decode is None:
            decode = self._decode = self._compile()
        return decode(dyn, self.statics if statics is None else statics)

    def decode_inside(self, dyn: Sequence[Any], statics: Sequence[Any] | None = None) -> Any:
        """``decode`` for the inside of a transformed function: any concrete array that
        JAX passed through untraced becomes a fresh alias, so that nothing inside is the
        caller's object (inside a trace every leaf is a tracer and this adds nothing)."""
        return self.decode(fresh_leaves(dyn), statics)

    def _compile(self) -> Callable[[Sequence[Any], Sequence[Any]], Any]:
        treedef, slots = self.root
        unflatten = treedef.unflatten
        n = self.n_dyn
        if not self.groups:
            if not self.statics and slots == tuple(range(n)):
                return lambda dyn, statics: unflatten(dyn)
            pick = picker(slots)
            return lambda dyn, statics: unflatten(pick((*dyn, *statics)))
        base = n + len(self.statics)
        steps = [
            (base + g, self.groups[g][0].unflatten, picker(self.groups[g][1])) for g in self.order
        ]
        root_pick = picker(slots)
        padding = [None] * len(self.groups)

        def decode(dyn: Sequence[Any], statics: Sequence[Any]) -> Any:
            pool = [*dyn, *statics, *padding]
            for at, group_unflatten, pick in steps:
                pool[at] = group_unflatten(pick(pool))
            return unflatten(root_pick(pool))

        return decode

    def fast_info(self, skip: int) -> FastInfo | None:
        """Hot-path data if every tree of this plan's structure is recognisable cheaply.

        That holds when the plan shares nothing and every node below depth ``skip`` (the
        levels the caller builds itself, such as the ``(args, kwargs)`` pair) has a traced
        leaf: then distinct ids of the traced leaves prove that nothing is shared.
        """
        if not self.unshared or not _witnessed(self.root[0], self.root[1], self.n_dyn, skip):
            return None
        return FastInfo(self)


def _children_first(groups: tuple[Skeleton, ...], base: int) -> tuple[int, ...]:
    order: list[int] = []
    done: set[int] = set()

    def visit(g: int) -> None:
        if g in done:
            return
        done.add(g)
        for slot in groups[g][1]:
            if slot >= base:
                visit(slot - base)
        order.append(g)

    for g in range(len(groups)):
        visit(g)
    return tuple(order)


def _identity_free(treedef: Any) -> bool:
    node_type = treedef.node_data()[0]
    return node_type is type(None) or (
        issubclass(node_type, tuple) and treedef.num_leaves == 0 and not treedef.children()
    )


def _witnessed(treedef: Any, slots: tuple[int, ...], n_dyn: int, skip: int) -> bool:
    position = 0

    def walk(node: Any, depth: int) -> tuple[bool, bool]:
        nonlocal position
        if node.num_nodes == 1 and node.num_leaves == 1:
            dynamic = slots[position] < n_dyn
            position += 1
            return True, dynamic
        ok, has_dynamic = True, False
        for child in node.children():
            child_ok, child_dynamic = walk(child, depth + 1)
            ok = ok and child_ok
            has_dynamic = has_dynamic or child_dynamic
        if depth >= skip and not has_dynamic and not _identity_free(node):
            ok = False
        return ok, has_dynamic

    return walk(treedef, 0)[0]


def encode(tree: Any, label: str, style: str = "tree") -> tuple[Plan, list[Any]]:
    """Splits ``tree`` into ``(plan, dyn)``; see the module docstring.

    Args:
      tree: any pytree; nodes and arrays may appear more than once.
      label: how errors name the tree, such as ``"arguments"`` or ``"carry"``.
      style: ``"call"`` if ``tree`` is an ``(args, kwargs)`` pair, for error paths.

    Returns:
      The plan and the list of traced leaves: each distinct array once, in order of
      first appearance, and every Python scalar.
    """
    seen: dict[int, Any] = {}
    shared: set[int] = set()

    def visit(x: Any) -> bool:
        k = KINDS.get(type(x))
        if k is None:
            k = kind(x)
        if k >= ARRAY:
            if k == NODE and isinstance(x, tuple) and not x:
                return False
            i = id(x)
            if i in seen:
                shared.add(i)
                return True
            seen[i] = x  # keeps it alive, so that no temporary can reuse its id
        return False

    leaves, treedef = jtu.tree_flatten(tree, is_leaf=visit)
    dyn: list[Any] = []
    statics: list[Any] = []
    if not shared:
        slots = []
        for leaf in leaves:
            k = KINDS.get(type(leaf))
            if k in (ARRAY, SCALAR):
                slots.append(len(dyn))
                dyn.append(leaf)
            else:
                slots.append(~len(statics))
                statics.append(leaf)
        n = len(dyn)
        root = (treedef, tuple(s if s >= 0 else n + ~s for s in slots))
        return Plan(n, tuple(statics), root, (), label, style), dyn
    return _encode_shared(tree, shared, seen, label, style)


def _encode_shared(
    tree: Any, shared: set[int], seen: dict[int, Any], label: str, style: str
) -> tuple[Plan, list[Any]]:
    # ``seen`` is passed to keep every tracked object alive while ids are compared.
    dyn: list[Any] = []
    statics: list[Any] = []
    dyn_of: dict[int, int] = {}
    group_of: dict[int, int] = {}
    groups: list[Any] = []

    # Slots are tagged while the counts are unknown: ("d", i), ("s", k) or ("g", g).
    def slots_of(leaves: list[Any]) -> list[tuple[str, int]]:
        out = []
        for leaf in leaves:
            i = id(leaf)
            k = kind(leaf)
            if i in shared and k == NODE:
                g = group_of.get(i)
                if g is None:
                    g = group_of[i] = len(groups)
                    groups.append(None)
                    sub_leaves, sub_def = jtu.tree_flatten(
                        leaf, is_leaf=lambda x, top=leaf: x is not top and id(x) in shared
                    )
                    groups[g] = (sub_def, slots_of(sub_leaves))
                out.append(("g", g))
            elif k in (ARRAY, SCALAR):
                d = dyn_of.get(i) if k == ARRAY else None
                if d is None:
                    d = len(dyn)
                    dyn.append(leaf)
                    if k == ARRAY:
                        dyn_of[i] = d
                out.append(("d", d))
            else:
                out.append(("s", len(statics)))
                statics.append(leaf)
        return out

    leaves, treedef = jtu.tree_flatten(tree, is_leaf=lambda x: id(x) in shared)
    root_tagged = slots_of(leaves)
    n, s = len(dyn), len(statics)
    offsets = {"d": 0, "s": n, "g": n + s}

    def resolve(tagged: list[tuple[str, int]]) -> tuple[int, ...]:
        return tuple(offsets[tag] + index for tag, index in tagged)

    root = (treedef, resolve(root_tagged))
    group_skeletons = tuple((sub_def, resolve(tagged)) for sub_def, tagged in groups)
    return Plan(n, tuple(statics), root, group_skeletons, label, style), dyn
