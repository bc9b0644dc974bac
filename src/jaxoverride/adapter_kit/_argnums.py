"""Argument positions and names: ``static_argnums``/``static_argnames`` as JAX reads them.

An adapter that rebuilds a ``jit`` or ``checkpoint`` over the user's function must name
the same static and donated arguments JAX would, and, when it puts its own state in front
of the user's arguments, name them one position further on.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

from jaxoverride._compat import NEGATIVE_ARGNUMS_NAME_PARAMETERS

_POSITIONAL_OR_KEYWORD = inspect.Parameter.POSITIONAL_OR_KEYWORD


def as_index_tuple(value: int | Iterable[int] | None) -> tuple[int, ...]:
    """``argnums`` as a tuple: an int becomes a one-tuple, ``None`` an empty one.

    Args:
      value: what the user passed as ``static_argnums``, ``donate_argnums`` ...

    Returns:
      A tuple of ints.

    Example:
      >>> from jaxoverride.adapter_kit import as_index_tuple
      >>> as_index_tuple(1), as_index_tuple([0, 2]), as_index_tuple(None)
      ((1,), (0, 2), ())
    """
    return (value,) if isinstance(value, int) else tuple(int(i) for i in value or ())


def _as_name_tuple(value: str | Iterable[str] | None) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value or ())


def infer_argnums_and_argnames(
    fun: Callable[..., Any],
    argnums: int | Iterable[int] | None,
    argnames: str | Iterable[str] | None,
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Completes ``argnums`` from ``argnames`` or back, through ``fun``'s signature, as JAX does.

    Given only one of the two, ``jax.jit`` adds the other: the positional-or-keyword
    parameters named, or at the given positions (non-negative ones; from JAX 0.12 negative
    ones too, counted from the end of the signature). Given both, or a function without a
    signature, it takes them as they are.

    Args:
      fun: the user's function.
      argnums: an int, a sequence of ints, or ``None``.
      argnames: a string, a sequence of strings, or ``None``.

    Returns:
      ``(argnums, argnames)`` as tuples.

    Example:
      >>> from jaxoverride.adapter_kit import infer_argnums_and_argnames
      >>> def f(x, n, *, mode): ...
      >>> infer_argnums_and_argnames(f, 1, None)
      ((1,), ('n',))
      >>> infer_argnums_and_argnames(f, None, ("n", "mode"))
      ((1,), ('n', 'mode'))
    """
    nums, names = as_index_tuple(argnums), _as_name_tuple(argnames)
    if (argnums is None) == (argnames is None) or not (nums or names):
        return nums, names
    try:
        parameters = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        return nums, names
    positional = [(i, p.name) for i, p in enumerate(parameters) if p.kind is _POSITIONAL_OR_KEYWORD]
    if argnums is None:
        return tuple(i for i, name in positional if name in names), names
    # JAX < 0.12 names no parameter for a negative position (see jaxoverride._compat).
    end = len(parameters) if NEGATIVE_ARGNUMS_NAME_PARAMETERS else None
    return nums, tuple(
        name for i, name in positional if i in nums or (end is not None and i - end in nums)
    )


def shift_argnums(argnums: Iterable[int], by: int = 1) -> tuple[int, ...]:
    """Positions in the user's function as positions in a function with ``by`` leading arguments.

    An adapter that passes its state first (``lifted(state, *args)``) names the user's
    static or non-differentiable arguments with this. Negative positions count from the end
    and stay as they are.

    Args:
      argnums: positions in the user's function.
      by: how many arguments the adapter puts in front.

    Returns:
      The positions in the lifted function.

    Example:
      >>> from jaxoverride.adapter_kit import shift_argnums
      >>> shift_argnums((0, 2, -1))
      (1, 3, -1)
    """
    return tuple(n + by if n >= 0 else n for n in argnums)
