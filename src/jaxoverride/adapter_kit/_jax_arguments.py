"""The arguments of a call of a JAX function, read the way JAX reads them.

An override that takes ``*args, **kwargs`` (``lax.scan``, ``lax.fori_loop``,
``lax.cond``, ``lax.custom_root``, ...) reads them with ``jax_arguments``, bound to the
signature of JAX's own function, so that no adapter writes that signature again: the
names, the defaults and the error for a call that does not fit are those of the
installed JAX.

Stability: semi-public, as the rest of the kit.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from jaxoverride._names import JAX_IMPLS


@functools.cache
def _signature(name: str) -> tuple[Callable[..., Any], inspect.Signature]:
    # JAX_IMPLS holds JAX's functions as imported before anything could interpose on them.
    function = JAX_IMPLS[name]
    return function, inspect.signature(function)


def jax_arguments(name: str, /, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
    """The arguments of a call of JAX's ``name``, positional and with JAX's defaults.

    Args:
      name: an overridable name (``"lax.fori_loop"``); its JAX function's signature binds
        the arguments.
      args, kwargs: the call's arguments.

    Returns:
      One value per parameter of JAX's function, in its order: ``(lower, upper, body_fun,
      init_val, unroll)`` for ``"lax.fori_loop"``; a ``*operands`` parameter as a tuple
      (``cond``'s ``operand`` is ``NO_OPERAND`` where it is not given).

    Raises:
      TypeError: JAX's own, where JAX's function would not take the arguments (raised
        by JAX's function before it runs anything).

    Example:
      >>> from jaxoverride.adapter_kit import NO_OPERAND, jax_arguments
      >>> jax_arguments("lax.fori_loop", 0, 3, abs, init_val=1)
      (0, 3, <built-in function abs>, 1, None)
      >>> pred, true_fun, false_fun, operands, operand = jax_arguments(
      ...     "lax.cond", True, abs, abs, 1, 2)
      >>> operands, operand is NO_OPERAND
      ((1, 2), True)
    """
    function, signature = _signature(name)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        function(*args, **kwargs)  # JAX's own message, naming its function
        raise
    bound.apply_defaults()
    return tuple(bound.arguments.values())


def scan_arguments(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
    """``jax_arguments("lax.scan", *args, **kwargs)``: ``(f, init, xs, length, reverse,
    unroll, _split_transpose)``.

    Example:
      >>> from jaxoverride.adapter_kit import scan_arguments
      >>> scan_arguments(abs, 0, length=3)
      (<built-in function abs>, 0, None, 3, False, 1, False)
    """
    return jax_arguments("lax.scan", *args, **kwargs)
