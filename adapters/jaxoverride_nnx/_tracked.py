"""The tracked set: which Variables neutral calls thread, walked once per ``track`` scope.

A ``Tracked`` (in the contextvar ``ACTIVE``) holds the lifted Variables in a fixed order,
the graph they came from and a ``TrackKey`` that ``jit`` caches on. The scope watches its
modules' ``PytreeState`` trace states: setting an attribute of a tracked module bumps a
global epoch, and the next neutral call walks the graph again. Inside a lifted call the
contextvar holds a frozen copy that never re-walks.
"""

from __future__ import annotations

import contextvars
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from flax.nnx import tracers
from flax.nnx.pytreelib import PytreeState

from jaxoverride_nnx import _stale_reads
from jaxoverride_nnx._graph import RAW, TRACE, Graph, walk

_epoch = 0  # the structure epoch: bumped whenever an attribute of a tracked node is set
_last_death = 0


def deaths() -> int:
    """How many tracked roots have been garbage collected so far (for cache pruning)."""
    return _last_death


def _note_death(_: object) -> None:
    global _last_death
    try:
        _last_death += 1
    except TypeError:  # interpreter shutdown: module globals are already cleared
        pass


class _Watch(tracers.TraceState):
    """A tracked node's trace state: valid exactly where the original is, and every
    successful check (an attribute about to be set) bumps the structure epoch."""

    __slots__ = ()

    def is_valid(self) -> bool:
        if self._jax_trace == tracers.current_jax_trace():
            global _epoch
            _epoch += 1
            return True
        return False


_hook_lock = threading.Lock()
# id(PytreeState) -> [state, original trace state, holders]
_hooked: dict[int, list[Any]] = {}


def _hook(states: Sequence[PytreeState]) -> list[int]:
    taken = []
    with _hook_lock:
        for state in states:
            entry = _hooked.get(id(state))
            if entry is None:
                original = state._trace_state
                watch = object.__new__(_Watch)
                watch._jax_trace = original._jax_trace
                state._trace_state = watch
                _hooked[id(state)] = entry = [state, original, 0]
            entry[2] += 1
            taken.append(id(state))
    return taken


def _unhook(taken: Sequence[int]) -> None:
    with _hook_lock:
        for ident in reversed(taken):
            entry = _hooked[ident]
            entry[2] -= 1
            if entry[2] == 0:
                del _hooked[ident]
                state, original = entry[0], entry[1]
                if isinstance(state._trace_state, _Watch):
                    state._trace_state = original


class TrackKey:
    """Hashable identity of a tracked set: root identities plus the graph's fingerprint.

    It holds no strong reference to any module, so caches keyed on it keep nothing alive.
    """

    __slots__ = ("__weakref__", "_hash", "fingerprint", "ids", "refs")

    def __init__(self, ids: tuple[int, ...], refs: tuple[Callable[[], Any], ...], fingerprint: Any):
        self.ids = ids
        self.refs = refs
        self.fingerprint = fingerprint
        self._hash = hash((ids, fingerprint))

    def alive(self) -> bool:
        return all(ref() is not None for ref in self.refs)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, TrackKey)
            and self._hash == other._hash
            and self.ids == other.ids
            and self.fingerprint == other.fingerprint
        )

    def __repr__(self) -> str:
        return f"<TrackKey of {len(self.ids)} root(s)>"


def _ref(obj: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(obj, _note_death)
    except TypeError:  # Variables cannot be weakly referenced
        return lambda: obj


class Tracked:
    """The Variables that neutral calls thread here, and how to find them again.

    Attributes:
      variables: lifted Variables, each once (tracked ones first, then those of graph
        nodes passed as arguments to an enclosing neutral call).
      graph: the walk of the tracked modules; ``extra`` the walk of argument nodes.
      attrs: ``(weak node, name)`` of array attributes, read like Variables (read only).
      key: the ``TrackKey`` that ``jit`` caches its traces on.
      epoch: the structure epoch this was walked at; ``owner`` re-walks it when stale.
    """

    __slots__ = ("attrs", "epoch", "extra", "frozen", "graph", "key", "owner", "variables")

    def __init__(
        self, graph: Graph, key: TrackKey, owner: Scope | None, extra: Graph | None = None
    ):
        self.graph = graph
        self.extra = extra
        self.key = key
        self.owner = owner
        self.epoch = _epoch
        if extra is None:
            self.variables = graph.variables
            self.attrs = graph.attrs
        else:
            self.variables = graph.variables + extra.variables
            self.attrs = graph.attrs + extra.attrs
        self.frozen: Tracked = self if owner is None else Tracked(graph, key, None, extra)

    # -- lookups --------------------------------------------------------------------
    def var_index(self, obj: Any) -> int | None:
        return self._index(obj, "var_ids", "variables")

    def node_index(self, obj: Any) -> int | None:
        return self._index(obj, "node_ids", "nodes")

    def node(self, index: int) -> Any:
        return self._entry(index, "nodes")()

    def path(self, index: int) -> str:
        return self._entry(index, "paths")

    def node_path(self, index: int) -> str:
        return self._entry(index, "node_paths")

    def _index(self, obj: Any, ids: str, field: str) -> int | None:
        """Where ``obj`` stands in the graph's ``field`` list, then in the extra's (after
        the graph's): its ``ids`` map; None if in neither."""
        index = getattr(self.graph, ids).get(id(obj))
        if index is None and self.extra is not None:
            index = getattr(self.extra, ids).get(id(obj))
            if index is not None:
                index += len(getattr(self.graph, field))
        return index

    def _entry(self, index: int, field: str) -> Any:
        """Entry ``index`` of the graph's ``field`` list, then of the extra's."""
        entries = getattr(self.graph, field)
        if index < len(entries):
            return entries[index]
        assert self.extra is not None
        return getattr(self.extra, field)[index - len(entries)]

    def contains(self, obj: Any) -> bool:
        # The missing-adapter check asks this at every checked call: dict look-ups only.
        key = id(obj)
        graph, extra = self.graph, self.extra
        if key in graph.node_ids or key in graph.var_ids:
            return True
        return extra is not None and (key in extra.node_ids or key in extra.var_ids)

    # -- values ---------------------------------------------------------------------
    def read(self) -> list[Any]:
        """The current values: every lifted Variable's raw value, then array attributes."""
        values = list(map(RAW.__get__, self.variables))
        if self.attrs:
            values += [getattr(ref(), name) for ref, name in self.attrs]
        return values

    def derive(self, objects: Sequence[Any], names: Sequence[str]) -> Tracked:
        """A frozen view that also lifts the graph nodes ``objects`` (call arguments)."""
        extra = walk(
            objects,
            names,
            known_vars=self._known("var_ids", "variables"),
            known_nodes=self._known("node_ids", "nodes"),
        )
        key = TrackKey(self.key.ids, self.key.refs, (self.key.fingerprint, extra.fingerprint))
        if self.extra is None:
            return Tracked(self.graph, key, None, extra)
        # Nested argument nodes: flatten both walks into one graph.
        merged = Graph()
        for part in (self.extra, extra):
            offset_v, offset_n = len(merged.variables), len(merged.nodes)
            for field in ("variables", "paths", "nodes", "node_paths", "attrs", "attr_paths"):
                getattr(merged, field).extend(getattr(part, field))
            merged.var_ids.update({k: v + offset_v for k, v in part.var_ids.items()})
            merged.node_ids.update({k: v + offset_n for k, v in part.node_ids.items()})
        return Tracked(self.graph, key, None, merged)

    def _known(self, ids: str, field: str) -> dict[int, int]:
        """The graph's ``ids`` map and the extra's, as ``_index`` reads them, in one."""
        known = dict(getattr(self.graph, ids))
        if self.extra is not None:
            offset = len(getattr(self.graph, field))
            known.update({k: v + offset for k, v in getattr(self.extra, ids).items()})
        return known


def empty() -> Tracked:
    """A view with nothing tracked, to derive argument views from."""
    graph = walk((), ())
    return Tracked(graph, TrackKey((), (), ()), None)


ACTIVE: contextvars.ContextVar[Tracked | None] = contextvars.ContextVar(
    "jaxoverride_nnx_tracked", default=None
)
_stale_reads.tracked_now = ACTIVE.get
# The JAX trace (Flax's opaque trace state) where the innermost ``track`` scope was
# entered. A module whose Variables were created in another trace was made inside a
# transform running within the scope (an NNX transform's copy of a tracked module): see
# ``made_inside_a_transform``.
ENTRY_TRACE: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "jaxoverride_nnx_entry_trace", default=None
)


def made_inside_a_transform(variable: Any) -> bool:
    """Whether ``variable`` was created inside a trace that started within the innermost
    ``track`` scope (``nnx.grad`` and ``nnx.jit`` pass their function such copies)."""
    entry = ENTRY_TRACE.get()
    state = TRACE.__get__(variable)
    return entry is not None and isinstance(state, tracers.TraceState) and state.jax_trace != entry


def current() -> Tracked | None:
    """The tracked set here, re-walked first if a tracked module's attributes changed."""
    tracked = ACTIVE.get()
    if tracked is not None and tracked.epoch != _epoch and tracked.owner is not None:
        tracked.owner.refresh(tracked)
    return tracked


class Scope:
    """One entered ``track``: its roots (weakly), hooks and the ``Tracked`` it published.

    ``hooked`` holds the trace-state watches, ``read_checks`` the Variables' read hooks
    (``_stale_reads``); ``close`` takes both off.
    """

    __slots__ = ("hooked", "names", "read_checks", "refs")

    def __init__(self, roots: Sequence[Any]):
        self.refs = tuple(_ref(root) for root in roots)
        counts: dict[str, int] = {}
        names = []
        for root in roots:
            name = type(root).__name__
            counts[name] = counts.get(name, 0) + 1
            names.append(name if counts[name] == 1 else f"{name}#{counts[name]}")
        self.names = tuple(names)
        self.hooked: list[int] = []
        self.read_checks: list[int] = []

    def roots(self) -> list[Any]:
        """The roots that are still alive."""
        return [root for ref in self.refs if (root := ref()) is not None]

    def build(self) -> Tracked:
        pairs = [(ref(), name) for ref, name in zip(self.refs, self.names, strict=True)]
        pairs = [(root, name) for root, name in pairs if root is not None]
        roots = [root for root, _ in pairs]
        graph = walk(roots, [name for _, name in pairs])
        self.hooked += _hook(graph.states)
        self.read_checks += _stale_reads.hook(graph.variables)
        key = TrackKey(
            tuple(map(id, roots)),
            tuple(ref for ref in self.refs if ref() is not None),
            graph.fingerprint,
        )
        return Tracked(graph, key, self)

    def refresh(self, tracked: Tracked) -> None:
        """Re-walks after a structural change and updates ``tracked`` in place."""
        fresh = self.build()
        for name in Tracked.__slots__:
            if name != "frozen":
                setattr(tracked, name, getattr(fresh, name))
        tracked.frozen = Tracked(fresh.graph, fresh.key, None)

    def close(self) -> None:
        try:
            _stale_reads.unhook(self.read_checks)
        finally:
            self.read_checks = []
            _unhook(self.hooked)
            self.hooked = []
