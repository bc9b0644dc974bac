"""The functions a threaded combinator hands to JAX, and their reuse across calls.

JAX caches a body's trace (and, eagerly, its compiled code) on the identity of the
function it receives, so a combinator that wraps the user's function anew on every call
traces and compiles again. A source opts into reuse with ``StateSource.reuse_key()``, a
hashable summary of what the wrappers read besides their arguments (None: fresh wrappers
per call). Calls with an equal key, combinator and user functions get the same wrappers
and the same ``Threaded`` (on a cache hit nothing is traced, and ``finish`` replays its
recorded names), bound to this call's source only while the call runs, per Python thread.

Branches are traced each on its own: with a source without naming state, each branch's
wrapper is reused on its own, as JAX reuses each branch; with naming state, per set of
functions, since a branch's names depend on the branches traced before it.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, TypeVar

from jaxoverride.adapter_kit._cache import Getter, WrapperCache
from jaxoverride.adapter_kit._solve_policy import participant
from jaxoverride.adapter_kit._state_source import StateSource

T = TypeVar("T")

Run = Callable[..., Any]
"""``run(functions, *args)``: a wrapper's body, given the user's functions resolved."""


class Handed:
    """A function handed to JAX: ``run(functions, *args)``, the functions held by getters.

    It exposes the named user function as ``__wrapped__`` (weakly, when cached), so that
    JAX names and locates the user's function in its errors and debug info.
    """

    def __init__(self, getters: Sequence[Getter], named: int, run: Run):
        self._getters = tuple(getters)
        self._named = named
        self._run = run
        function = getters[named]()
        for attribute in ("__module__", "__name__", "__qualname__", "__doc__"):
            value = getattr(function, attribute, None)
            if value is not None:
                self.__dict__[attribute] = value

    @property
    def __wrapped__(self) -> Any:
        return self._getters[self._named]()

    def __call__(self, *args: Any) -> Any:
        return self._run(tuple(get() for get in self._getters), *args)


class HandedCall:
    """The wrappers of one call situation, the ``Threaded`` they share, a ``variant``
    the combinator may record (which form of ``while_loop`` worked) and ``traces``, what
    it traced outside JAX's caches (a ``while_loop``'s first test, by argument types)."""

    __slots__ = ("functions", "thread", "traces", "variant")

    def __init__(self, thread: Any, functions: list[Callable[..., Any]]):
        self.thread = thread
        self.functions = functions
        self.variant: Any = None
        self.traces: dict[Any, Any] = {}


# The one cache of what is handed to JAX (``HandedCall``s, ``_Separate`` wrappers) and of
# what adapters keep next to it (``kept``). A function's entries share one table, and so
# are dropped together: a record never outlives less than the wrappers it describes.
_CACHE: WrapperCache[Any] = WrapperCache(limit=32)


class _Current:
    """Stands for the ``Threaded`` of the call that last took a separately reused wrapper."""

    __slots__ = ("thread",)

    def __init__(self) -> None:
        self.thread: Any = None

    def run(self, *args: Any) -> Any:
        return self.thread.run(*args)


class _Separate:
    """A wrapper reused on its own (see the module docstring) and its ``_Current``."""

    __slots__ = ("current", "function")

    def __init__(self, current: _Current, function: Callable[..., Any]):
        self.current = current
        self.function = function


def kept(functions: Sequence[Any], key: Hashable, make: Callable[[], T]) -> T:
    """What an adapter keeps next to the functions it hands to the kit's combinators.

    A reused wrapper's trace does not run again, so what a trace found out (which state
    it wrote, which modules it touched) must outlive the call, next to the functions
    (``ScopedStateSource``). It lives in the cache of the wrappers themselves, held by
    the functions weakly; entries under one first function are dropped together, so a
    record lives at least as long as the wrappers of ``functions[0]``.

    Args:
      functions: the user's functions (the first one is the weak key, as for the
        wrappers: pass a call's functions in the order the combinator takes them).
      key: what else the record depends on (the kind of call, the state's layout).
      make: builds the record, the first time.

    Returns:
      The record: the same object while the functions live and the key is equal.

    Example:
      >>> from jaxoverride.adapter_kit import kept
      >>> def body(x):
      ...     return x
      >>> kept((body,), "scan", set) is kept((body,), "scan", set)
      True
    """
    return _CACHE.get(functions, ("kept", key), lambda getters: make())


def _none() -> None:
    return None


def wraps(fun: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``functools.wraps(fun)``, or no wrapping where ``fun`` cannot be wrapped.

    Args:
      fun: the user's function.

    Returns:
      A decorator that copies ``fun``'s name, docstring and ``__wrapped__``.

    Example:
      >>> from jaxoverride.adapter_kit import wraps
      >>> def f(x):
      ...     return x
      >>> wraps(f)(lambda x: x).__name__
      'f'
    """
    try:
        return functools.wraps(fun)
    except (AttributeError, TypeError):  # pragma: no cover - exotic callables
        return lambda f: f


def _fresh(functions: Sequence[Any], named: int, run: Run) -> Callable[..., Any]:
    return wraps(functions[named])(lambda *args: run(functions, *args))


@contextlib.contextmanager
def handed_call(
    source: StateSource,
    where: str,
    functions: Sequence[Any],
    count: int,
    runs: Callable[[Any], Sequence[tuple[int, Run]]],
    make_thread: Callable[[Any, int, str], Any],
    separately: bool = False,
) -> Iterator[HandedCall]:
    """The wrappers of ``functions`` for this call: reused where ``source`` allows it.

    A context: reused wrappers are bound to ``source`` (and to this call's ``Threaded``)
    within it, and given back their earlier binding after it, so that the cache keeps
    no source past its call (an NNX source holds the traced values of an enclosing
    trace) and a nested call with an equal key leaves the outer call's binding as it was.

    Args:
      source: the ``StateSource``; its ``reuse_key()`` decides reuse.
      where: the neutral name (errors, and part of the reuse key).
      functions: the user's distinct functions the wrappers call.
      count: how many functions the JAX call traces (the ``Threaded``'s count).
      runs: ``runs(thread)``, one ``(named, run)`` per wrapper: ``run(functions, *args)``
        is its body, ``functions[named]`` the function it is named after.
      make_thread: ``make_thread(source, count, where)``, the ``Threaded``.
      separately: whether wrapper ``i`` calls only ``functions[i]`` (branches): then,
        with a source without naming state, each wrapper is reused on its own.

    Yields:
      The wrappers and their ``Threaded``.
    """
    situation: Hashable = source.reuse_key()
    if situation is not None and participant(source) is not None:
        # Under ``solve_state`` the wrappers close over the entry snapshot: a reused one
        # traced under an earlier snapshot would be stale.
        situation = None
    if situation is not None:
        # A reused wrapper is bound to one call's source while that call runs: two
        # threads running one body at once must not share that binding.
        situation = (situation, threading.get_ident())

    def build(getters: Sequence[Getter] | None) -> HandedCall:
        thread = make_thread(source, count, where)
        if getters is None:
            handed = [_fresh(functions, named, run) for named, run in runs(thread)]
        else:
            handed = [Handed(getters, named, run) for named, run in runs(thread)]
        return HandedCall(thread, handed)

    if situation is None:
        yield build(None)
    elif separately and source.names() is None:
        thread = make_thread(source, count, where)
        entries = _separately(where, functions, runs, situation)
        earlier = [entry.current.thread for entry in entries]
        for entry in entries:
            entry.current.thread = thread
        try:
            yield HandedCall(thread, [entry.function for entry in entries])
        finally:
            for entry, bound in zip(entries, earlier, strict=True):
                entry.current.thread = bound
    else:
        built: list[HandedCall] = []
        handed = _CACHE.get(functions, (where, count, situation), lambda g: _kept(built, build(g)))
        # Freshly built, the thread has no earlier binding to go back to.
        earlier_source = None if built else handed.thread.source
        handed.thread.source = source
        try:
            yield handed
        finally:
            handed.thread.source = earlier_source


def _kept(built: list[HandedCall], handed: HandedCall) -> HandedCall:
    built.append(handed)
    return handed


def _separately(
    where: str,
    functions: Sequence[Any],
    runs: Callable[[Any], Sequence[tuple[int, Run]]],
    situation: Hashable,
) -> list[_Separate]:
    """The wrappers reused one function at a time, each with its ``_Current``."""
    entries = []
    for position, fun in enumerate(functions):

        def build(getters: Sequence[Getter], position: int = position) -> _Separate:
            current = _Current()
            named, run = runs(current)[position]
            resolved: list[Getter] = [_none] * len(functions)
            resolved[named] = getters[0]
            return _Separate(current, Handed(resolved, named, run))

        entries.append(_CACHE.get((fun,), ("separate", where, position, situation), build))
    return entries
