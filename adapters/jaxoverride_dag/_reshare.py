"""Plans that differ only in which array leaves they share, and the common plan of both.

A carry initialised as ``(z0, z0)`` whose body returns two different arrays is valid JAX:
arrays are immutable, so the adapter de-shares them. Two plans of the same *form*
(structure, shared nodes, static leaves) differ at most in the grouping of array slots;
their *meet* groups two slots only where both do. Slots are numbered in ``encode``'s order,
so a plan built here equals the one ``encode`` gives a tree with that sharing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxoverride_dag._plan import Plan

_Form = tuple[Any, ...]


def _walk(plan: Plan) -> tuple[_Form, list[int]]:
    """``(form, dyn)``: the plan without its array grouping, and the dyn index per slot."""
    n, n_static = plan.n_dyn, len(plan.statics)
    dyn: list[int] = []
    tags: dict[int, tuple[Any, ...]] = {}  # group -> its tagged slots, in walk order
    order: list[int] = []

    def tag(slots: tuple[int, ...]) -> tuple[Any, ...]:
        out: list[Any] = []
        for slot in slots:
            if slot < n:
                dyn.append(slot)
                out.append(-1)
            elif slot < n + n_static:
                out.append(("s", slot - n))
            else:
                g = slot - n - n_static
                if g not in tags:
                    tags[g] = ()
                    order.append(g)
                    tags[g] = tag(plan.groups[g][1])
                out.append(("g", order.index(g)))
        return tuple(out)

    root = tag(plan.root[1])
    groups = tuple((plan.groups[g][0], tags[g]) for g in order)
    static_key = plan.key[1]
    return (plan.root[0], root, groups, static_key), dyn


def _build(like: Plan, form: _Form, dyn: Sequence[int]) -> Plan:
    """The plan of ``form`` whose dyn slots hold the indices ``dyn`` (in walk order)."""
    root_def, root_tags, groups, _ = form
    n = max(dyn, default=-1) + 1
    base = n + len(like.statics)
    position = 0
    resolved: dict[int, tuple[int, ...]] = {}

    # A group is resolved at its first reference, as ``_walk`` (and ``encode``) met it.
    def walk(tags: tuple[Any, ...]) -> tuple[int, ...]:
        nonlocal position
        out = []
        for item in tags:
            if item == -1:
                out.append(dyn[position])
                position += 1
            elif item[0] == "s":
                out.append(n + item[1])
            else:
                g = item[1]
                if g not in resolved:
                    resolved[g] = ()
                    resolved[g] = walk(groups[g][1])
                out.append(base + g)
        return tuple(out)

    root = (root_def, walk(root_tags))
    skeletons = tuple((groups[g][0], resolved[g]) for g in range(len(groups)))
    return Plan(n, like.statics, root, skeletons, like.label, like.style)


def same_form(a: Plan, b: Plan) -> bool:
    """Whether ``a`` and ``b`` differ at most in which array leaves they share."""
    return a == b or _walk(a)[0] == _walk(b)[0]


def meet(a: Plan, b: Plan) -> Plan:
    """The plan of ``a``'s form that shares an array only where both ``a`` and ``b`` do.

    ``a`` and ``b`` must have the same form (see ``same_form``).
    """
    form, dyn_a = _walk(a)
    _, dyn_b = _walk(b)
    numbers: dict[tuple[int, int], int] = {}
    dyn = [numbers.setdefault(pair, len(numbers)) for pair in zip(dyn_a, dyn_b, strict=True)]
    return _build(a, form, dyn)


def split_by(plan: Plan, labels: Sequence[Any] | None) -> tuple[Plan, list[int]]:
    """The plan of ``plan``'s form that shares an array only where ``labels`` agree too.

    Args:
      plan: the plan to split.
      labels: one hashable label per array position, in the order ``_walk`` meets them
        (a position inside a shared node counts once); ``None`` gives every position an
        array of its own.

    Returns:
      ``(split, numbers)``: the split plan and the traced leaf of ``split`` at each
      position.
    """
    form, dyn = _walk(plan)
    if labels is None:
        numbers = list(range(len(dyn)))
    else:
        seen: dict[tuple[int, Any], int] = {}
        numbers = [seen.setdefault(pair, len(seen)) for pair in zip(dyn, labels, strict=True)]
    return _build(plan, form, numbers), numbers


def refines(fine: Plan, coarse: Plan) -> bool:
    """Whether every array that ``fine`` shares is shared by ``coarse`` too (same form)."""
    _, dyn_fine = _walk(fine)
    _, dyn_coarse = _walk(coarse)
    seen: dict[int, int] = {}
    return all(seen.setdefault(f, c) == c for f, c in zip(dyn_fine, dyn_coarse, strict=True))


def rebase(values: Sequence[Any], source: Plan, target: Plan) -> list[Any]:
    """The traced leaves of ``target`` for a tree that ``values`` give under ``source``.

    ``target`` must refine ``source``: an array that ``source`` shares and ``target`` does
    not is passed once per group of ``target``.
    """
    if source == target:
        return list(values)
    _, dyn_source = _walk(source)
    _, dyn_target = _walk(target)
    out: list[Any] = [None] * target.n_dyn
    for s, t in zip(dyn_source, dyn_target, strict=True):
        out[t] = values[s]
    return out
