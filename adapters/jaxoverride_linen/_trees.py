"""Linen's nested variable and rng-counter dicts, read and restored in place.

A child scope caches the dict its parent holds for it (variables and ``rng_counters``).
Restoring variables removes what was added since, so caches of removed dicts are dropped
(``evict_stale_caches``); rng counters are not outputs: their dicts stay, counts back at 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
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
    """Removes the leaf at ``path``, and the dicts above it that it leaves empty."""
    parents = []
    for key in path[:-1]:
        parents.append((tree, key))
        tree = tree[key]
    del tree[path[-1]]
    for parent, key in reversed(parents):
        if parent[key]:
            break
        del parent[key]


def _reset(tree: dict[Any, Any], fresh: Any) -> None:
    for key, value in tree.items():
        if isinstance(value, dict):
            _reset(value, fresh)
        else:
            tree[key] = fresh


def restore(live: dict[Any, Any], saved: Mapping[Any, Any], fresh: Any = MISSING) -> None:
    """Makes ``live`` equal ``saved`` again, in place, keeping the dicts both have.

    What was added since is removed; with ``fresh`` (an rng counter's 0), its dicts are
    kept instead, every leaf in them set to ``fresh``.
    """
    for key in list(live):
        if key not in saved:
            if fresh is not MISSING and isinstance(live[key], dict):
                _reset(live[key], fresh)
            else:
                del live[key]
    for key, value in saved.items():
        if isinstance(value, dict):
            if not isinstance(live.get(key), dict):
                live[key] = {}
            restore(live[key], value, fresh)
        else:
            live[key] = value


def evict_stale_caches(scopes: Iterable[Any], variables: dict[Any, Any]) -> None:
    """Drops each child scope's cached collection dict that ``variables`` (its root's) no
    longer holds at the scope's path: the scope then looks it up again, as Linen does the
    first time."""
    for scope in scopes:
        if scope.parent is None or scope.root._variables is not variables:
            continue
        cached = scope._variables
        for col in [
            c for c, tree in cached.items() if get_path(variables, (c, *scope.path)) is not tree
        ]:
            del cached[col]


def stream_at(live: Mapping[Any, Any], saved: Mapping[Any, Any], name: str) -> bool:
    """Whether rng stream ``name``'s counts in ``live`` (a scope's ``rng_counters``) are
    ``saved``'s (0 in a dict that ``saved`` lacks: a child scope first reached since)."""
    for key, value in live.items():
        if isinstance(value, dict):
            below = saved.get(key)
            if not stream_at(value, below if isinstance(below, dict) else {}, name):
                return False
        elif key == name and value != saved.get(name, 0):
            return False
    return True


def restore_stream(live: dict[Any, Any], saved: Mapping[Any, Any], name: str) -> None:
    """Puts rng stream ``name``'s counts in ``live`` back to ``saved``'s, in place (0 in a
    dict that ``saved`` lacks: a child scope first reached since); other streams stay."""
    for key, value in live.items():
        if isinstance(value, dict):
            below = saved.get(key)
            restore_stream(value, below if isinstance(below, dict) else {}, name)
        elif key == name:
            live[key] = saved.get(name, 0)
