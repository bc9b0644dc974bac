"""Arguments of lifted custom rules: what an adapter needs to put its own state in front.

An adapter that makes ``custom_vjp``/``custom_jvp`` stateful passes its state as a
leading argument of a JAX rule built over the user's function, and registers the rule
with ``symbolic_zeros=True`` to learn which of that state is being differentiated. These
helpers keep JAX's own argument binding and hide the symbolic wrappers from user rules
that did not ask for them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from jaxoverride._compat import jit_name
from jaxoverride.adapter_kit._rule_checks import check_primal_out


def positional_arguments(
    fun: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, ...]:
    """The arguments as JAX binds them for a custom rule: every keyword at its position.

    Args:
      fun: the decorated function, whose signature binds the keywords.
      args: positional arguments of the call.
      kwargs: keyword arguments of the call.

    Returns:
      All arguments as one positional tuple (defaults filled in where keywords were given).

    Example:
      >>> from jaxoverride.adapter_kit import positional_arguments
      >>> positional_arguments(lambda x, y=2: x, (1,), {"y": 3})
      (1, 3)
    """
    if not kwargs:
        return args
    bound = inspect.signature(fun).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.args


def nondiff_positions(
    fun: Callable[..., Any], argnums: Sequence[int], argnames: Sequence[str]
) -> tuple[int, ...]:
    """``nondiff_argnums`` and ``nondiff_argnames`` together, as sorted positions.

    Args:
      fun: the decorated function, whose signature names the arguments.
      argnums: positions of the non-differentiable arguments.
      argnames: names of the non-differentiable arguments.

    Returns:
      The positions, sorted, without repeats.

    Example:
      >>> from jaxoverride.adapter_kit import nondiff_positions
      >>> nondiff_positions(lambda f, x, n: x, (0,), ("n",))
      (0, 2)
    """
    found = set(argnums)
    if argnames:
        names = list(inspect.signature(fun).parameters)
        found |= {names.index(name) for name in argnames}
    return tuple(sorted(found))


def _is_primal(x: Any) -> bool:
    return isinstance(x, CustomVJPPrimal)


def _is_zero(x: Any) -> bool:
    return isinstance(x, SymbolicZero)


def perturbed_leaves(tree: Any) -> list[bool]:
    """Which leaves of a ``symbolic_zeros`` rule's input are being differentiated.

    A ``fwd`` input leaf (``CustomVJPPrimal``) by its ``perturbed`` flag; a JVP tangent
    unless it is a ``SymbolicZero``.

    Args:
      tree: a pytree as a ``symbolic_zeros=True`` ``fwd`` receives its primals, or a JVP
        rule its tangents.

    Returns:
      One bool per leaf, in ``jax.tree.leaves`` order.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
      >>> from jaxoverride.adapter_kit import perturbed_leaves
      >>> zero = SymbolicZero(jax.core.ShapedArray((), jnp.float32))
      >>> perturbed_leaves({"a": CustomVJPPrimal(1.0, True), "b": zero, "c": jnp.ones(())})
      [True, False, True]
    """

    def perturbed(leaf: Any) -> bool:
        if _is_primal(leaf):
            return bool(leaf.perturbed)
        return not _is_zero(leaf)

    is_leaf = lambda x: _is_primal(x) or _is_zero(x)
    return [perturbed(leaf) for leaf in jax.tree.leaves(tree, is_leaf=is_leaf)]


def unwrap_primals(tree: Any) -> Any:
    """The values inside ``CustomVJPPrimal`` wrappers (what a rule without symbolic zeros sees).

    Args:
      tree: a pytree whose leaves may be ``CustomVJPPrimal``.

    Returns:
      The same tree holding the plain values.

    Example:
      >>> from jax.custom_derivatives import CustomVJPPrimal
      >>> from jaxoverride.adapter_kit import unwrap_primals
      >>> unwrap_primals((CustomVJPPrimal(1.0, False), 2.0))
      (1.0, 2.0)
    """
    return jax.tree.map(lambda x: x.value if _is_primal(x) else x, tree, is_leaf=_is_primal)


def _instantiate(x: Any) -> Any:
    if not isinstance(x, SymbolicZero):
        return x
    aval: Any = x.aval  # the tangent's type: float0 for integer values
    return jnp.zeros(aval.shape, aval.dtype)


def instantiate_zeros(tree: Any) -> Any:
    """Concrete zeros for every ``SymbolicZero`` in ``tree`` (for a rule that did not ask).

    Args:
      tree: cotangents or tangents as a ``symbolic_zeros=True`` rule receives them.

    Returns:
      The same tree, each ``SymbolicZero`` replaced by zeros of its shape and dtype.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.custom_derivatives import SymbolicZero
      >>> from jaxoverride.adapter_kit import instantiate_zeros
      >>> instantiate_zeros(SymbolicZero(jax.core.ShapedArray((2,), jnp.float32)))
      Array([0., 0.], dtype=float32)
    """
    return jax.tree.map(_instantiate, tree, is_leaf=_is_zero)


def zero_tangents(tree: Any) -> Any:
    """Zero tangents for the values of ``tree``: ``float0`` zeros for integer values.

    Args:
      tree: a pytree of arrays (or tracers).

    Returns:
      A tree of zeros, each of the tangent type of its value.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxoverride.adapter_kit import zero_tangents
      >>> zero_tangents((jnp.ones(2), jnp.int32(3)))[1].dtype
      dtype([('float0', 'V')])
    """

    def zero(x: Any) -> Any:
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
            return jnp.zeros_like(x)
        return np.zeros(np.shape(x), jax.dtypes.float0)

    return jax.tree.map(zero, tree)


def fwd_output_pair(
    result: Any, fwd: Callable[..., Any], fun: Callable[..., Any], primal_out: Any = None
) -> Any:
    """``result`` of a user's ``fwd`` rule, checked as JAX checks it: a pair, whose first
    element agrees with the primal function's output where that was traced.

    An adapter unpacks ``fwd``'s output before JAX sees it, so it must refuse a non-pair
    with JAX's own error, not Python's unpacking one.

    Args:
      result: what the user's ``fwd`` returned.
      fwd: the user's ``fwd`` rule.
      fun: the user's primal function.
      primal_out: the types (``jax.typeof`` of each leaf) of the primal function's output
        where JAX traced it before the rule (as it does inside a loop), else ``None``.

    Returns:
      ``result``, a list or tuple of length two.

    Raises:
      TypeError: JAX's message for a ``fwd`` rule that produced no pair.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxoverride.adapter_kit import fwd_output_pair
      >>> def f(x): return x
      >>> def f_fwd(x): return x
      >>> fwd_output_pair(jnp.float32(1.0), f_fwd, f)
      Traceback (most recent call last):
      TypeError: Custom VJP fwd rule f_fwd for function f must produce a pair ...
    """
    fwd_name, primal_name = jit_name(fwd), jit_name(fun)
    if isinstance(result, (list, tuple)) and len(result) == 2:
        if primal_out is not None:

            def lead(what: str) -> str:
                return (
                    f"Custom VJP fwd rule {fwd_name} for function {primal_name} must produce "
                    "a pair (list or tuple of length two) where the first element represents "
                    "the primal output (equal to the output of the custom_vjp-decorated "
                    f"function {primal_name}) and the second element represents residuals "
                    "(i.e. values stored from the forward pass for use on the backward pass)"
                )

            check_primal_out(result[0], primal_out, lead, "fwd rule", primal_name)
        return result
    raise TypeError(
        f"Custom VJP fwd rule {fwd_name} for function {primal_name} "
        "must produce a pair (list or tuple of length two) where the first "
        "element represents the primal output (equal to those of the "
        f"custom_vjp-decorated function {primal_name}) and the "
        "second element represents residuals (i.e. values stored from the "
        "forward pass for use on the backward pass), but "
        f"instead of a pair the fwd rule {fwd_name} produced {result}."
    )


def bwd_cotangents(cotangents: Any, primal_tree: Any) -> tuple[Any, ...]:
    """A user's ``bwd`` output, checked as JAX checks it against the primal's arguments.

    An adapter passes its state ahead of the user's arguments, so JAX's own check would
    describe the adapter's structure; this one describes the user's.

    Args:
      cotangents: what the user's ``bwd`` returned.
      primal_tree: the tree structure of the tuple of the primal function's
        differentiable arguments (``nondiff_argnums`` left out). Only the structure: the
        arguments themselves may be tracers that ``bwd``, traced later, must not hold.

    Returns:
      ``cotangents`` as a tuple (JAX accepts a list of the right length).

    Raises:
      TypeError: JAX's message for a ``bwd`` output of the wrong container structure.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxoverride.adapter_kit import bwd_cotangents
      >>> two_arrays = jax.tree.structure((jnp.ones(2), jnp.ones(3)))
      >>> bwd_cotangents([jnp.ones(2), None], two_arrays)[1] is None
      True
      >>> bwd_cotangents((jnp.ones(2),), two_arrays)
      Traceback (most recent call last):
      TypeError: Custom VJP bwd rule must produce an output with the same container ...
    """
    if isinstance(cotangents, list) and len(cotangents) == len(primal_tree.children()):
        cotangents = tuple(cotangents)
    dummy = jax.tree.unflatten(primal_tree, [object()] * primal_tree.num_leaves)
    try:
        if not isinstance(cotangents, tuple):
            raise ValueError
        jax.tree.map(lambda ct, _: ct, cotangents, dummy, is_leaf=lambda x: x is None)
    except ValueError:
        raise TypeError(
            "Custom VJP bwd rule must produce an output with the same container "
            "(pytree) structure as the args tuple of the primal function, "
            "and in particular must produce a tuple of length equal to the "
            "number of arguments to the primal function, but got bwd output "
            f"structure {jax.tree.structure(cotangents)} for primal input structure "
            f"{primal_tree}."
        ) from None
    return cotangents
