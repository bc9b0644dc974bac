"""The functions a threaded combinator hands to JAX, and their reuse across calls.

JAX caches a loop body's or a branch's trace (and, eagerly, its compiled code) on the
identity of the function it receives. A combinator that wraps the user's function anew
on every call makes an identical eager call trace and compile again. A state source
that can say when two calls are in the same *situation* (everything the wrappers read
that JAX does not see as an argument) opts into reuse with an optional hook:

* ``reuse_key()``: a hashable summary of that situation, or None for wrappers built
  for this call only. Calls with an equal key, the same combinator and the same user
  functions receive the same wrappers, and the same ``Threaded`` (its recorded naming
  states included: on a cache hit nothing is traced, and ``finish`` replays them).

Sources without the hook get fresh wrappers, exactly as before the hook existed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from jaxoverride.adapter_kit._cache import Getter, WrapperCache

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
    """The wrappers of one call situation, the ``Threaded`` they share, and a ``variant``
    the combinator may record (which form of ``while_loop`` worked)."""

    __slots__ = ("functions", "thread", "variant")

    def __init__(self, thread: Any, functions: list[Callable[..., Any]]):
        self.thread = thread
        self.functions = functions
        self.variant: Any = None


_CACHE: WrapperCache[HandedCall] = WrapperCache(limit=32)


def _fresh(functions: Sequence[Any], named: int, run: Run) -> Callable[..., Any]:
    fun = functions[named]

    def handed(*args: Any) -> Any:
        return run(functions, *args)

    try:
        return functools.wraps(fun)(handed)
    except (AttributeError, TypeError):  # pragma: no cover - exotic callables
        return handed


def handed_call(
    source: Any,
    where: str,
    functions: Sequence[Any],
    count: int,
    runs: Callable[[Any], Sequence[tuple[int, Run]]],
    make_thread: Callable[[Any, int, str], Any],
) -> HandedCall:
    """The wrappers of ``functions`` for this call: reused where ``source`` allows it.

    Args:
      source: the ``StateSource``; its optional ``reuse_key()`` decides reuse.
      where: the neutral name (errors, and part of the reuse key).
      functions: the user's distinct functions the wrappers call.
      count: how many functions the JAX call traces (the ``Threaded``'s count).
      runs: ``runs(thread)``, one ``(named, run)`` per wrapper: ``run(functions, *args)``
        is its body, ``functions[named]`` the function it is named after.
      make_thread: ``make_thread(source, count, where)``, the ``Threaded``.

    Returns:
      The wrappers and their ``Threaded``.
    """
    reuse_key = getattr(source, "reuse_key", None)
    situation: Hashable = None if reuse_key is None else reuse_key()

    def build(getters: Sequence[Getter] | None) -> HandedCall:
        thread = make_thread(source, count, where)
        if getters is None:
            handed = [_fresh(functions, named, run) for named, run in runs(thread)]
        else:
            handed = [Handed(getters, named, run) for named, run in runs(thread)]
        return HandedCall(thread, handed)

    if situation is None:
        return build(None)
    return _CACHE.get(functions, (where, count, situation), build)
