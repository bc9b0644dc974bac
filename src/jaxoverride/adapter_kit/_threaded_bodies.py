"""The loop bodies the threading combinators hand JAX: per call, or cached per function.

By default a combinator builds its body anew on every call, closing over that call's
``Threaded``; JAX then traces the body on every call. A ``StateSource`` whose
``body_key()`` returns a hashable (not None) asks for cached bodies instead: one body
per (user function, kind of call, key) while the function lives (``WrapperCache``), which
finds the running call's ``Threaded`` in a context variable. JAX's own trace cache then
works as for the raw loop: an eager loop called again with the same body is neither
traced nor compiled again. Such a source must not rely on its function being traced on
every call: what a trace finds out (what it wrote, say) it keeps next to the function.

Stability: semi-public, as the rest of the kit.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

from jaxoverride.adapter_kit._cache import WrapperCache

# The ``Threaded`` of the combinator call whose JAX call is tracing its body now.
_RUNNING: contextvars.ContextVar[Any] = contextvars.ContextVar("jaxoverride_threaded_running")

_BODIES: WrapperCache[Callable[..., Any]] = WrapperCache()

Getter = Callable[[], Any]


def body_key(source: Any) -> Any:
    """The source's ``body_key()``, or None if it has none (bodies are not cached)."""
    key = getattr(source, "body_key", None)
    return None if key is None else key()


def threaded_body(
    key: Any,
    thread: Any,
    kind: str,
    fun: Any,
    make: Callable[[Getter, Getter], Callable[..., Any]],
    wraps: Callable[[Any], Callable[[Callable[..., Any]], Callable[..., Any]]],
) -> Callable[..., Any]:
    """The body for ``fun``: ``make(function getter, Threaded getter)``, named as ``fun``.

    With ``key`` None it is built now around ``thread``; otherwise it is cached per
    (``fun``, ``kind``, ``key``) and finds its ``Threaded`` through ``running``. A cached
    body holds ``fun`` weakly (no ``__wrapped__``), so the cache keeps nothing alive.
    """
    if key is None:
        return wraps(fun)(make(lambda: fun, lambda: thread))

    def build(getters: tuple[Getter, ...]) -> Callable[..., Any]:
        body = wraps(fun)(make(getters[0], _RUNNING.get))
        body.__dict__.pop("__wrapped__", None)
        return body

    return _BODIES.get((fun,), (kind, key), build)


@contextlib.contextmanager
def running(thread: Any) -> Iterator[None]:
    """Makes ``thread`` the ``Threaded`` that cached bodies find while JAX traces them."""
    token = _RUNNING.set(thread)
    try:
        yield
    finally:
        _RUNNING.reset(token)
