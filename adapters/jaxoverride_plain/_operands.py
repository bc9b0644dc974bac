"""Operands as JAX's own call hands them to a body: arrays, dtype and weak type kept.

A creation pass calls bodies and branches outside JAX, so it must first do the one
conversion JAX's ``cond``/``switch``/loops make before tracing: each leaf becomes an
array (a Python ``1`` a weakly-typed ``int32``), so that a body reading ``x.shape`` or
``x.dtype`` sees at init what it sees when JAX traces it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp


def _as_array(leaf: Any) -> Any:
    try:
        return jnp.asarray(leaf)
    except TypeError:
        # Not a JAX type: left as given, so that the apply pass raises JAX's own error.
        return leaf


def as_jax_operands(tree: Any) -> Any:
    """``tree`` with every leaf as the array JAX's control flow would hand a body.

    Args:
      tree: operands, a carry or a slice, possibly holding Python or NumPy scalars.

    Returns:
      The same structure, each convertible leaf a ``jax.Array`` of the dtype (weak type
      included) JAX gives it; leaves JAX would reject are left for JAX to reject.

    Example:
      >>> from jaxoverride_plain import as_jax_operands
      >>> x, y = as_jax_operands((1, 2.0))
      >>> x.dtype.name, x.weak_type, y.dtype.name
      ('int32', True, 'float32')
    """
    return jax.tree_util.tree_map(_as_array, tree)


def distinct_functions(functions: Sequence[Callable[..., Any]]) -> list[Callable[..., Any]]:
    """``functions`` without repeats of one object, first occurrence first.

    JAX traces a branch object once however often it is listed; a creation pass calls
    each distinct object once for the same reason.

    Args:
      functions: branches or cases, possibly the same object more than once.

    Returns:
      The distinct objects, in order of first appearance.

    Example:
      >>> from jaxoverride_plain import distinct_functions
      >>> f, g = abs, len
      >>> distinct_functions([f, g, f]) == [f, g]
      True
    """
    seen: dict[int, Callable[..., Any]] = {}
    for function in functions:
        seen.setdefault(id(function), function)
    return list(seen.values())
