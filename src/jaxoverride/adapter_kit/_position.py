"""Where the running override sits in the stack: what is above it and what is below it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jaxoverride import _compat, _dispatch
from jaxoverride._introspect import _describe
from jaxoverride._names import JAX_IMPLS, check_name


@dataclass(frozen=True)
class OverridePosition:
    """Where the override that is running now sits in the stack, for one name.

    Attributes:
      below: what ``jaxoverride.next_impl(name)`` would call: the override of ``name``
        under the running one, or the JAX function itself.
      above: the overrides of ``name`` above the running one, top first; they ran first
        and delegated down to it.
    """

    below: Callable[..., Any]
    above: tuple[Callable[..., Any], ...]


def override_position(name: str) -> OverridePosition:
    """Where the running override sits in the stack for ``name``.

    A layer that wraps every name (a logger, a profiler) reads this to say what it
    delegates to and whether another copy of itself above has already handled the call.

    Args:
      name: an overridable name, such as ``"lax.scan"``.

    Returns:
      An ``OverridePosition``.

    Raises:
      RuntimeError: if no override is running in this thread or task.

    Example:
      >>> import jax, jaxoverride as jo
      >>> from jaxoverride.adapter_kit import override_position
      >>> seen = []
      >>> def scan(*args, **kwargs):
      ...     seen.append(override_position("lax.scan"))
      ...     return jo.next_impl("lax.scan")(*args, **kwargs)
      >>> with jo.override_context({"lax.scan": scan}):
      ...     _ = jo.lax.scan(lambda c, x: (c, x), 0, length=2)
      >>> seen[0].below is jax.lax.scan, seen[0].above
      (True, ())
    """
    check_name(name, where="jaxoverride.adapter_kit.override_position")
    position = _dispatch._position.get()
    if position is None:
        raise RuntimeError(
            f"override_position({name!r}) was called while no override is running; call "
            "it from inside an override function."
        )
    snapshot, level = position
    layers = snapshot.layers
    above = tuple(
        layers[upper].impls[name]
        for upper in range(len(layers) - 1, level, -1)
        if name in layers[upper].impls
    )
    level_below = snapshot.below(name, level)
    below = JAX_IMPLS[name] if level_below is None else layers[level_below].impls[name]
    return OverridePosition(below=below, above=above)


def describe_impl(impl: Callable[..., Any], name: str | None = None) -> str:
    """A short dotted name for an implementation: ``jax.lax.scan`` or ``module.qualname``.

    Args:
      impl: an implementation of an overridable name.
      name: the name it implements; JAX's own function is then written ``jax.<name>``.

    Returns:
      The description.

    Example:
      >>> import jax
      >>> from jaxoverride.adapter_kit import describe_impl
      >>> describe_impl(jax.lax.scan, "lax.scan")
      'jax.lax.scan'
    """
    return _describe(impl, name)


def get_opaque_trace_state(convention: str | None = None) -> Any:
    """An opaque token of JAX's current trace, equal while the trace is the same.

    A framework that keeps state per trace level (Haiku's frames) compares these to tell
    whether it runs under the trace it was entered in. JAX's public
    ``jax.extend.core.get_opaque_trace_state`` (``jax.core``'s before JAX 0.9), except
    where JAX has no current trace: from JAX 0.11 a primitive's own rules (its abstract
    evaluation, as when Equinox's primitives call ``eqx.filter_eval_shape``) run with
    none, and JAX's accessor fails there. This one then returns a token equal to no
    trace's, so framework state entered in any trace reads as not usable there.

    Args:
      convention: passed to JAX, which ignores it (Haiku passes ``"haiku"``).

    Returns:
      The token.

    Example:
      >>> import jax
      >>> from jaxoverride.adapter_kit import get_opaque_trace_state
      >>> outer = get_opaque_trace_state()
      >>> inner = []
      >>> _ = jax.jit(lambda x: inner.append(get_opaque_trace_state()) or x)(1.0)
      >>> outer == get_opaque_trace_state(), outer == inner[0]
      (True, False)
    """
    return _compat.get_opaque_trace_state(convention)
