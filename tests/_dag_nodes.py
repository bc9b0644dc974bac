"""Shared by the tests of ``jaxoverride_dag``: a mutable pytree node with identity, and
a call counter for the bodies whose traces they count."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax


def counting(fun: Callable[..., Any]) -> tuple[Callable[..., Any], list[int]]:
    """``fun`` as a function that appends to a list at each call, and that list: under a
    jit, Python runs the body once per trace, so ``len(calls)`` counts the traces.

    Example:
      >>> body, calls = counting(lambda x: x)
      >>> body(1), len(calls)
      (1, 1)
    """
    calls: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return fun(*args, **kwargs)

    return counted, calls


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
