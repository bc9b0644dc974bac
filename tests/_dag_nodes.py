"""A mutable pytree node with identity, shared by the tests of ``jaxoverride_dag``."""

from __future__ import annotations

from typing import Any

import jax


@jax.tree_util.register_pytree_node_class
class Node:
    """A mutable custom pytree node with one child, ``value``, like a stateful module.

    Bodies may update it in place, and every alias sees the update; losing a tie between
    two nodes is an error under the DAG adapter.

    Example:
      >>> node = Node(1.0)
      >>> jax.tree_util.tree_leaves({"a": node, "b": node})
      [1.0, 1.0]
    """

    def __init__(self, value: Any):
        self.value = value

    def tree_flatten(self) -> tuple[tuple[Any], None]:
        return (self.value,), None

    @classmethod
    def tree_unflatten(cls, aux: None, children: tuple[Any]) -> Node:
        return cls(*children)
