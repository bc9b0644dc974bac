"""Handing user functions to JAX: cached wrappers, the user-call frame, JAX's errors.

JAX caches a body's trace per function object, so ``cached`` keeps one wrapper per user
function and plan while the function lives. User code runs through ``call_user``, so its
errors are told from JAX's checks of what it returned; bad input is replayed on raw JAX,
abstractly, for JAX's own error (``raise_as_jax``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from jaxoverride.adapter_kit import WrapperCache, raise_as_jax
from jaxoverride_dag._errors import SharingError
from jaxoverride_dag._plan import Plan


class RetryError(Exception):
    """Internal: trace again with ``plan``, which shares fewer arrays."""

    def __init__(self, plan: Plan):
        super().__init__("internal: retry with fewer shared arrays")
        self.plan = plan


class MismatchError(Exception):
    """Internal: a sharing difference that loses identity; JAX's error wins if it has one."""

    def __init__(self, error: SharingError):
        super().__init__(str(error))
        self.error = error


def call_user(fun: Callable[..., Any], *args: Any) -> Any:
    # An error passing through here is the user's; marked, since JAX drops jaxoverride's
    # frames from the tracebacks of errors that pass through it.
    try:
        return fun(*args)
    except Exception as error:
        error.__dict__[_FROM_USER] = True
        raise


_FROM_USER = "_jaxoverride_dag_from_user"


def from_user(error: BaseException) -> bool:
    return error.__dict__.get(_FROM_USER, False)


def raise_handoff_error(raw: Callable[[], Any], error: BaseException) -> NoReturn:
    """Raises what a failed handoff means to the user: an error of their own code as it
    was raised; a sharing mismatch, or JAX's refusal of what the adapter passed, as raw
    JAX raises it for the call that ``raw`` makes (see ``raise_as_jax``)."""
    if isinstance(error, MismatchError):
        raise_as_jax(raw, error.error)
    if from_user(error):
        raise error
    raise_as_jax(raw, error)


MAX_PER_FUNCTION = 64
_WRAPPERS: WrapperCache[Callable[..., Any]] = WrapperCache(MAX_PER_FUNCTION)


def cached(
    fun: Any, key: Any, make: Callable[[Callable[[], Any]], Callable[..., Any]]
) -> Callable[..., Any]:
    """The wrapper ``make(get_fun)`` for ``(fun, key)``, one object per pair while ``fun``
    lives (held weakly)."""
    return _WRAPPERS.get((fun,), key, lambda getters: make(getters[0]))


__all__ = [
    "MAX_PER_FUNCTION",
    "MismatchError",
    "RetryError",
    "cached",
    "call_user",
    "from_user",
    "raise_as_jax",
    "raise_handoff_error",
]
