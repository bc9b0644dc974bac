"""Short, readable descriptions of arguments and implementations for the log."""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxoverride.adapter_kit import JAX_IMPLS

# Containers longer than this show their first items and a count of the rest: a Haiku
# params dict of a deep model would otherwise fill the screen on every call.
MAX_ITEMS = 6

# Arguments of the JAX functions that configure the call rather than carry data: shown as
# ``name=value`` when they differ from JAX's default, never as shapes.
_OPTIONS = frozenset(
    {"length", "reverse", "unroll", "_split_transpose", "batch_size", "has_aux", "reduce_axes"}
)

_DTYPE = re.compile(r"^(bfloat|float|uint|int|complex)(\d+)$")
_PREFIX = {"bfloat": "bf", "float": "f", "uint": "u", "int": "i", "complex": "c"}


def short_dtype(dtype: Any) -> str:
    """``float32`` -> ``f32``, ``bfloat16`` -> ``bf16``; other dtypes keep their name."""
    try:
        name = np.dtype(dtype).name
    except TypeError:  # extended dtypes such as PRNG keys
        return str(dtype)
    match = _DTYPE.match(name)
    return _PREFIX[match.group(1)] + match.group(2) if match else name


def describe_leaf(leaf: Any) -> str:
    """``f32[3,4]`` for anything with a shape and a dtype (arrays, tracers); else its type."""
    shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
    if isinstance(shape, tuple) and dtype is not None:
        return f"{short_dtype(dtype)}[{','.join(str(dim) for dim in shape)}]"
    return type(leaf).__name__


def _items(pieces: list[str]) -> str:
    if len(pieces) > MAX_ITEMS:
        pieces = [*pieces[:MAX_ITEMS], f"+{len(pieces) - MAX_ITEMS} more"]
    return ", ".join(pieces)


def describe_tree(tree: Any) -> str:
    """The leaves of a pytree, in its builtin containers: ``(f32[3], {w: f32[2,2]})``."""
    if tree is None:
        return "None"
    if isinstance(tree, dict):
        return "{" + _items([f"{key}: {describe_tree(value)}" for key, value in tree.items()]) + "}"
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a namedtuple
        return f"{type(tree).__name__}(" + _items([describe_tree(v) for v in tree]) + ")"
    if isinstance(tree, tuple):
        return (
            "(" + _items([describe_tree(item) for item in tree]) + (",)" if len(tree) == 1 else ")")
        )
    if isinstance(tree, list):
        return "[" + _items([describe_tree(item) for item in tree]) + "]"
    leaves = jax.tree_util.tree_leaves(tree)
    if len(leaves) == 1 and leaves[0] is tree:
        return describe_leaf(tree)
    # A registered node of another kind (an Equinox module, a dataclass pytree): its type
    # and its leaves, not its repr, which may be long or fail on tracers.
    return f"{type(tree).__name__}(" + _items([describe_leaf(leaf) for leaf in leaves]) + ")"


def _bound(name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """``(parameter, value)`` pairs of a call of the JAX function ``name``, defaults dropped."""
    try:
        signature = inspect.signature(JAX_IMPLS[name])
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError):  # let JAX report a bad call; describe what was passed
        return [("", arg) for arg in args] + list(kwargs.items())
    pairs = []
    for parameter, value in bound.arguments.items():
        kind = signature.parameters[parameter].kind
        default = signature.parameters[parameter].default
        if kind is inspect.Parameter.VAR_POSITIONAL:
            pairs += [("", item) for item in value]
        elif kind is inspect.Parameter.VAR_KEYWORD:
            pairs += list(value.items())
        elif default is inspect.Parameter.empty or value is not default:
            pairs.append((parameter, value))
    return pairs


def describe_call(name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
    """The data arguments of a neutral call as shapes, its non-default options as values.

    Functions (a scan body, the branches of a cond) are left out: the name of the call
    already says what they are.
    """
    pieces = []
    for parameter, value in _bound(name, args, kwargs):
        if callable(value) and not hasattr(value, "shape"):
            continue
        if parameter in _OPTIONS:
            if value is not None:
                pieces.append(f"{parameter}={value!r}")
        else:
            pieces.append(describe_tree(value))
    return ", ".join(pieces)


def describe_arguments(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
    """The arguments of a call of a transformed function, as shapes."""
    pieces = [describe_tree(arg) for arg in args]
    pieces += [f"{key}={describe_tree(value)}" for key, value in kwargs.items()]
    return ", ".join(pieces)


def describe_options(kwargs: Mapping[str, Any], args: tuple[Any, ...]) -> str:
    """The options given to a transform when it is built, such as ``static_argnums=1``."""
    return ", ".join([repr(arg) for arg in args] + [f"{k}={v!r}" for k, v in kwargs.items()])


def function_name(fun: Any) -> str:
    """A readable name for a function given to a transform or a loop."""
    while isinstance(fun, functools.partial) and not hasattr(fun, "__name__"):
        fun = fun.func
    for attribute in ("__name__", "__qualname__"):
        value = getattr(fun, attribute, None)
        if isinstance(value, str):
            return value
    return type(fun).__name__
