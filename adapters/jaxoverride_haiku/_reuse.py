"""The functions handed to JAX by the control-flow overrides, reused across calls.

JAX caches a loop's or a branch's trace (and, eagerly, its compiled code) on the
identity of the function it is given. A wrapper made afresh per call defeats that: an
eager ``jlax.fori_loop`` inside ``apply`` would compile again, and keep the memory, on
every call. So the wrappers of one user function are kept, per *situation*: the kind of
call, the naming state of the frame (module stack, counters, names in use), init or
apply, and the active custom creators, getters, setters and interceptors. Everything a
wrapper reads from Haiku's frame that JAX does not see as an argument is in that key;
params are carried as arguments (see ``loop_state``), never closed over.

The table holds the user's functions weakly and at most ``_PER_FUNCTION`` situations of
each: a body made afresh per call (a lambda) gets fresh wrappers, as it would get a
fresh trace from JAX, and nothing of it is kept.
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from jaxoverride_haiku._frames import Threaded, current_frame, naming_signature
from jaxoverride_haiku._jit import customisations

_PER_FUNCTION = 32
Getter = Callable[[], Any]


class Handed:
    """A function handed to JAX in place of a user's: ``run(user_function, *args)``.

    It refers to the user's function through ``get`` (a weak reference when cached), and
    exposes it as ``__wrapped__`` so that JAX names and locates the user's function in
    its errors and debug info.
    """

    def __init__(self, get: Getter, run: Callable[..., Any]):
        self._get = get
        self._run = run
        function = get()
        for attribute in ("__module__", "__name__", "__qualname__", "__doc__"):
            value = getattr(function, attribute, None)
            if value is not None:
                self.__dict__[attribute] = value

    @property
    def __wrapped__(self) -> Any:
        return self._get()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._run(self._get(), *args, **kwargs)


class Wrappers:
    """The wrappers of one call situation, the ``Threaded`` naming they share, and a
    ``variant`` a caller may record (which form of ``while_loop`` worked)."""

    __slots__ = ("__weakref__", "functions", "refs", "thread", "variant")

    def __init__(self, thread: Threaded, functions: list[Handed], refs: Sequence[Getter]):
        self.thread = thread
        self.functions = functions
        self.refs = refs
        self.variant: Any = None


Build = Callable[[Threaded, Sequence[Getter]], list[Handed]]

_table: weakref.WeakKeyDictionary[Any, collections.OrderedDict[Hashable, Wrappers]] = (
    weakref.WeakKeyDictionary()
)
_lock = threading.Lock()


def fresh(
    where: str, functions: Sequence[Any], build: Build, count: int | None = None, **options: Any
) -> Wrappers:
    """Wrappers for one call only (nothing kept); ``count`` traced functions (default:
    one per user function), ``options`` for ``Threaded``."""
    refs = [(lambda f=f: f) for f in functions]
    thread = Threaded(len(functions) if count is None else count, where, **options)
    return Wrappers(thread, build(thread, refs), refs)


def reused(
    where: str, functions: Sequence[Any], build: Build, count: int | None = None
) -> Wrappers:
    """The wrappers of ``functions`` for the situation here, built once per situation.

    Args:
      where: the neutral name, for errors; also part of the key.
      functions: the user's distinct functions (a body; a cond and a body; branches).
      build: makes the wrappers from a ``Threaded`` and a getter per function.
      count: how many functions JAX traces in order (default: one per user function).

    Returns:
      Cached wrappers, or fresh ones if a function cannot be weakly referenced.
    """
    try:
        refs = [weakref.ref(f) for f in functions]
        with _lock:
            situations = _table.get(functions[0])
            if situations is None:
                situations = _table[functions[0]] = collections.OrderedDict()
    except TypeError:  # not weakly referenceable: fresh wrappers, as JAX would trace anew
        return fresh(where, functions, build, count)
    frame = current_frame()
    key = (
        where,
        count,
        tuple(id(f) for f in functions),
        frame.freeze_params,
        naming_signature(frame),
        customisations(),
    )
    with _lock:
        entry = situations.get(key)
        if entry is not None and all(r() is f for r, f in zip(entry.refs, functions, strict=True)):
            situations.move_to_end(key)
            return entry
    thread = Threaded(len(functions) if count is None else count, where)
    entry = Wrappers(thread, build(thread, refs), refs)
    with _lock:
        situations[key] = entry
        while len(situations) > _PER_FUNCTION:
            situations.popitem(last=False)
    return entry
