"""``tree_map`` that maps each distinct leaf once and rebuilds with the same sharing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxoverride_dag._plan import encode


def tree_map(f: Callable[[Any], Any], tree: Any) -> Any:
    """Applies ``f`` to every array and scalar leaf, keeping relative identity.

    Unlike ``jax.tree_util.tree_map`` (whose result shares nothing), it calls ``f`` once
    per distinct array (and per Python scalar) and builds one new node per distinct node,
    so the result is shared where ``tree`` is; static leaves are kept as they are.

    Args:
      f: the function to apply to each traced leaf.
      tree: any pytree; nodes and arrays may be shared.

    Returns:
      A fresh tree with ``f`` applied, shared like ``tree``.

    Example:
      >>> import jax.numpy as jnp, jaxoverride_dag as dag
      >>> w = jnp.ones(2)
      >>> out = dag.tree_map(lambda x: x * 2, {"a": w, "b": w, "name": "tied"})
      >>> out["a"] is out["b"], out["name"], out["a"].tolist()
      (True, 'tied', [2.0, 2.0])
    """
    plan, dyn = encode(tree, "tree_map input")
    return plan.decode([f(leaf) for leaf in dyn])
