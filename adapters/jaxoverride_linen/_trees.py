"""Linen's nested variable and rng-counter dicts, read and restored in place.

A child scope caches the dict its parent holds for it (``Scope._variables[col]``, and
its ``rng_counters``) the first time it reaches a collection, and keeps using that object.
So a dict that exists is never removed or replaced here: restoring an earlier state
empties the dicts made since, but keeps them where they are, and a scope that cached one
keeps writing where the root sees it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

MISSING: Any = object()


def copy_dicts(tree: Any) -> Any:
    """A copy of the nested dicts; leaves (a ``FrozenDict`` too) shared."""
    if isinstance(tree, dict):
        return {key: copy_dicts(value) for key, value in tree.items()}
    return tree


def paths(tree: Mapping[Any, Any], prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, Any]]:
    """``(path, leaf)`` for every leaf under the nested dicts (an empty dict holds none)."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from paths(value, (*prefix, key))
        else:
            yield (*prefix, key), value


def get_path(tree: Any, path: tuple[Any, ...], default: Any = MISSING) -> Any:
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return default
        tree = tree[key]
    return tree


def put_path(tree: dict[Any, Any], path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def delete_path(tree: dict[Any, Any], path: tuple[Any, ...]) -> None:
    """Removes the leaf at ``path``; the dicts above it stay (see the module docstring)."""
    parent = get_path(tree, path[:-1])
    if isinstance(parent, dict):
        parent.pop(path[-1], None)


def clear(tree: dict[Any, Any], fresh: Any = MISSING) -> None:
    """Empties ``tree`` of leaves, keeping its dicts: each leaf is removed, or set to
    ``fresh`` if given (an rng counter starts again at 0)."""
    for key in list(tree):
        value = tree[key]
        if isinstance(value, dict):
            clear(value, fresh)
        elif fresh is MISSING:
            del tree[key]
        else:
            tree[key] = fresh


def restore(live: dict[Any, Any], saved: Mapping[Any, Any], fresh: Any = MISSING) -> None:
    """Makes ``live`` hold ``saved``'s leaves again, in place: what was added since is
    cleared (``clear``), and no dict object that ``live`` holds is removed or replaced."""
    for key in list(live):
        if key not in saved:
            if isinstance(live[key], dict):
                clear(live[key], fresh)
            else:
                del live[key]
    for key, value in saved.items():
        if isinstance(value, dict):
            if not isinstance(live.get(key), dict):
                live[key] = {}
            restore(live[key], value, fresh)
        else:
            live[key] = value
