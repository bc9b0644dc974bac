"""The arguments of a call of JAX's control flow, read the way JAX reads them.

An override of ``lax.scan``, ``lax.fori_loop``, ``lax.cond`` or ``lax.switch`` takes
``*args, **kwargs`` and reads them with one of these, bound to the signature of JAX's
function, so that no adapter writes that signature again: the names, the defaults and
the error for a call that does not fit are those of the installed JAX.

Stability: semi-public, as the rest of the kit.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from jaxoverride._names import JAX_IMPLS

# JAX's own functions (as imported before anything could interpose on them), by name.
_SIGNATURES: dict[str, tuple[Callable[..., Any], inspect.Signature]] = {
    name: (JAX_IMPLS[name], inspect.signature(JAX_IMPLS[name]))
    for name in ("lax.scan", "lax.fori_loop", "lax.cond", "lax.switch")
}


def _bound(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``args`` and ``kwargs`` bound to the parameters of JAX's ``name``, defaults applied."""
    function, signature = _SIGNATURES[name]
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        # JAX's own message, naming its function: binding fails before any user code runs.
        function(*args, **kwargs)
        raise
    bound.apply_defaults()
    return tuple(bound.arguments.values())


def scan_arguments(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
    """The arguments of a ``jax.lax.scan`` call, positional and with JAX's defaults.

    Args:
      args, kwargs: a call's arguments, as ``jax.lax.scan`` takes them.

    Returns:
      ``(f, init, xs, length, reverse, unroll, _split_transpose)``.

    Raises:
      TypeError: JAX's own, where ``jax.lax.scan`` would not take the arguments.

    Example:
      >>> from jaxoverride.adapter_kit import scan_arguments
      >>> scan_arguments(abs, 0, length=3)
      (<built-in function abs>, 0, None, 3, False, 1, False)
    """
    return _bound("lax.scan", args, kwargs)


def fori_loop_arguments(*args: Any, **kwargs: Any) -> tuple[Any, Any, Any, Any, Any]:
    """The arguments of a ``jax.lax.fori_loop`` call, positional and with JAX's defaults.

    Args:
      args, kwargs: a call's arguments, as ``jax.lax.fori_loop`` takes them.

    Returns:
      ``(lower, upper, body_fun, init_val, unroll)``.

    Raises:
      TypeError: JAX's own, where ``jax.lax.fori_loop`` would not take the arguments.

    Example:
      >>> from jaxoverride.adapter_kit import fori_loop_arguments
      >>> fori_loop_arguments(0, 3, abs, init_val=1)
      (0, 3, <built-in function abs>, 1, None)
    """
    return _bound("lax.fori_loop", args, kwargs)


def cond_arguments(*args: Any, **kwargs: Any) -> tuple[Any, Any, Any, tuple[Any, ...], Any]:
    """The arguments of a ``jax.lax.cond`` call, positional and with JAX's defaults.

    Args:
      args, kwargs: a call's arguments, as ``jax.lax.cond`` takes them.

    Returns:
      ``(pred, true_fun, false_fun, operands, operand)``: ``operands`` the tuple of
      positional operands, ``operand`` the deprecated keyword's value (``NO_OPERAND``
      where it is not given).

    Raises:
      TypeError: JAX's own, where ``jax.lax.cond`` would not take the arguments.

    Example:
      >>> from jaxoverride.adapter_kit import NO_OPERAND, cond_arguments
      >>> pred, true_fun, false_fun, operands, operand = cond_arguments(True, abs, abs, 1, 2)
      >>> operands, operand is NO_OPERAND
      ((1, 2), True)
    """
    return _bound("lax.cond", args, kwargs)


def switch_arguments(*args: Any, **kwargs: Any) -> tuple[Any, Any, tuple[Any, ...], Any]:
    """The arguments of a ``jax.lax.switch`` call, positional and with JAX's defaults.

    Args:
      args, kwargs: a call's arguments, as ``jax.lax.switch`` takes them.

    Returns:
      ``(index, branches, operands, operand)``, ``operands`` and ``operand`` as for
      ``cond_arguments``.

    Raises:
      TypeError: JAX's own, where ``jax.lax.switch`` would not take the arguments.

    Example:
      >>> from jaxoverride.adapter_kit import switch_arguments
      >>> index, branches, operands, operand = switch_arguments(1, [abs, abs], operand=3)
      >>> index, operands, operand
      (1, (), 3)
    """
    return _bound("lax.switch", args, kwargs)
