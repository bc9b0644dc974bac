"""One wrapper object per user function: JAX caches a body's trace per function object.

An adapter hands JAX a wrapper in place of the user's loop body or branch. If the
wrapper were new on every call, JAX would trace the body again on every call (and an
eager loop would compile again); so the same wrapper must reach JAX for the same user
functions. The cache must not keep those functions alive either: they close over
modules and parameters. Hence weak keys, and wrappers that hold the functions weakly.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, TypeVar

W = TypeVar("W")

Getter = Callable[[], Any]


def _strong(fn: Any) -> Getter:
    return lambda: fn


class WrapperCache(Generic[W]):
    """Wrappers of user functions, one per (functions, key) while the functions live.

    ``get(fns, key, make)`` returns the wrapper that ``make`` built before for the same
    functions (by identity) and an equal ``key``, or builds it now. ``make`` receives one
    getter per function: a weak reference, or, for a function that cannot be weakly
    referenced, a plain closure (such a wrapper is built anew each time and not cached,
    as JAX traces such a function anew). The first function is the weak key; at most
    ``limit`` wrappers are kept per first function.

    Args:
      limit: how many (key, functions) entries one first function keeps before they are
        dropped together (a long run that sees many keys for one body stays bounded).

    Example:
      >>> from jaxoverride.adapter_kit import WrapperCache
      >>> cache = WrapperCache()
      >>> def body(x):
      ...     return x + 1
      >>> make = lambda getters: (lambda x: getters[0]()(x) * 2)
      >>> first = cache.get((body,), "scan", make)
      >>> first is cache.get((body,), "scan", make), first(1)
      (True, 4)
      >>> first is cache.get((body,), "cond", make)
      False
    """

    __slots__ = ("_tables", "limit")

    def __init__(self, limit: int = 64):
        self.limit = limit
        self._tables: weakref.WeakKeyDictionary[Any, dict[Hashable, tuple[tuple[Getter, ...], W]]]
        self._tables = weakref.WeakKeyDictionary()

    def get(self, fns: Sequence[Any], key: Hashable, make: Callable[[tuple[Getter, ...]], W]) -> W:
        """The wrapper of ``fns`` for ``key``: cached, or ``make(getters)`` now.

        Args:
          fns: the user's functions the wrapper calls (at least one).
          key: what else the wrapper depends on (the kind of call, a plan ...); hashable.
          make: builds the wrapper from one getter per function.

        Returns:
          The wrapper.
        """
        try:
            table = self._tables.get(fns[0])
            full_key = (key, tuple(map(id, fns)))
            hash(full_key)
            entry = None if table is None else table.get(full_key)
        except TypeError:  # not weakly referenceable, or an unhashable key: no cache
            return make(tuple(map(_strong, fns)))
        if entry is not None:
            refs, wrapper = entry
            # An id can be reused by a new function once the old one died.
            if all(ref() is fn for ref, fn in zip(refs, fns, strict=True)):
                return wrapper
        try:
            refs = tuple(weakref.ref(fn) for fn in fns)
        except TypeError:
            return make(tuple(map(_strong, fns)))
        if table is None:
            table = self._tables[fns[0]] = {}
        elif len(table) >= self.limit:
            table.clear()
        wrapper = make(refs)
        table[full_key] = (refs, wrapper)
        return wrapper

    def clear(self) -> None:
        """Forgets every wrapper."""
        self._tables.clear()
