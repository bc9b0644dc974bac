"""Dispatch through the stack, and ``next_impl`` for overrides that delegate downwards."""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from typing import Any

from jaxoverride import _stack
from jaxoverride._names import JAX_IMPLS, check_name

# (snapshot, level) of the override that is running in this thread or task.
_position: contextvars.ContextVar[tuple[_stack.Snapshot, int] | None] = contextvars.ContextVar(
    "jaxoverride_position", default=None
)


def run_at(snapshot: _stack.Snapshot, level: int, name: str, /, *args: Any, **kwargs: Any) -> Any:
    """Calls the override of ``name`` at ``level``, with ``next_impl`` pointing below it."""
    token = _position.set((snapshot, level))
    try:
        return snapshot.layers[level].impls[name](*args, **kwargs)
    finally:
        _position.reset(token)


def dispatch(snapshot: _stack.Snapshot, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]):
    """Calls the topmost implementation of ``name`` in ``snapshot``."""
    level = snapshot.top(name)
    if level is None:
        return JAX_IMPLS[name](*args, **kwargs)
    return run_at(snapshot, level, name, *args, **kwargs)


def next_impl(name: str) -> Callable[..., Any]:
    """The implementation of ``name`` below the override that is running now.

    An override reaches the layer beneath it (an outer override, an installed adapter,
    or JAX) with this; the neutral function would dispatch back into itself. Call it
    inside the override, before handing control to user code; do not store it.

    Args:
      name: an overridable name, such as ``"lax.scan"`` or ``"jit"``. It need not be
        the name of the running override: a ``"jit"`` override may ask for the
        ``"lax.scan"`` below itself.

    Returns:
      A callable with the signature of the JAX function ``name`` stands for.

    Raises:
      RuntimeError: if no override is running in this thread or task.

    Example:
      >>> import jaxoverride as jo
      >>> calls = []
      >>> def counting_scan(f, init, xs=None, length=None, **kwargs):
      ...     calls.append(length)
      ...     return jo.next_impl("lax.scan")(f, init, xs, length, **kwargs)
      >>> with jo.override_context({"lax.scan": counting_scan}):
      ...     carry, _ = jo.lax.scan(lambda c, _: (c + 1, None), 0, length=3)
      >>> int(carry), calls
      (3, [3])
    """
    check_name(name, where="jaxoverride.next_impl")
    position = _position.get()
    if position is None:
        raise RuntimeError(
            f"jaxoverride.next_impl({name!r}) was called while no override is running. It "
            "returns the implementation below the running override; call it from inside "
            "an override function. To see what a name resolves to, use jaxoverride.resolve."
        )
    snapshot, level = position
    level_below = snapshot.below(name, level)
    if level_below is None:
        return JAX_IMPLS[name]
    return functools.partial(run_at, snapshot, level_below, name)


def resolve(name: str) -> Callable[..., Any]:
    """The implementation that a neutral call of ``name`` would use here and now.

    Args:
      name: an overridable name, such as ``"lax.scan"``.

    Returns:
      The topmost active override of ``name``, or the JAX function itself. It is returned
      for inspection: call the neutral function to run it with the stack in place.

    Example:
      >>> import jax, jaxoverride as jo
      >>> jo.resolve("lax.scan") is jax.lax.scan
      True
    """
    check_name(name, where="jaxoverride.resolve")
    snapshot = _stack.effective_snapshot()
    level = snapshot.top(name)
    if level is None:
        return JAX_IMPLS[name]
    return snapshot.layers[level].impls[name]
