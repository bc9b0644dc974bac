"""What a function, or a static argument, reaches by reference: NNX modules and Variables.

Used for which tracked modules a traced function is first given (``_touched.referenced``,
a guess) and which NNX state a ``jit`` trace bakes in through its static arguments. A
reference is followed through closure cells, defaults, the globals a function's code
names, bound methods, ``functools.partial``, containers (not counted as a level: Equinox
nests static arguments in tuples) and plain objects' attributes; an NNX graph object is
reported and not entered.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import numpy as np
from jax.core import Tracer

from jaxoverride_nnx._graph import is_graph_object

_DEPTH = 3  # references followed from the start, containers not counted
_LIMIT = 512  # objects visited per search: a bound, not a tuning knob
_ITEMS = 64  # items read per container or object
_OPAQUE = (
    str,
    bytes,
    int,
    float,
    complex,
    type(None),
    type,
    types.ModuleType,
    types.CodeType,
    jax.Array,
    np.ndarray,
    np.generic,
    Tracer,
)


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _function_values(fun: types.FunctionType) -> list[tuple[str | None, Any]]:
    inner: list[tuple[str | None, Any]] = []
    for free, cell in zip(fun.__code__.co_freevars, fun.__closure__ or (), strict=False):
        try:
            inner.append((free, cell.cell_contents))
        except ValueError:  # an empty cell
            pass
    inner += [(None, item) for item in fun.__defaults__ or ()]
    inner += list((fun.__kwdefaults__ or {}).items())
    namespace = fun.__globals__
    for code in _codes(fun.__code__):
        inner += [(name, namespace[name]) for name in code.co_names if name in namespace]
    return inner


def _attributes(obj: Any) -> list[tuple[str | None, Any]]:
    """A plain object's instance attributes, read from its ``__dict__`` (no property,
    no ``__getattr__`` runs)."""
    try:
        namespace = object.__getattribute__(obj, "__dict__")
    except AttributeError:
        return []
    if not isinstance(namespace, dict):
        return []
    return list(namespace.items())[:_ITEMS]


def _inner(obj: Any) -> tuple[list[tuple[str | None, Any]], bool]:
    """``(name, value)`` that ``obj`` refers to (name None: the value goes by ``obj``'s
    name), and whether following them counts as a level (it does not for a container)."""
    if isinstance(obj, (list, tuple)):
        return [(None, item) for item in obj[:_ITEMS]], False
    if isinstance(obj, dict):
        return [(None, item) for item in list(obj.values())[:_ITEMS]], False
    if isinstance(obj, functools.partial):
        inner: list[tuple[str | None, Any]] = [(None, item) for item in (obj.func, *obj.args)]
        return inner + list(obj.keywords.items()), True
    if isinstance(obj, types.MethodType):
        return [(None, obj.__self__), (None, obj.__func__)], True
    if isinstance(obj, types.FunctionType):
        return _function_values(obj), True
    return _attributes(obj), True


def reached(roots: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """``(name, object)`` for each NNX graph object or Variable that ``roots`` refer to.

    Args:
      roots: ``(name, object)`` pairs to start from (functions, arguments).

    Returns:
      An iterator of pairs, each object once, named by the last name followed to it
      (a closure variable's, a global's, an attribute's, a keyword's), else its root's.

    Example:
      >>> from flax import nnx
      >>> from jaxoverride_nnx._reach import reached
      >>> layer = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
      >>> [name for name, _ in reached([("f", lambda x: layer(x))])]
      ['layer']
    """
    pending = [(obj, 0, name) for name, obj in reversed(list(roots))]
    seen: set[int] = set()
    while pending and len(seen) < _LIMIT:
        obj, depth, name = pending.pop()
        if id(obj) in seen or isinstance(obj, _OPAQUE):
            continue
        seen.add(id(obj))
        if is_graph_object(obj):
            yield name, obj
            continue
        if depth >= _DEPTH:
            continue
        inner, counts = _inner(obj)
        step = depth + 1 if counts else depth
        pending += [(item, step, name if key is None else key) for key, item in reversed(inner)]
