"""The framework registry: what the missing-adapter check knows, as records frameworks give it.

A ``Framework`` record is registered by its adapter (``adapter_kit.register_framework``)
or declared in the entry-point group ``jaxoverride.frameworks`` (name: the watched module;
value: ``package.module:record``). The group is read once, and a record loaded once its
module is in ``sys.modules``: the check fires for a framework whose adapter was never
imported, and a process that never imports the framework never loads the record. The
check asks only the *live* records, worked out again when ``len(sys.modules)`` changes.
"""

from __future__ import annotations

import importlib
import sys
import threading
import warnings
from collections.abc import Callable, Iterable
from typing import Any

from jax.core import Tracer

GROUP = "jaxoverride.frameworks"


class Framework:
    """A framework the missing-adapter check watches: subclass it, fill it in, register it.

    Attributes:
      key: the short name adapters declare themselves for (``"toy"``).
      module: the ``sys.modules`` entry whose presence makes the record live.
      title: how messages name it, e.g. ``"Toy (a neutral function ran inside
        toy.transform)"``.
      fix: the call that activates the adapter that handles it, as messages print it.
      label: the override-layer label of that adapter (its ``name=``).

    Override the methods as needed. Each reads the framework from ``sys.modules``, never
    imports it, and is fast: the scope probe runs at neutral calls.

    Example:
      >>> from jaxoverride import adapter_kit
      >>> record = adapter_kit.Framework()  # defaults; register_framework shows a record
      >>> record.running(), record.leaked_state(), record.is_state(object())
      (False, [], False)
    """

    key: str = ""
    module: str = ""
    title: str = ""
    fix: str = ""
    label: str = ""

    def running(self) -> bool:
        """Whether a scope of the framework (a transform, a bound module) runs now."""
        return False

    def leaked_state(self) -> list[Any]:
        """The leaves of framework state that a raw JAX transform would leak tracers into
        (read before and after a call)."""
        return []

    def counted(self, leaked: list[Any]) -> int:
        """How many of ``leaked`` (new tracers among ``leaked_state()``) are parameters or
        state values, as messages count them: the framework's own bookkeeping (an rng key
        sequence) left out. Default: all of them."""
        return len(leaked)

    def is_state(self, value: Any) -> bool:
        """Whether ``value`` is framework state, captured in closures, that raw JAX would
        not thread."""
        return False

    def fix_for(self, names: list[str], *, covered: list[str] | None = None) -> str:
        """The fix for captured state named ``names``; ``covered``: where an adapter of
        the framework is active but does not cover it, the names the program gives the
        state it does cover (None while no adapter of the framework is active)."""
        return self.fix

    def write_error(self) -> type[BaseException] | None:
        """The framework's error for a write to captured state under a raw JAX trace,
        re-raised with the fix."""
        return None

    def __repr__(self) -> str:
        return f"<Framework {self.key!r} watching {self.module!r}>"


_lock = threading.RLock()
registered: dict[str, Framework] = {}  # key -> record
# key -> override-layer labels of the adapters that handle it (the record's own first)
labels: dict[str, set[str]] = {}
# key -> predicates from the adapters: does the active adapter cover this object?
covers: dict[str, list[Callable[[Any], bool]]] = {}
# key -> {snapshot: whether a layer that handles the framework is in it}, filled by the
# check; each cleared in place when a handler is declared (a label may change an answer).
handled_by: dict[str, dict[Any, bool]] = {}

# The live view: worked out again when ``len(sys.modules)`` is no longer ``seen``. Each
# tuple is replaced whole (threads read one view or the other).
seen = -1
watched = False  # whether any record is live
live: tuple[Framework, ...] = ()  # registered records whose module is imported
scoped: tuple[Framework, ...] = ()  # the live ones that override ``running``
probes: tuple[Callable[[], bool], ...] = ()  # their ``running``, bound
capturing: tuple[Framework, ...] = ()  # the live ones that override ``is_state``

# Entry points not loaded yet: watched module -> values ("pkg.mod:record"); None until
# the group is read.
_pending: dict[str, list[str]] | None = None


def _overrides(record: Framework, method: str) -> bool:
    return getattr(type(record), method) is not getattr(Framework, method)


def _set_live_locked() -> None:
    global live, scoped, probes, capturing, watched
    modules = sys.modules
    live = tuple(record for record in registered.values() if record.module in modules)
    scoped = tuple(record for record in live if _overrides(record, "running"))
    probes = tuple(record.running for record in scoped)
    capturing = tuple(record for record in live if _overrides(record, "is_state"))
    watched = bool(live)


def _read_entry_points() -> dict[str, list[str]]:
    from importlib.metadata import entry_points  # loaded by JAX already

    pending: dict[str, list[str]] = {}
    try:
        points = list(entry_points(group=GROUP))
    except Exception as error:  # broken metadata of some distribution
        warnings.warn(
            f"jaxoverride: the entry-point group {GROUP!r} could not be read: "
            f"{type(error).__name__}: {error}. The missing-adapter check watches only the "
            "frameworks registered with adapter_kit.register_framework.",
            RuntimeWarning,
            stacklevel=5,
        )
        return pending
    for point in points:
        values = pending.setdefault(point.name, [])
        if point.value not in values:
            values.append(point.value)
    return pending


def declared() -> list[tuple[str, str]]:
    """``(watched module, "pkg.mod:record")`` for every record the installed distributions
    declare, loaded or not (nothing is imported)."""
    with _lock:
        pending = _read_entry_points() if _pending is None else _pending
        loaded = [(record.module, type(record).__module__) for record in registered.values()]
    return [(module, value) for module, values in pending.items() for value in values] + loaded


def _load(module: str, value: str) -> None:
    """Loads and registers the record at ``value``; a broken one warns and is skipped."""
    try:
        where, _, attribute = value.partition(":")
        record: Any = importlib.import_module(where.strip())
        for part in attribute.strip().split(".") if attribute else ():
            record = getattr(record, part)
        if not isinstance(record, Framework):
            raise TypeError(f"it is {record!r}, not a jaxoverride.adapter_kit.Framework")
        if record.module != module:
            raise ValueError(f"its module is {record.module!r}, not the entry point's name")
        _register_locked(record)
    except Exception as error:
        warnings.warn(
            f"jaxoverride: the framework record {module} = {value!r} (entry-point group "
            f"{GROUP!r}) was not loaded: {type(error).__name__}: {error}. The missing-adapter "
            "check does not watch that framework.",
            RuntimeWarning,
            stacklevel=4,
        )


def refresh(load_all: bool = False) -> None:
    """Reads the entry points once, loads those whose watched module is imported (all of
    them with ``load_all``), and works out the live view again."""
    global _pending, seen
    with _lock:
        if _pending is None:
            _pending = _read_entry_points()
        for module in [m for m in _pending if load_all or _imported(m)]:
            for value in _pending.pop(module):
                _load(module, value)
        _set_live_locked()
        seen = len(sys.modules)  # after the loads, which import


def _imported(name: str) -> bool:
    """Whether module ``name`` is imported, its body finished (a record loaded while the
    framework's import still runs would meet a half-made framework)."""
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    return module is not None and not getattr(spec, "_initializing", False)


def _register_locked(record: Framework) -> None:
    for attribute in ("key", "module", "title", "fix", "label"):
        value = getattr(record, attribute, None)
        if not isinstance(value, str) or not value:
            raise TypeError(
                f"register_framework: {record!r} needs a non-empty string {attribute!r}."
            )
    existing = registered.get(record.key)
    if existing is not None:
        if type(existing) is type(record) and existing.module == record.module:
            return  # the same record again (idempotent per key)
        raise ValueError(
            f"register_framework: the key {record.key!r} is registered already, by "
            f"{existing!r}; each framework registers one record."
        )
    registered[record.key] = record
    labels.setdefault(record.key, set()).add(record.label)
    handled_by.setdefault(record.key, {})
    _clear_handled()


def register(record: Framework) -> None:
    """Registers ``record`` (idempotent per key); see ``adapter_kit.register_framework``."""
    if not isinstance(record, Framework):
        raise TypeError(
            "register_framework expects a jaxoverride.adapter_kit.Framework instance, "
            f"got {record!r}."
        )
    with _lock:
        _register_locked(record)
        _set_live_locked()


def _clear_handled() -> None:
    for answers in handled_by.values():
        answers.clear()


def scope_running() -> bool:
    """Whether a scope of a live framework (a transform, a bound module) is running now."""
    for running in probes:  # noqa: SIM110  (no generator frame: neutral calls ask this)
        if running():
            return True
    return False


def declare_handler(
    framework: str, label: str, covers_object: Callable[[Any], bool] | None
) -> None:
    """Records that override layers labelled ``label`` handle ``framework``."""
    if framework not in registered:
        refresh()
    if framework not in registered:
        refresh(load_all=True)  # an adapter may declare before its framework is imported
    if framework not in registered:
        raise ValueError(
            f"jaxoverride.adapter_kit.declare_handler: unknown framework {framework!r}; "
            f"the registered ones are {sorted(registered)}. A framework registers with "
            "jaxoverride.adapter_kit.register_framework(record) or the entry-point group "
            f"{GROUP!r}."
        )
    if not isinstance(label, str) or not label:
        raise TypeError(f"declare_handler: label must be a layer label string, got {label!r}.")
    if covers_object is not None and not callable(covers_object):
        raise TypeError(f"declare_handler: covers= must be callable, got {covers_object!r}.")
    with _lock:
        labels[framework].add(label)
        _clear_handled()
        if covers_object is not None and covers_object not in covers.setdefault(framework, []):
            covers[framework].append(covers_object)


def new_tracers(before: Iterable[Any], after: Iterable[Any]) -> list[Any]:
    """Tracers in ``after`` that were not in ``before`` (compared by identity)."""
    known = {id(leaf) for leaf in before}
    return [leaf for leaf in after if isinstance(leaf, Tracer) and id(leaf) not in known]
