"""What the missing-adapter check knows about each stateful framework.

Core never imports a framework. Every probe here reads a module from ``sys.modules`` and
does nothing while that module is absent, so a process that never imports Haiku or Flax
never pays for them and the check never imports them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any

import jax
from jax.core import Tracer


class Framework:
    """One framework the check watches.

    Attributes:
      key: the short name adapters declare themselves for (``"haiku"``, ``"linen"``, ``"nnx"``).
      title: how messages name it.
      module: the ``sys.modules`` entry the probes read; while absent the framework is ignored.
      labels: override-layer labels of the adapters that handle it.
      fix: the call that activates such an adapter, as messages print it.
    """

    __slots__ = ("fix", "key", "labels", "module", "title")

    def __init__(self, key: str, title: str, module: str, label: str, fix: str):
        self.key = key
        self.title = title
        self.module = module
        self.labels: set[str] = {label}
        self.fix = fix

    def loaded(self) -> Any:
        return sys.modules.get(self.module)

    def inside(self) -> bool:
        """Whether a scope of the framework (a transform, a bound module) is running now."""
        return False

    def state_leaves(self) -> list[Any]:
        """The leaves of the framework state a write inside a raw JAX trace would leak into."""
        return []

    def counted(self, leaked: list[Any]) -> int:
        """How many of ``leaked`` (new tracers among ``state_leaves()``) are parameters or
        state values, as messages count them: the framework's own bookkeeping (Haiku's
        rng key sequence) left out."""
        return len(leaked)


class _Haiku(Framework):
    __slots__ = ()

    def inside(self) -> bool:
        base = self.loaded()
        return base is not None and base.inside_transform()

    def state_leaves(self) -> list[Any]:
        frame = self.loaded().current_frame()
        leaves = jax.tree_util.tree_leaves((frame.params, frame.state))
        for sequence in frame.rng_stack:
            if sequence is not None:
                leaves += jax.tree_util.tree_leaves(sequence.internal_state)
        return leaves

    def counted(self, leaked: list[Any]) -> int:
        frame = self.loaded().current_frame()
        values = {id(leaf) for leaf in jax.tree_util.tree_leaves((frame.params, frame.state))}
        return sum(id(leaf) in values for leaf in leaked)


class _Linen(Framework):
    __slots__ = ()

    def _bound(self) -> Any:
        module = self.loaded()
        if module is None:
            return None
        top = module._context.module_stack[-1]
        return None if top is None else getattr(top, "scope", None)

    def inside(self) -> bool:
        # Not through ``_bound``: this runs at every checked call while Flax is imported.
        module = sys.modules.get(self.module)
        if module is None:
            return False
        top = module._context.module_stack[-1]
        return top is not None and getattr(top, "scope", None) is not None

    def state_leaves(self) -> list[Any]:
        scope = self._bound()
        if scope is None:
            return []
        return jax.tree_util.tree_leaves(scope.root._variables)


class _Nnx(Framework):
    __slots__ = ()

    def is_state(self, value: Any) -> bool:
        """Whether ``value`` is an NNX graph node or a Variable that raw JAX would not thread."""
        # The graph module is ``graphlib`` in recent Flax, ``graph`` in Flax 0.12.1.
        graphlib = sys.modules.get("flax.nnx.graphlib") or sys.modules.get("flax.nnx.graph")
        if graphlib is None:
            return False
        if type(value) in graphlib.GRAPH_REGISTRY:
            return True
        variablelib = self.loaded()
        if variablelib is None or not isinstance(value, variablelib.Variable):
            return False
        # ref=True Variables already work inside raw JAX transforms, and hijax=True ones
        # either work (Flax 0.12.8) or raise Flax's own error when written (0.12.10).
        metadata = getattr(value, "_var_metadata", None) or {}
        return not (metadata.get("ref") or metadata.get("hijax"))


HAIKU = _Haiku(
    "haiku",
    "Haiku (a neutral function ran inside hk.transform)",
    "haiku._src.base",
    "jaxoverride_haiku",
    "jaxoverride_haiku.install() once at the start of the program "
    "(or run the transform inside `with jaxoverride_haiku.context():`)",
)
LINEN = _Linen(
    "linen",
    "Flax Linen (a neutral function ran inside a bound Linen module)",
    "flax.linen.module",
    "jaxoverride_linen",
    "jaxoverride_linen.install() once at the start of the program "
    "(or run init/apply inside `with jaxoverride_linen.context():`)",
)
NNX = _Nnx(
    "nnx",
    "Flax NNX (the function captures NNX modules or Variables)",
    "flax.nnx.variablelib",  # in every supported Flax (the graph module was renamed)
    "jaxoverride_nnx",
    "`with jaxoverride_nnx.track(model):` around the call, naming the top-level module",
)
SCOPED: tuple[Framework, ...] = (HAIKU, LINEN)
ALL: dict[str, Framework] = {f.key: f for f in (HAIKU, LINEN, NNX)}
MODULES: tuple[str, ...] = tuple(f.module for f in ALL.values())

# framework key -> predicates from the adapters: does the active adapter cover this object?
covers: dict[str, list[Callable[[Any], bool]]] = {}
# snapshot -> whether a layer of an NNX adapter is in it, filled by the missing-adapter
# check; cleared when a handler is declared (a new label may change an answer).
nnx_handled: dict[Any, bool] = {}


def scope_running() -> bool:
    """Whether a Haiku transform or a bound Linen module is running now."""
    modules = sys.modules
    haiku = modules.get(HAIKU.module)
    if haiku is not None and haiku.inside_transform():
        return True
    linen = modules.get(LINEN.module)
    if linen is None:
        return False
    top = linen._context.module_stack[-1]  # as _Linen.inside, without its frame
    return top is not None and getattr(top, "scope", None) is not None


def declare_handler(
    framework: str, label: str, covers_object: Callable[[Any], bool] | None
) -> None:
    """Records that override layers labelled ``label`` handle ``framework``."""
    if framework not in ALL:
        raise ValueError(
            f"jaxoverride.adapter_kit.declare_handler: unknown framework {framework!r}; "
            f"expected one of {sorted(ALL)}."
        )
    if not isinstance(label, str) or not label:
        raise TypeError(f"declare_handler: label must be a layer label string, got {label!r}.")
    ALL[framework].labels.add(label)
    nnx_handled.clear()
    if covers_object is not None:
        if not callable(covers_object):
            raise TypeError(f"declare_handler: covers= must be callable, got {covers_object!r}.")
        if covers_object not in covers.setdefault(framework, []):
            covers[framework].append(covers_object)


def new_tracers(before: Iterable[Any], after: Iterable[Any]) -> list[Any]:
    """Tracers in ``after`` that were not in ``before`` (compared by identity)."""
    known = {id(leaf) for leaf in before}
    return [leaf for leaf in after if isinstance(leaf, Tracer) and id(leaf) not in known]
