"""One walk over an NNX object graph: its Variables, nodes, array attributes and shape.

The walk mirrors ``flax.nnx.graphlib.flatten`` in graph mode (same node registry, same
data/static classification, same sorted attribute order) but keeps the Variable objects
themselves and builds a hashable *fingerprint*: node types, static attributes and the
sharing pattern, with no object identities in it. Two graphs with equal fingerprints
lift to the same flat list of values, position by position.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np
from flax.nnx import Pytree, Variable, variablelib
from flax.nnx.pytreelib import PytreeState
from flax.nnx.variablelib import HijaxVariable

from jaxoverride_nnx._compat import RAW_VALUE, DataElem, StaticElem, graphlib

RAW = Variable.__dict__[RAW_VALUE]
"""The slot descriptor of ``Variable._raw_value``: reads and writes that skip NNX's checks."""
TRACE = Variable.__dict__["_trace_state"]
"""The slot descriptor of ``Variable._trace_state``."""

_ARRAY_LEAVES = (jax.Array, np.ndarray, np.generic, int, float, complex, bool)
_SKIPPED_KEYS = frozenset({"_pytree__nodes", "_pytree__state"})


def is_graph_object(x: Any) -> bool:
    """Whether ``x`` is an NNX graph node (Module, Rngs, nnx.List, ...) or a Variable."""
    kind = type(x)
    return kind in graphlib.GRAPH_REGISTRY or issubclass(kind, (Variable, HijaxVariable))


def liftable(variable: Any) -> bool:
    """Whether a Variable's value is threaded by this adapter.

    ``ref=True`` and ``hijax=True`` Variables already work inside JAX transforms and are
    left alone, as are Variables whose value is not made of arrays and numbers.
    """
    if type(variable) is HijaxVariable or not isinstance(variable, Variable):
        return False
    metadata = variable._var_metadata
    if metadata.get("ref") or metadata.get("hijax"):
        return False
    leaves = jax.tree_util.tree_leaves(RAW.__get__(variable))
    return bool(leaves) and all(isinstance(leaf, _ARRAY_LEAVES) for leaf in leaves)


def holds_state(obj: Any) -> bool:
    """Whether the graph object ``obj`` is, or holds, a Variable this adapter threads (a
    value a raw trace would bake in)."""
    if isinstance(obj, (Variable, HijaxVariable)):
        return liftable(obj)
    return any(liftable(variable) for variable in walk([obj], ["obj"]).variables)


def _static(value: Any) -> Any:
    """A hashable stand-in for a static attribute, for the fingerprint."""
    try:
        hash(value)
    except TypeError:
        return ("<unhashable>", type(value), id(value))
    return value


def _key_text(key: Any) -> str:
    return f"[{key}]" if isinstance(key, int) else f".{key}"


@dataclasses.dataclass(eq=False, slots=True)
class Graph:
    """What one walk found. Indices in the fingerprint refer to the lists here.

    Attributes:
      variables: the lifted Variables, each once, in walk order.
      paths: a readable path for each lifted Variable (its first path).
      nodes: weak references to the graph nodes (Modules, Rngs, ...), each once.
      node_ids: ``id(node)`` -> position in ``nodes``, for identity lookups.
      var_ids: ``id(variable)`` -> position in ``variables``.
      attrs: ``(weak node, name)`` of arrays stored directly as node attributes; they are
        read on every call like Variables, but only read.
      attr_paths: a readable path for each of ``attrs``.
      states: the ``PytreeState`` of every Pytree node, whose trace state is watched for
        attribute changes.
      fingerprint: the hashable shape of the graph.
    """

    variables: list[Variable[Any]] = dataclasses.field(default_factory=list)
    paths: list[str] = dataclasses.field(default_factory=list)
    var_ids: dict[int, int] = dataclasses.field(default_factory=dict)
    nodes: list[Any] = dataclasses.field(default_factory=list)
    node_paths: list[str] = dataclasses.field(default_factory=list)
    node_ids: dict[int, int] = dataclasses.field(default_factory=dict)
    attrs: list[tuple[Any, str]] = dataclasses.field(default_factory=list)
    attr_paths: list[str] = dataclasses.field(default_factory=list)
    states: list[PytreeState] = dataclasses.field(default_factory=list)
    fingerprint: tuple[Any, ...] = ()


class _Walker:
    def __init__(self, graph: Graph, known_vars: Mapping[int, int], known_nodes: Mapping[int, int]):
        self.graph = graph
        self.known_vars = known_vars
        self.known_nodes = known_nodes
        self.prints: list[Any] = []
        self.skipped: set[int] = set()

    def visit(self, value: Any, path: str) -> Any:
        """Walks ``value``; returns its fingerprint entry."""
        graph = self.graph
        if isinstance(value, Variable) or type(value) is HijaxVariable:
            ident = id(value)
            if ident in self.known_vars:
                return ("V-outer", self.known_vars[ident])
            if ident in graph.var_ids:
                return ("V", graph.var_ids[ident])
            if ident in self.skipped:
                return ("X", type(value))
            if not liftable(value):
                self.skipped.add(ident)
                return ("X", getattr(value, "var_type", type(value)))
            graph.var_ids[ident] = len(graph.variables)
            graph.variables.append(value)  # type: ignore[arg-type]  # liftable: a Variable
            graph.paths.append(path)
            return ("V", graph.var_ids[ident], type(value))
        impl = graphlib.get_node_impl(value)
        if impl is None:
            return None
        is_graph_node = type(impl) is graphlib.GraphNodeImpl
        if is_graph_node:
            ident = id(value)
            if ident in self.known_nodes:
                return ("N-outer", self.known_nodes[ident])
            if ident in graph.node_ids:
                return ("N", graph.node_ids[ident])
            graph.node_ids[ident] = len(graph.nodes)
            try:
                graph.nodes.append(weakref.ref(value))
            except TypeError:
                graph.nodes.append(lambda value=value: value)
            graph.node_paths.append(path)
            if isinstance(value, Pytree):
                graph.states.append(value._pytree__state)
        items, aux = impl.flatten(value)
        entries: list[Any] = []
        for key, item in items:
            if is_graph_node and key in _SKIPPED_KEYS:
                continue
            entries.append((key, self._visit_item(value, key, item, path, is_graph_node)))
        return ("N" if is_graph_node else "P", type(value), _static(aux), tuple(entries))

    def _visit_item(self, node: Any, key: Any, item: Any, path: str, is_graph_node: bool) -> Any:
        is_data: bool | None = None
        if isinstance(item, DataElem):
            item, is_data = item.value, True
        elif isinstance(item, StaticElem):
            item, is_data = item.value, False
        if is_data is False:
            return ("S", _static(item))
        child_path = path + _key_text(key)
        if isinstance(item, Variable) or type(item) is HijaxVariable:
            return self.visit(item, child_path)
        if graphlib.get_node_impl(item) is not None:
            return self.visit(item, child_path)
        if variablelib.is_array_ref(item):
            return ("R",)
        if isinstance(item, (jax.Array, np.ndarray)) or is_data:
            if is_graph_node and isinstance(key, str) and isinstance(item, _ARRAY_LEAVES):
                graph = self.graph
                graph.attrs.append((weakref.ref(node), key))
                graph.attr_paths.append(child_path)
                return ("A", len(graph.attrs) - 1)
            # An array inside a plain container is read as a constant, like a closure.
            return ("C", type(item))
        return ("S", _static(item))


def walk(
    roots: Iterable[Any],
    names: Iterable[str],
    *,
    known_vars: Mapping[int, int] | None = None,
    known_nodes: Mapping[int, int] | None = None,
) -> Graph:
    """Walks the graphs of ``roots`` once, sharing Variables and nodes across them.

    Args:
      roots: graph nodes or Variables.
      names: a readable name for each root, used in paths.
      known_vars, known_nodes: ``id -> index`` of Variables and nodes already lifted by
        an enclosing scope; they are referred to, not collected again.

    Returns:
      The ``Graph``.
    """
    graph = Graph()
    walker = _Walker(graph, known_vars or {}, known_nodes or {})
    prints = [walker.visit(root, name) for root, name in zip(roots, names, strict=True)]
    graph.fingerprint = tuple(prints)
    return graph


def node_path(root: Any, target: Any, limit: int = 100_000) -> str | None:
    """The attribute path from ``root`` to ``target`` (a node or Variable), if any."""
    seen: set[int] = set()
    stack: list[tuple[Any, str]] = [(root, "")]
    steps = 0
    while stack and steps < limit:
        value, path = stack.pop()
        steps += 1
        if value is target:
            return path
        if id(value) in seen or isinstance(value, Variable):
            continue
        seen.add(id(value))
        impl = graphlib.get_node_impl(value)
        if impl is None:
            continue
        for key, item in impl.flatten(value)[0]:
            if key in _SKIPPED_KEYS:
                continue
            if isinstance(item, (DataElem, StaticElem)):
                item = item.value
            stack.append((item, path + _key_text(key)))
    return None
