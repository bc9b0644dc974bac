"""Which tracked values a traced function is given: only those of the modules it touches.

A loop, branch, ``jit`` or custom rule under ``track`` threads the tracked Variables'
values through JAX as inputs and outputs. A module that the function never touches must
not be among them: with nothing to do, the jaxpr must be JAX's. Which modules a function
touches is known only once it has been traced, so the function is traced with the values
of the modules it is *believed* to touch (none, at first, or what its last trace found)
and every other tracked Variable holds a ``Probe`` meanwhile. A probe knows its shape and
dtype, and any other use of it (reading it into a computation, indexing, writing into it,
passing it to JAX) raises ``NeedsState``, which aborts JAX's trace. The caller (a
``Threads`` slot) then adds the whole module that the probe stands for and traces again;
a write that replaces a probe does the same. So a module is threaded if and only if the
function uses it, and a function that uses its module costs one more (aborted) trace the
first time only: the slot keeps what it found.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import jax
import numpy as np

from jaxoverride_nnx._graph import is_graph_object
from jaxoverride_nnx._scope import Tracked
from jaxoverride_nnx._stale_reads import check_lifted

T = TypeVar("T")


class NeedsState(BaseException):
    """A probe was used: the running function touches a tracked value it was not given.

    A ``BaseException``, so that user code that catches ``Exception`` cannot swallow it
    (it is never seen outside the adapter).
    """

    def __init__(self, owner: object, index: int):
        super().__init__(owner, index)
        self.owner = owner
        self.index = index


def _raise(self: Probe, *args: Any, **kwargs: Any) -> Any:
    raise NeedsState(self._owner, self._index)


class Probe:
    """Stands for a tracked value that the running function was not given (see module)."""

    __slots__ = ("_index", "_owner", "dtype", "shape")

    def __init__(self, owner: object, index: int, like: Any):
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "shape", tuple(np.shape(like)))
        object.__setattr__(self, "dtype", getattr(like, "dtype", None))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    def __getattr__(self, name: str) -> Any:
        raise NeedsState(self._owner, self._index)

    __setattr__ = _raise
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"<tracked value {self._index}, not threaded>"


# ``__jax_array__``, ``__array__`` and the like are left to ``__getattr__``: JAX and NumPy
# look them up with ``hasattr``, which then raises ``NeedsState`` instead of answering.
_USES = (
    "__getitem__ __setitem__ __delitem__ __len__ __iter__ "
    "__contains__ __bool__ __float__ __int__ __index__ __complex__ __call__ __eq__ __ne__ "
    "__lt__ __le__ __gt__ __ge__ __neg__ __pos__ __abs__ __invert__ __round__ __format__ "
    "__dlpack__"
)
_OPERATORS = "add sub mul matmul truediv floordiv mod divmod pow lshift rshift and xor or"
for _name in _USES.split() + [
    f"__{prefix}{op}__" for op in _OPERATORS.split() for prefix in ("", "r", "i")
]:
    setattr(Probe, _name, _raise)


def is_probe(x: Any) -> bool:
    return type(x) is Probe


def probe_for(owner: object, index: int, value: Any) -> Any:
    """A probe in place of ``value`` (a pytree of arrays: one probe per leaf)."""
    if isinstance(value, (jax.Array, np.ndarray, np.generic, int, float, complex, bool)):
        return Probe(owner, index, value)
    return jax.tree.map(lambda leaf: Probe(owner, index, leaf), value)


def check_given(values: Sequence[Any]) -> None:
    """Raises ``NeedsState`` if one of ``values`` (about to be threaded) is a probe."""
    for value in values:
        for leaf in jax.tree.leaves(value):
            if type(leaf) is Probe:
                raise NeedsState(leaf._owner, leaf._index)


def _paths(tracked: Tracked) -> list[str]:
    """A path for each tracked value: the Variables', then the array attributes'."""
    graphs = [tracked.graph] if tracked.extra is None else [tracked.graph, tracked.extra]
    return [p for g in graphs for p in g.paths] + [p for g in graphs for p in g.attr_paths]


def _groups(tracked: Tracked) -> list[int]:
    """The module (root, or argument) each tracked value belongs to, by its path."""
    names: dict[str, int] = {}
    return [names.setdefault(_root(path), len(names)) for path in _paths(tracked)]


def _root(path: str) -> str:
    cut = min((i for i in (path.find("."), path.find("[")) if i >= 0), default=len(path))
    return path[:cut]


def module_of(tracked: Tracked, index: int) -> frozenset[int]:
    """The indices of the tracked values of the module that value ``index`` belongs to."""
    groups = _groups(tracked)
    return frozenset(i for i, g in enumerate(groups) if g == groups[index]) | {index}


def referenced(tracked: Tracked, fns: Sequence[Any]) -> frozenset[int]:
    """The tracked values of the modules that ``fns`` refer to by closure, bound ``self``,
    ``functools.partial`` arguments, defaults or the globals they name (a few levels
    deep): the first guess of what they touch, so that a function that uses its module
    is traced once. A guess only: a probe still catches what it misses."""
    roots: set[str] = set()
    seen: set[int] = set()

    def visit(obj: Any, depth: int) -> None:
        if id(obj) in seen or depth > 3:
            return
        seen.add(id(obj))
        if is_graph_object(obj):
            index = tracked.var_index(obj)
            if index is not None:
                roots.add(_root(tracked.path(index)))
                return
            node = tracked.node_index(obj)
            if node is not None:
                roots.add(_root(tracked.node_path(node)))
            return
        if isinstance(obj, functools.partial):
            for item in (obj.func, *obj.args, *obj.keywords.values()):
                visit(item, depth + 1)
            return
        if isinstance(obj, (list, tuple)):
            for item in obj[:16]:
                visit(item, depth + 1)
            return
        if isinstance(obj, dict):
            for item in list(obj.values())[:16]:
                visit(item, depth + 1)
            return
        bound = getattr(obj, "__self__", None)
        if bound is not None and not isinstance(bound, types.ModuleType):
            visit(bound, depth + 1)
        function = getattr(obj, "__func__", obj)
        code = getattr(function, "__code__", None)
        if code is None:
            return
        for cell in getattr(function, "__closure__", None) or ():
            try:
                visit(cell.cell_contents, depth + 1)
            except ValueError:  # an empty cell
                pass
        for item in getattr(function, "__defaults__", None) or ():
            visit(item, depth + 1)
        namespace = getattr(function, "__globals__", {})
        for name in code.co_names:
            if name in namespace:
                visit(namespace[name], depth + 1)

    for fn in fns:
        visit(fn, 0)
    passed = _arguments(tracked)
    if not roots:
        return passed
    names = [_root(path) for path in _paths(tracked)]
    return passed | frozenset(i for i, name in enumerate(names) if name in roots)


def _arguments(tracked: Tracked) -> frozenset[int]:
    """The tracked values of the modules passed as arguments: the call uses them."""
    extra = tracked.extra
    if extra is None:
        return frozenset()
    count, outer = len(tracked.variables), len(tracked.graph.variables)
    attrs = len(tracked.graph.attrs)
    return frozenset(range(outer, count)) | frozenset(
        range(count + attrs, count + len(tracked.attrs))
    )


class Threads:
    """What one traced function was found to touch: the indices of the tracked values
    (Variables, then array attributes) that it is given."""

    __slots__ = ("found",)

    def __init__(self) -> None:
        self.found: dict[Any, frozenset[int]] = {}

    def get(self, tracked: Tracked, fns: Sequence[Any] = ()) -> frozenset[int]:
        """What the functions were found to touch, else the modules they refer to."""
        found = self.found.get(tracked.key)
        if found is None:
            found = self.found[tracked.key] = referenced(tracked, fns)
        return found

    def run(
        self,
        tracked: Tracked,
        call: Callable[[frozenset[int], object], T],
        fns: Sequence[Any] = (),
    ) -> T:
        """``call(indices, owner)``, traced again with the module of each probe it used.

        ``owner`` marks the probes of this call: a probe of an enclosing call belongs to
        that call's slot and passes through. ``fns``: the user's functions, whose
        references give the first guess (``referenced``).
        """
        given = self.get(tracked, fns)
        while True:
            owner = object()
            try:
                return call(given, owner)
            except NeedsState as error:
                if error.owner is not owner:
                    raise
                more = module_of(tracked, error.index)
                assert not more <= given, "a given value was probed"
                given = given | more
                if len(self.found) >= 16:
                    self.found.clear()
                self.found[tracked.key] = given


def given_values(tracked: Tracked, given: frozenset[int], reach: Sequence[Any]) -> dict[int, Any]:
    """The current values of the tracked values ``given`` (probes refused), for a call
    whose functions and arguments are ``reach`` (see ``check_lifted``)."""
    values = tracked.read()
    picked = {i: values[i] for i in sorted(given)}
    check_given(list(picked.values()))
    check_carried(tracked, picked.keys(), picked.values(), reach)
    return picked


def check_carried(
    tracked: Tracked, indices: Iterable[int], values: Iterable[Any], reach: Sequence[Any]
) -> None:
    """``check_lifted`` of the values a call carries, for a call whose functions and
    arguments are ``reach``: what they refer to is looked up only inside a raw jit."""
    check_lifted(tracked, indices, values, lambda: referenced(tracked, reach))


__all__ = [
    "NeedsState",
    "Probe",
    "Threads",
    "check_carried",
    "check_given",
    "given_values",
    "is_probe",
    "probe_for",
]
