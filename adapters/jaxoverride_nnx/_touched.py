"""Which tracked values a traced function is given: only those of the modules it touches.

A module the function never touches must not be threaded (with nothing to do, the jaxpr
must be JAX's), and what it touches is known only once traced. So it is traced with the
modules it is *believed* to touch (``referenced``, or what its last trace found) and
every other tracked Variable holds a ``Probe``: any use of one raises ``NeedsState``,
which aborts the trace, and the ``Threads`` slot traces again with the probe's module
given, keeping what it found.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from jaxoverride_nnx._probes import NeedsState, check_given
from jaxoverride_nnx._reach import reached
from jaxoverride_nnx._stale_reads import check_lifted
from jaxoverride_nnx._tracked import Tracked

T = TypeVar("T")


def _roots(tracked: Tracked) -> list[str]:
    """The module (root, or argument) of each tracked value, Variables then array
    attributes: the first name of its path."""
    graphs = [tracked.graph] if tracked.extra is None else [tracked.graph, tracked.extra]
    paths = [p for g in graphs for p in g.paths] + [p for g in graphs for p in g.attr_paths]
    return [_root(path) for path in paths]


def _root(path: str) -> str:
    cut = min((i for i in (path.find("."), path.find("[")) if i >= 0), default=len(path))
    return path[:cut]


def module_of(tracked: Tracked, index: int) -> frozenset[int]:
    """The indices of the tracked values of the module that value ``index`` belongs to."""
    names = _roots(tracked)
    return frozenset(i for i, name in enumerate(names) if name == names[index])


def referenced(tracked: Tracked, fns: Sequence[Any]) -> frozenset[int]:
    """The tracked values of the modules that ``fns`` refer to (``_reach.reached``), and
    of the modules passed as arguments: the first guess of what they touch, so that a
    function that uses its module is traced once (a probe catches what it misses)."""
    roots: set[str] = set()
    for _, obj in reached(("", fn) for fn in fns):
        index = tracked.var_index(obj)
        if index is not None:
            roots.add(_root(tracked.path(index)))
            continue
        node = tracked.node_index(obj)
        if node is not None:
            roots.add(_root(tracked.node_path(node)))
    passed = _arguments(tracked)
    if not roots:
        return passed
    return passed | frozenset(i for i, name in enumerate(_roots(tracked)) if name in roots)


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
        ``owner`` marks this call's probes (an enclosing call's pass through); ``fns``
        give the first guess (``referenced``)."""
        given = self.get(tracked, fns)
        while True:
            owner = object()
            try:
                return call(given, owner)
            except NeedsState as error:
                if error.owner is not owner:
                    raise
                error.release()
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
