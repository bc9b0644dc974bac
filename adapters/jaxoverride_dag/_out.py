"""``Packed``: traced leaves plus their plan, as one pytree whose plan is static.

A transformed function returns ``Packed(dyn, plan)``; JAX sees only ``dyn`` as outputs and
keeps ``plan`` in the output tree structure, so that even a cache hit of ``jax.jit``
returns the plan of the trace that made the executable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax import tree_util as jtu
from jax.core import Tracer

from jaxoverride_dag._alias import fresh_alias
from jaxoverride_dag._plan import Plan, encode


class Packed:
    """Traced leaves and the plan that rebuilds the tree they came from."""

    __slots__ = ("leaves", "plan")

    def __init__(self, leaves: Sequence[Any], plan: Plan | None):
        self.leaves = leaves
        self.plan = plan

    def unpack(self) -> Any:
        """The tree: fresh nodes, shared where the packed tree shared."""
        assert self.plan is not None
        return self.plan.decode(self.leaves)

    def __repr__(self) -> str:
        return f"Packed({self.leaves!r}, {self.plan!r})"


jtu.register_pytree_node(
    Packed,
    lambda packed: (packed.leaves, packed.plan),
    lambda plan, leaves: Packed(tuple(leaves), plan),
)


def pack(tree: Any, label: str) -> Packed:
    """``tree`` encoded; see ``_plan.encode``."""
    plan, dyn = encode(tree, label)
    return Packed(tuple(dyn), plan)


def packing_outputs(
    fun: Callable[..., Any], plan: Plan, what: str, spread: Callable[[Plan], Sequence[Any]]
) -> tuple[Callable[..., Packed], Packed]:
    """``(traced, carrier)``: ``traced`` calls ``fun`` on the inputs decoded by ``plan``
    and returns its outputs packed (labelled ``what``); ``carrier`` is an empty ``Packed``
    that each trace fills with ``spread(out_plan)``, the per-leaf ``out_axes`` or
    ``out_specs`` that ``vmap`` and ``shard_map`` read only after tracing."""
    carrier = Packed((), None)

    def traced(*inputs: Any) -> Packed:
        inner_args, inner_kwargs = plan.decode_inside(inputs)
        out_plan, out_dyn = encode(fun(*inner_args, **inner_kwargs), what)
        carrier.leaves, carrier.plan = spread(out_plan), out_plan
        return Packed(tuple(out_dyn), out_plan)

    return traced, carrier


def unforward(outputs: Sequence[Any], inputs: Sequence[Any]) -> Sequence[Any]:
    """``outputs``, with a fresh alias in place of any concrete input array among them (run
    eagerly, JAX hands back an input returned unchanged; tracers are left alone)."""
    given = {id(x) for x in inputs if isinstance(x, jax.Array) and not isinstance(x, Tracer)}
    if not given or not any(id(leaf) in given for leaf in outputs):
        return outputs
    return tuple(fresh_alias(leaf) if id(leaf) in given else leaf for leaf in outputs)


def unforward_tree(tree: Any, inputs: Sequence[Any]) -> Any:
    """``unforward`` over the leaves of any pytree (``Packed`` included)."""
    leaves, treedef = jtu.tree_flatten(tree)
    fresh = unforward(leaves, inputs)
    return tree if fresh is leaves else treedef.unflatten(fresh)
