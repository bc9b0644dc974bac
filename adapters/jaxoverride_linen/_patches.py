"""Linen's ``Scope`` methods patched while the adapter is in use, and only then.

``make_rng``, ``variable``, ``put_variable`` and ``get_variable`` get the wrappers when the
first user (``context()`` or ``install()``) arrives; Flax's own methods come back when the
last one leaves. Contexts of all threads share one count.
"""

from __future__ import annotations

import threading
from typing import Any

from flax.core import scope as core_scope

from jaxoverride_linen import _guards, _source

Scope = core_scope.Scope
NAMES = ("make_rng", "variable", "put_variable", "get_variable")

_lock = threading.Lock()
_users = 0
_saved: dict[str, Any] = {}
_ours: dict[str, Any] = {}


def _wrappers(original: dict[str, Any]) -> dict[str, Any]:
    # The guards run first: a refused write or draw never reaches the threading.
    return {
        "make_rng": _guards.guard_make_rng(_source.wrap_make_rng(original["make_rng"])),
        "variable": _source.wrap_variable(original["variable"]),
        "put_variable": _guards.guard_put_variable(
            _source.wrap_put_variable(original["put_variable"])
        ),
        "get_variable": _guards.guard_get_variable(original["get_variable"]),
    }


def acquire() -> None:
    """One more user: the wrappers go on ``Scope`` with the first."""
    global _users
    with _lock:
        if _users == 0:
            _saved.clear()
            _saved.update({name: Scope.__dict__[name] for name in NAMES})
            _ours.clear()
            _ours.update(_wrappers(_saved))
            for name, wrapper in _ours.items():
                setattr(Scope, name, wrapper)
            _source._in_use.append(True)
        _users += 1


def release() -> None:
    """One user fewer: with the last, ``Scope`` gets back the methods found there."""
    global _users
    with _lock:
        if _users == 0:
            return
        _users -= 1
        if _users:
            return
        for name in NAMES:
            # A later patch by someone else stays; it then calls ours, which calls Flax's.
            if Scope.__dict__.get(name) is _ours.get(name):
                setattr(Scope, name, _saved[name])
        _ours.clear()
        _saved.clear()
        _source._in_use.clear()
