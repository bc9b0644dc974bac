"""What each object in a pytree is to the adapter: a node, an array, a scalar or static data.

The kind depends only on the object's type, so it is cached per type: the hot paths pay
one dict lookup per object.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax import tree_util as jtu
from jax.core import Tracer

# Kinds, ordered so that ``kind >= ARRAY`` means "has identity worth tracking".
IDENTITYLESS = 0  # a node without identity: None, an empty tuple
SCALAR = 1  # a Python bool/int/float/complex: a traced value, never shared
STATIC = 2  # anything else that is not a node or an array: static data
ARRAY = 3  # an array-like leaf: traced, shared by identity
NODE = 4  # a pytree node: rebuilt, shared by identity

_ARRAY_TYPES: tuple[type, ...] = (
    jax.Array,
    Tracer,
    np.ndarray,
    np.generic,
    jax.ShapeDtypeStruct,
)

KINDS: dict[type, int] = {
    type(None): IDENTITYLESS,
    bool: SCALAR,
    int: SCALAR,
    float: SCALAR,
    complex: SCALAR,
    tuple: NODE,
    list: NODE,
    dict: NODE,
}


# The types of traced leaves seen so far, for a one-call membership test of a whole call.
DYNAMIC_TYPES: set[type] = {bool, int, float, complex}


def _classify(x: Any) -> int:
    t = type(x)
    if jtu.default_registry.flatten_one_level(x) is not None:
        return IDENTITYLESS if t is type(None) else NODE
    if issubclass(t, _ARRAY_TYPES) or hasattr(t, "__jax_array__"):
        return ARRAY
    # JAX traces subclasses of the Python scalars as scalars too: an IntEnum, and the
    # typed scalars (``TypedInt``...) that ``grad(allow_int=True)`` hands an integer
    # argument as.
    if issubclass(t, (bool, int, float, complex)):
        return SCALAR
    return STATIC


def _learn(x: Any) -> int:
    k = _classify(x)
    if k in (ARRAY, SCALAR):
        DYNAMIC_TYPES.add(type(x))
    KINDS[type(x)] = k
    return k


def kind(x: Any) -> int:
    """The kind of ``x``; see the constants of this module."""
    k = KINDS.get(type(x))
    return _learn(x) if k is None else k


def kind_of_node(x: Any) -> int:
    """``kind(x)``, refined per object: an empty tuple (or namedtuple) has no identity."""
    k = KINDS.get(type(x))
    if k is None:
        k = _learn(x)
    if k == NODE and isinstance(x, tuple) and not x:
        return IDENTITYLESS
    return k
