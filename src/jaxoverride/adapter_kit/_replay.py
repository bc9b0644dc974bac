"""JAX's own errors about the user's functions: replay the call on raw JAX.

An adapter hands JAX functions of its own, whose carries and outputs hold the adapter's
state beside the user's values. JAX's checks of a carry or of branch outputs would then
describe the adapter's structure (``args[0]``, a path ``[0]['a']``, a branch named
``<unknown>``). Where the user's values break one of those rules, the adapter runs raw
JAX, under ``jax.eval_shape`` (nothing is computed), on the user's call or on stand-ins
that carry the user's functions' names and signatures and return the user's values:
JAX's own check then raises JAX's own message, about the user's code. The stand-ins
return values already computed, so nothing the user wrote runs twice.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import jax
import jax.numpy as jnp
import numpy as np

_SCALARS = (bool, int, float, complex)
# Raw JAX cannot express the call (a non-array leaf): the adapter's own error is the one.
_NOT_JAX = "is not a valid JAX type"


def raise_as_jax(raw: Callable[[], Any], error: BaseException) -> NoReturn:
    """Raises JAX's own error for the call that ``raw`` makes, or ``error`` if it has none.

    ``raw`` runs under ``jax.eval_shape``: JAX's checks happen while tracing, so nothing
    is computed. A ``TypeError`` or ``ValueError`` from JAX wins, unless it only says that
    raw JAX cannot take a non-array leaf; anything else says nothing about the input.

    Args:
      raw: makes the user's call on raw JAX (``lambda: jax.lax.scan(f, init, xs)``).
      error: what the adapter raises when raw JAX accepts the call.

    Raises:
      TypeError: JAX's own, when raw JAX rejects the call (or ``ValueError``).
      BaseException: ``error``, when raw JAX accepts the call or says nothing about it.

    Example:
      >>> import jax
      >>> from jaxoverride.adapter_kit import raise_as_jax
      >>> try:
      ...     raise_as_jax(lambda: jax.lax.scan(lambda c, x: c, 0.0, None, length=1),
      ...                  RuntimeError("adapter"))
      ... except TypeError as error:
      ...     print(str(error).split(",")[0])
      scan body output must be a pair
    """
    try:
        jax.eval_shape(lambda: (raw(), None)[1])
    except (TypeError, ValueError) as jax_error:
        if _NOT_JAX not in str(jax_error):
            raise jax_error from None
    except Exception:  # anything else says nothing about the input: ours is clearer
        pass
    raise error


def _is_value(leaf: Any) -> bool:
    return hasattr(leaf, "dtype") or isinstance(leaf, _SCALARS)


def _key(leaf: Any) -> Any:
    if _is_value(leaf):
        return (np.shape(leaf), jnp.result_type(leaf))
    return ("other", id(leaf))


def _like(before: Any, after: Any) -> bool:
    """Whether JAX accepts ``after`` as a carry of ``before``'s type (weak types aside)."""
    leaves, tree = jax.tree.flatten(before)
    new_leaves, new_tree = jax.tree.flatten(after)
    return tree == new_tree and list(map(_key, leaves)) == list(map(_key, new_leaves))


def _plain(tree: Any) -> Any:
    """``tree`` for raw JAX: a leaf that is not an array (a module's reference, which the
    adapter checked itself) becomes ``0`` on both sides of the comparison."""
    return jax.tree.map(lambda leaf: leaf if _is_value(leaf) else 0, tree)


def _first_line(error: BaseException) -> str:
    return str(error).split("\n", 1)[0]


def _stand_in(fn: Callable[..., Any], result: Any) -> Callable[..., Any]:
    return functools.wraps(fn)(lambda *_, **__: result)


def check_scan_output(f: Callable[..., Any], carry: Any, out: Any) -> None:
    """Raises JAX's error if ``out`` is not what ``jax.lax.scan`` accepts from ``f``.

    Args:
      f: the user's body.
      carry: the carry it was given (as the adapter passes modules: references).
      out: what it returned, modules as references.
    """
    if isinstance(out, (tuple, list)) and len(out) == 2 and _like(carry, out[0]):
        return
    carry, out = _plain((carry, out))
    stand_in = _stand_in(f, out)
    jax.eval_shape(lambda: jax.lax.scan(stand_in, carry, None, length=1))


def check_loop_carry(
    body_fun: Callable[..., Any], carry: Any, new_carry: Any, cond_fun: Callable[..., Any] | None
) -> None:
    """Raises JAX's error if ``new_carry`` is not a carry of ``carry``'s type.

    Args:
      body_fun: the user's body.
      carry: what it was given.
      new_carry: what it returned.
      cond_fun: the user's predicate for a ``while_loop``; ``None`` for a ``fori_loop``.
    """
    if _like(carry, new_carry):
        return
    carry, new_carry = _plain((carry, new_carry))
    body = _stand_in(body_fun, new_carry)
    if cond_fun is None:
        jax.eval_shape(lambda: jax.lax.fori_loop(0, 1, body, carry))
    else:
        test = _stand_in(cond_fun, True)
        jax.eval_shape(lambda: jax.lax.while_loop(test, body, carry))


def output_shapes(out: Any) -> Any:
    """What ``branch_error`` needs of a branch's output, kept after its trace ended."""

    def shape(leaf: Any) -> Any:
        if isinstance(leaf, _SCALARS):
            return leaf
        if not hasattr(leaf, "dtype"):
            return 0
        weak = bool(getattr(jax.typeof(leaf), "weak_type", False))
        return jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype, weak_type=weak)

    return jax.tree.map(shape, out)


def branch_error(
    error: TypeError, branches: Sequence[Callable[..., Any]], outputs: Sequence[Any], switch: bool
) -> TypeError:
    """JAX's error for branches whose outputs differ, about the user's branches.

    Args:
      error: what JAX raised for the adapter's branches.
      branches: the user's branches.
      outputs: each branch's ``output_shapes``, or ``None`` where it was not traced.
      switch: ``lax.switch`` (else ``lax.cond``).

    Returns:
      JAX's error for the user's branches, or ``error`` when raw JAX does not raise the
      same kind of error for them.
    """
    if any(out is None for out in outputs):
        return error

    def replay(outs: Sequence[Any], selector: Any) -> Any:
        stand_ins = [_stand_in(fn, out) for fn, out in zip(branches, outs, strict=True)]
        if switch:
            return jax.lax.switch(selector, stand_ins)
        return jax.lax.cond(selector, *stand_ins)

    selector = jax.ShapeDtypeStruct((), jnp.int32 if switch else jnp.bool_)
    try:
        jax.eval_shape(replay, list(outputs), selector)
    except TypeError as jax_error:
        if _first_line(jax_error) == _first_line(error):
            return jax_error
    return error
