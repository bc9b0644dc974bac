"""JAX's checks of a user's custom rule output, made where an adapter's lifting hides them.

An adapter that lifts its state into a custom rule wraps the user's rule: it unpacks the
user's JVP output before JAX sees it, and puts its state's cotangent ahead of the user's
in ``bwd``'s output. JAX's own checks would then fail on Python's unpacking, describe the
adapter's structure, or count the adapter's argument in an index. These checks see the
user's part only, and raise JAX's exception types with JAX's wording.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from jaxoverride._compat import jit_name


def jvp_output_pair(
    result: Any, jvp: Callable[..., Any], fun: Callable[..., Any], primal_out: Any = None
) -> Any:
    """``result`` of a user's JVP rule, checked as JAX checks it: a pair of equal trees,
    whose first element agrees with the primal function's output where that was traced.

    Args:
      result: what the user's JVP rule returned.
      jvp: the user's JVP rule.
      fun: the user's primal function.
      primal_out: the types (``jax.typeof`` of each leaf) of the primal function's output
        where JAX traced it before the rule (as it does inside a loop), else ``None``.

    Returns:
      ``result``, a list or tuple of length two whose elements have one tree structure.

    Raises:
      TypeError: JAX's message for a JVP rule that produced no pair, a pair of different
        container structures, or a primal output that is not the function's.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxoverride.adapter_kit import jvp_output_pair
      >>> def f(x): return (x,)
      >>> def f_jvp(primals, tangents): return f(*primals), [1.0, 2.0]
      >>> jvp_output_pair((1.0, 2.0), f_jvp, f)
      (1.0, 2.0)
      >>> jvp_output_pair(((1.0,), [1.0, 2.0]), f_jvp, f)
      Traceback (most recent call last):
      TypeError: Custom JVP rule f_jvp for function f must produce primal and tangent ...
    """
    jvp_name, primal_name = jit_name(jvp), jit_name(fun)
    if not isinstance(result, (list, tuple)) or len(result) != 2:
        raise TypeError(
            f"Custom JVP rule {jvp_name} for function {primal_name} "
            "must produce a pair (list or tuple of length two) representing "
            f"primal and tangent outputs, but got {result}."
        )
    out_tree, tangent_tree = (jax.tree.structure(part) for part in result)
    if out_tree != tangent_tree:
        raise TypeError(
            f"Custom JVP rule {jvp_name} for function {primal_name} must "
            "produce primal and tangent outputs with equal container (pytree) "
            f"structures, but got {out_tree} and {tangent_tree} respectively."
        )
    if primal_out is not None:

        def lead(what: str) -> str:
            particular = (
                "of the same container/pytree structure"
                if what == "structure"
                else "with leaves of the same shape/dtype"
            )
            return (
                f"Custom JVP rule {jvp_name} for function {primal_name} must produce a pair "
                "(list or tuple of length two) where the first element represents the "
                "primal output (equal in value to the output of the custom_jvp-decorated "
                f"function {primal_name}, and in particular {particular})"
            )

        check_primal_out(result[0], primal_out, lead, "JVP rule", primal_name)
    return result


def check_primal_out(
    out: Any, expected: Any, lead: Callable[[str], str], rule: str, primal_name: str
) -> None:
    """JAX's check of a rule's primal output against the traced primal function's.

    ``lead(what)`` is the message up to ``", but instead"``, where ``what`` is what had to
    agree; ``rule`` names the rule's output in the rest (``"fwd rule"``, ``"JVP rule"``).
    """
    types = [jax.typeof(leaf) for leaf in jax.tree.leaves(out)]
    expected_types, expected_tree = jax.tree.flatten(expected)
    tree = jax.tree.structure(out)
    same_tree = tree == expected_tree
    if same_tree and all(
        (a.shape, a.dtype) == (b.shape, b.dtype)  # type: ignore[attr-defined]
        for a, b in zip(types, expected_types, strict=True)
    ):
        return
    shown, shown_expected = (
        str(jax.tree.unflatten(t, [a.str_short() for a in avals])).replace("'", "")
        for t, avals in ((tree, types), (expected_tree, expected_types))
    )
    what, had = (
        ("structure", "container/pytree structure")
        if not same_tree
        else ("shapes", "shapes/dtypes of")
    )
    kind = "custom_jvp" if rule == "JVP rule" else "custom_vjp"
    raise TypeError(
        f"{lead(what)}, but instead the {rule} output's first element had {had}:\n"
        f"    {shown}\n"
        f"while the {kind}-decorated function {primal_name} had output {had}:\n"
        f"    {shown_expected}{'' if same_tree else '.'}"
    )


def argument_types(arguments: Any) -> Any:
    """The types of a primal function's differentiable arguments, for ``check_bwd_types``.

    Only the types are kept: the arguments may be tracers that ``bwd``, traced later,
    must not hold.

    Args:
      arguments: the tuple of the primal function's differentiable arguments.

    Returns:
      The same tree with a ``jax.ShapeDtypeStruct`` (weak type kept) for each leaf.

    Example:
      >>> from jaxoverride.adapter_kit import argument_types
      >>> argument_types((1.0,))
      (ShapeDtypeStruct(shape=(), dtype=float32, weak_type=True),)
    """

    def type_of(leaf: Any) -> jax.ShapeDtypeStruct:
        aval = jax.typeof(leaf)
        weak = bool(getattr(aval, "weak_type", False))
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=weak)  # type: ignore[attr-defined]

    return jax.tree.map(type_of, arguments)


def check_bwd_types(
    cotangents: tuple[Any, ...], types: Any, fun: Callable[..., Any] | None = None
) -> None:
    """Checks a user's ``bwd`` cotangents against the primal's argument types, as JAX does.

    A cotangent whose shape or dtype differs from its argument's is checked again by
    JAX's own ``custom_vjp`` on those types alone, so that the error (if JAX refuses it)
    is JAX's, with the index of the user's argument. Nothing is run where they agree.

    Args:
      cotangents: the user's ``bwd`` output, as ``bwd_cotangents`` returned it.
      types: ``argument_types`` of the differentiable arguments.
      fun: the user's primal function, which JAX 0.11's message names with its source
        location ("attached to f at file.py:12"); without it, the message names a
        function of this module.

    Raises:
      ValueError: JAX's message for a cotangent of the wrong type.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxoverride.adapter_kit import argument_types, check_bwd_types
      >>> types = argument_types((jnp.ones(3), jnp.ones(4)))
      >>> check_bwd_types((jnp.zeros(3), None), types)
      >>> check_bwd_types((jnp.zeros(3), jnp.zeros(3)), types)
      Traceback (most recent call last):
      ValueError: Custom VJP bwd rule ...must produce an output with the same ...
    """
    pairs: list[tuple[Any, Any]] = []

    def pair(cotangent: Any, subtree: Any) -> None:
        if cotangent is not None:
            pairs.extend((cotangent, leaf) for leaf in jax.tree.leaves(subtree))

    jax.tree.map(pair, cotangents, types, is_leaf=lambda x: x is None)
    if all(_agrees(cotangent, leaf) for cotangent, leaf in pairs):
        return
    replayed = jax.custom_vjp(_standing_in_for(fun))
    shapes = jax.tree.map(_shape_of, cotangents, is_leaf=lambda x: isinstance(x, SymbolicZero))
    replayed.defvjp(lambda *args: (0.0, None), lambda _, g: jax.tree.map(_zeros, shapes))
    jax.eval_shape(lambda *args: jax.vjp(replayed, *args)[1](0.0), *types)


def _standing_in_for(fun: Callable[..., Any] | None) -> Callable[..., Any]:
    """The replay's primal function, which JAX 0.11's message names as the user's ``fun``.

    JAX finds a function's name and location through ``inspect.unwrap``, and its
    signature through ``inspect.signature``, which stops at ``__signature__``: the
    replay takes the differentiable arguments alone, whatever ``fun``'s parameters.
    """

    def primal(*args: Any) -> float:
        return 0.0

    if fun is not None:
        primal.__signature__ = inspect.signature(primal)  # type: ignore[attr-defined]
        primal.__wrapped__ = fun  # type: ignore[attr-defined]
    return primal


def _agrees(cotangent: Any, leaf: jax.ShapeDtypeStruct) -> bool:
    if isinstance(cotangent, SymbolicZero):
        aval = cotangent.aval
        return aval.shape == leaf.shape  # type: ignore[attr-defined]
    return jnp.shape(cotangent) == leaf.shape and jnp.result_type(cotangent) == leaf.dtype


def _shape_of(cotangent: Any) -> Any:
    if isinstance(cotangent, SymbolicZero):
        return cotangent
    return jax.ShapeDtypeStruct(jnp.shape(cotangent), jnp.result_type(cotangent))


def _zeros(shape: Any) -> Any:
    if isinstance(shape, SymbolicZero):
        return shape
    return jnp.zeros(shape.shape, shape.dtype)
