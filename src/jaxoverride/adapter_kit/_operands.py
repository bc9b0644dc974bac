"""Operands as JAX's own call hands them to a body: arrays, dtype and weak type kept.

A creation pass calls bodies outside JAX, so it first makes the conversion JAX's control
flow makes (a Python ``1`` becomes a weakly-typed ``int32``): a body reading ``x.dtype``
sees at init what it sees when JAX traces it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

NO_OPERAND: Any = inspect.signature(jax.lax.cond).parameters["operand"].default
"""The default of ``jax.lax.cond``'s and ``switch``'s deprecated ``operand`` argument.

An override of ``lax.cond`` tells "no ``operand`` given" from ``operand=None`` with
``operand is NO_OPERAND``, as JAX does.
"""


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
      >>> from jaxoverride.adapter_kit import as_jax_operands
      >>> x, y = as_jax_operands((1, 2.0))
      >>> x.dtype.name, x.weak_type, y.dtype.name
      ('int32', True, 'float32')
    """
    return jax.tree_util.tree_map(_as_array, tree)


def traced_arguments(args: tuple[Any, ...], static: Any = ()) -> tuple[Any, ...]:
    """``args`` as a JAX transform hands them to the function it traces: every argument
    but those at the positions ``static`` (``static_argnums``, or the arguments that
    ``grad`` does not differentiate, which JAX passes as given) as arrays.

    Args:
      args: the positional arguments of the call.
      static: an int or a collection of ints, the positions JAX passes unconverted
        (negative ones count from the end).

    Returns:
      The arguments, converted by ``as_jax_operands`` where JAX would trace them.

    Example:
      >>> from jaxoverride.adapter_kit import traced_arguments
      >>> x, n = traced_arguments((2.0, 3), static=1)
      >>> x.dtype, n
      (dtype('float32'), 3)
    """
    numbers = {static} if isinstance(static, int) else set(static)
    kept = {n % len(args) for n in numbers if -len(args) <= n < len(args)}
    return tuple(a if i in kept else as_jax_operands(a) for i, a in enumerate(args))


def distinct_functions(functions: Sequence[Callable[..., Any]]) -> list[Callable[..., Any]]:
    """``functions`` without repeats of one object, first occurrence first.

    JAX traces a branch object once however often it is listed; so does a creation pass.

    Args:
      functions: branches or cases, possibly the same object more than once.

    Returns:
      The distinct objects, in order of first appearance.

    Example:
      >>> from jaxoverride.adapter_kit import distinct_functions
      >>> f, g = abs, len
      >>> distinct_functions([f, g, f]) == [f, g]
      True
    """
    seen: dict[int, Callable[..., Any]] = {}
    for function in functions:
        seen.setdefault(id(function), function)
    return list(seen.values())


def first_slice(xs: Any, reverse: bool = False, *, replay: Callable[[], Any]) -> Any:
    """The slice a loop over ``xs`` sees first (the last with ``reverse``), for a creation
    pass; zeros of the slice shape if ``xs`` is empty.

    ``xs`` that JAX refuses (a string, a generator, a scalar) raise JAX's own error: on
    failure ``replay`` (JAX's loop over the same ``xs`` with a body that does nothing) runs
    under ``jax.eval_shape``, so that no user code runs.
    """
    try:
        return jax.tree_util.tree_map(lambda x: _first(as_jax_operands(x), 0, reverse), xs)
    except (ArithmeticError, AttributeError, IndexError, TypeError, ValueError) as error:
        failure = error
    jax.eval_shape(replay)  # raises JAX's error for these xs
    raise failure


def _first(leaf: Any, axis: int, last: bool = False) -> Any:
    """The first (``last``: the last) slice of ``leaf`` along ``axis``; zeros if empty."""
    axis %= leaf.ndim
    if leaf.shape[axis] == 0:
        return jnp.zeros(leaf.shape[:axis] + leaf.shape[axis + 1 :], leaf.dtype)
    return leaf[(slice(None),) * axis + (-1 if last else 0,)]  # a slice, as JAX's loops take


def _take_first(tree: Any, axis: int | None) -> Any:
    if axis is None:
        return tree
    return jax.tree_util.tree_map(lambda leaf: _first(jnp.asarray(leaf), axis), tree)


def unbatched_arguments(args: tuple[Any, ...], in_axes: Any) -> tuple[Any, ...]:
    """One slice of ``vmap``/``pmap`` arguments: index 0 along each mapped axis.

    ``in_axes`` is what ``jax.vmap`` takes: an int or ``None`` for every argument, or a
    tuple/list with one prefix tree per positional argument.

    Args:
      args: the positional arguments of the mapped call.
      in_axes: as for ``jax.vmap``.

    Returns:
      The arguments of one unmapped call (zeros of the slice shape for an empty axis).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxoverride.adapter_kit import unbatched_arguments
      >>> a, b = unbatched_arguments((jnp.ones((4, 3)), jnp.ones(2)), (1, None))
      >>> a.shape, b.shape
      ((4,), (2,))
    """
    try:
        if in_axes is None or isinstance(in_axes, int):
            return tuple(_take_first(arg, in_axes) for arg in args)
        return tuple(
            jax.tree_util.tree_map(
                lambda axis, subtree: _take_first(subtree, axis),
                tuple(in_axes),
                tuple(args),
                is_leaf=lambda node: node is None,
            )
        )
    except (ArithmeticError, IndexError, TypeError, ValueError) as error:
        failure = error
    # JAX's own error for these arguments (an axis beyond a leaf's rank, a leaf that is not
    # an array), from ``jax.vmap`` of a function that does nothing: no user code runs.
    jax.eval_shape(jax.vmap(lambda *_: None, in_axes=in_axes), *args)
    raise failure


def zeros_for(tree: Any) -> Any:
    """Concrete zeros for every ``jax.ShapeDtypeStruct`` in ``tree`` (for ``eval_shape``).

    Args:
      tree: a pytree whose leaves may be ``jax.ShapeDtypeStruct``.

    Returns:
      The same tree with each ``ShapeDtypeStruct`` replaced by zeros of its shape.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxoverride.adapter_kit import zeros_for
      >>> zeros_for((jax.ShapeDtypeStruct((2,), jnp.float32), 3))
      (Array([0., 0.], dtype=float32), 3)
    """

    def concrete(leaf: Any) -> Any:
        if isinstance(leaf, jax.ShapeDtypeStruct):
            return jnp.zeros(leaf.shape, leaf.dtype)
        return leaf

    return jax.tree_util.tree_map(concrete, tree)
