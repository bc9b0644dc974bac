"""The override stack: interned layers and snapshots, and the process-wide idle flag.

A *layer* is one immutable ``{name: implementation}`` mapping; a *snapshot* an interned
tuple of layers, bottom first. The contextvar ``_current`` holds an *activation* per
entered context; the effective snapshot adds the installed adapters whose predicate holds
underneath it.

``idle`` holds while no activation is alive anywhere in the process and no guarded
adapter (a per-call ``when=``) is installed: neutral functions then take JAX's own path,
and transform wrappers (``_neutral``) their plain JAX target. An activation is counted
down only when it is freed, so one that a copied context (``asyncio.create_task``) can
still see counts as alive.
"""

from __future__ import annotations

import contextvars
import itertools
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import jax

from jaxoverride._compat import set_user_context_global

T = TypeVar("T")

_lock = threading.RLock()
_serials = itertools.count(1)


class Layer:
    """One level of the override stack: an immutable mapping from names to implementations."""

    __slots__ = ("__weakref__", "impls", "label", "serial")

    def __init__(self, label: str, impls: dict[str, Callable[..., Any]]):
        self.label = label
        self.impls = impls
        self.serial = next(_serials)

    def __repr__(self) -> str:
        return f"<Layer {self.label}: {', '.join(sorted(self.impls))}>"


# Interning makes equal layers and snapshots the same objects, so that re-entering a
# context finds the caches built for it earlier. Both tables are strong and bounded:
# when one overflows it is cleared, which costs at most a retrace, never a wrong result.
_TABLE_LIMIT = 4096
_layers: dict[tuple[Any, ...], Layer] = {}


def _interned(table: dict[Any, T], key: Any, make: Callable[[], T]) -> T:
    """``table[key]``, made by ``make()`` under the lock the first time, so that equal keys
    give the same object. A full table is cleared."""
    try:
        return table[key]
    except KeyError:
        pass
    with _lock:
        if len(table) >= _TABLE_LIMIT:
            table.clear()
        return table.setdefault(key, make())


def intern_layer(label: str, impls: dict[str, Callable[..., Any]]) -> Layer:
    # Implementations are keyed by identity: the table holds the layer, and so keeps each
    # implementation alive for as long as its id is part of a key.
    key = (label, *sorted((name, id(impl)) for name, impl in impls.items()))
    return _interned(_layers, key, lambda: Layer(label, dict(impls)))


class Snapshot:
    """An immutable, interned stack of layers (bottom first), compared by identity."""

    __slots__ = ("_top", "_under", "layers", "serial")

    def __init__(self, layers: tuple[Layer, ...]):
        self.layers = layers
        self.serial = next(_serials)
        self._under: dict[tuple[Layer, ...], Snapshot] = {}
        self._top = {name: level for level, layer in enumerate(layers) for name in layer.impls}

    def top(self, name: str) -> int | None:
        """The level of the topmost layer that overrides ``name``."""
        return self._top.get(name)

    def below(self, name: str, level: int) -> int | None:
        """The level of the topmost layer under ``level`` that overrides ``name``."""
        for lower in range(level - 1, -1, -1):
            if name in self.layers[lower].impls:
                return lower
        return None

    def push(self, layer: Layer) -> Snapshot:
        return snapshot_of((*self.layers, layer))

    def under(self, base: tuple[Layer, ...]) -> Snapshot:
        try:
            return self._under[base]
        except KeyError:
            return self._under.setdefault(base, snapshot_of((*base, *self.layers)))

    # Snapshots are interned, so identity is equality, and object's C-level hash keeps
    # cache lookups on the dispatch path free of Python frames. After a table overflow an
    # equal snapshot may be a new object: its caches miss once, never hit wrongly.

    def __repr__(self) -> str:
        return f"<Snapshot {[layer.label for layer in self.layers]}>"


_snapshots: dict[tuple[Layer, ...], Snapshot] = {}


def snapshot_of(layers: tuple[Layer, ...]) -> Snapshot:
    return _interned(_snapshots, layers, lambda: Snapshot(layers)) if layers else ROOT


ROOT = Snapshot(())  # never in the table: it survives its overflow

# The jax.jit cache key includes these values, so a raw jax.jit around code that calls
# neutral functions retraces when the active overrides change instead of replaying a
# stale trace. The context key is thread-local; the installed key is global.
_context_key = jax.make_user_context(ROOT.serial)
_installed_key = jax.make_user_context(())


class _Switchable(Protocol):
    def _switch_to_slow(self) -> None: ...


idle = True
_live = 0
_fast: weakref.WeakSet[Any] = weakref.WeakSet()
# Wrappers whose target is an override's own direct call (see ``register_direct``).
_direct: weakref.WeakSet[Any] = weakref.WeakSet()


def _set_busy_locked() -> None:
    global idle
    if idle:
        idle = False
        for wrapper in list(_fast):
            wrapper._switch_to_slow()
        _fast.clear()


def register_fast(wrapper: _Switchable) -> bool:
    """Marks ``wrapper`` as using its plain target; returns False if that is not allowed now."""
    with _lock:
        if not idle:
            return False
        _fast.add(wrapper)
        return True


def register_direct(wrapper: _Switchable, switch: Callable[[], None]) -> bool:
    """Runs ``switch()`` (which makes ``wrapper`` call an override's direct call) and
    records it, unless a guarded adapter is installed: then returns False.

    A direct call tests only the snapshot of this thread or task, so it is right only
    while no guard's predicate can add a layer under it; installing one switches every
    recorded wrapper back to its slow target (see ``_set_installed_locked``).
    """
    with _lock:
        if _guards:
            return False
        switch()
        _direct.add(wrapper)
        return True


def forget_direct(wrapper: object) -> None:
    """Stops recording ``wrapper`` as direct (it was switched to another target)."""
    with _lock:
        _direct.discard(wrapper)


def _recompute_idle_locked() -> None:
    global idle
    if _live == 0 and not _guards:
        idle = True
    else:
        _set_busy_locked()


class Activation:
    """What ``_current`` holds for one entered context."""

    __slots__ = ("jax_key", "owner", "snapshot", "snapshot_token", "token")

    def __init__(self, snapshot: Snapshot, owner: object):
        global _live
        self.snapshot = snapshot
        self.owner = owner
        self.token: contextvars.Token[Activation | _RootActivation] | None = None
        self.snapshot_token: contextvars.Token[Snapshot] | None = None
        self.jax_key: Any = None
        with _lock:
            _live += 1
            _set_busy_locked()

    def __del__(self) -> None:
        global _live
        try:
            with _lock:
                _live -= 1
                _recompute_idle_locked()
        except Exception:  # interpreter shutdown: module globals may already be gone
            pass


class _RootActivation:
    __slots__ = ("owner", "snapshot")

    def __init__(self) -> None:
        self.snapshot = ROOT
        self.owner = None


_ROOT_ACTIVATION = _RootActivation()  # immutable in practice: never written after creation
_current: contextvars.ContextVar[Activation | _RootActivation] = contextvars.ContextVar(
    "jaxoverride_stack", default=_ROOT_ACTIVATION
)
# ``_current.get().snapshot``, kept beside it: set and reset with it, and only by
# ``enter`` and ``leave``. Its ``get`` is what an override's direct call compares with
# its snapshot (see ``register_direct``), one C call instead of a call and an attribute.
_snapshot_now: contextvars.ContextVar[Snapshot] = contextvars.ContextVar(
    "jaxoverride_snapshot", default=ROOT
)
snapshot_now = _snapshot_now.get


def context_snapshot() -> Snapshot:
    """The snapshot of the entered contexts in this thread or task, installed adapters excluded."""
    return _current.get().snapshot


def _no_check() -> None:
    global modules_seen
    modules_seen = len(sys.modules)


def _not_set() -> None:
    """``on_new_modules`` until the package that sets it has finished importing."""


# Called on a context entry when modules were imported since the last call, for the
# first-call check (``_first_call``) to look for new raw import-time transforms. Set from
# above (``jaxoverride`` sets a loader of ``_first_call``, which puts its own here).
modules_seen = -1
on_new_modules: Callable[[], None] = _not_set


def enter(snapshot: Snapshot, owner: object) -> None:
    activation = Activation(snapshot, owner)
    activation.token = _current.set(activation)
    activation.snapshot_token = _snapshot_now.set(snapshot)
    try:
        key = _context_key(snapshot.serial)
        key.__enter__()
    except BaseException:
        _snapshot_now.reset(activation.snapshot_token)
        _current.reset(activation.token)
        raise
    activation.jax_key = key
    if modules_seen != len(sys.modules):
        on_new_modules()


def leave(owner: object) -> None:
    activation = _current.get()
    if activation.owner is not owner or not isinstance(activation, Activation):
        raise RuntimeError(
            f"jaxoverride: exiting {owner!r}, but the innermost active context in this thread "
            f"or task is {activation.owner!r}. Contexts must exit in the reverse order of "
            "entry, in the thread or task that entered them; nothing was changed."
        )
    assert activation.token is not None and activation.snapshot_token is not None
    _snapshot_now.reset(activation.snapshot_token)
    _current.reset(activation.token)
    activation.jax_key.__exit__(None, None, None)
    now = _current.get().snapshot.serial
    # asyncio tasks interleave on one thread, so the thread-local key can lag behind the
    # task-local stack; resynchronise it to this task's stack.
    if _context_key.value != now:
        _context_key(now).__enter__()


def _always() -> bool:
    return True


class Installed:
    """An adapter registered for the whole process.

    A guarded entry is active while ``when()`` is true, asked on every neutral call. A
    scoped entry is active only inside the scopes its adapter enters (see
    ``enter_scoped``), so outside them the process stays idle and pays nothing.
    """

    __slots__ = ("layer", "scoped", "when")

    def __init__(self, layer: Layer, when: Callable[[], bool] | None, scoped: bool = False):
        self.layer = layer
        self.when = _always if when is None else when
        self.scoped = scoped


installed: tuple[Installed, ...] = ()
# (predicate, layer) of each installed adapter, in order: read on every dispatch.
_guards: tuple[tuple[Callable[[], bool], Layer], ...] = ()


def _set_installed_locked(entries: tuple[Installed, ...]) -> None:
    """Makes ``entries`` the installed adapters; if JAX refuses the new key, nothing changes."""
    global installed, _guards
    # The jit key is the one step that can fail, so it goes first: a failure then leaves
    # the list, the guards and the key as they were.
    set_user_context_global(_installed_key, tuple(entry.layer.serial for entry in entries))
    installed = entries
    _guards = tuple((entry.when, entry.layer) for entry in entries if not entry.scoped)
    if _guards:
        for wrapper in list(_direct):
            wrapper._switch_to_slow()
        _direct.clear()
    _recompute_idle_locked()


def add_installed(entry: Installed) -> Installed:
    with _lock:
        key = (entry.layer, entry.when, entry.scoped)
        for existing in installed:
            if (existing.layer, existing.when, existing.scoped) == key:
                return existing
        _set_installed_locked((*installed, entry))
        return entry


def remove_installed(entry: Installed) -> bool:
    with _lock:
        if entry not in installed:
            return False
        _set_installed_locked(tuple(other for other in installed if other is not entry))
        return True


_current_get = _current.get


def effective_snapshot() -> Snapshot:
    """The stack that a neutral call sees now: active installed adapters, then contexts."""
    snapshot = _current_get().snapshot
    if _guards:
        base: tuple[Layer, ...] = ()
        for when, layer in _guards:
            if when() and layer not in snapshot.layers:  # no second copy of a layer
                base += (layer,)
        if base:
            snapshot = snapshot.under(base)
    return snapshot


def enter_scoped(layer: Layer, owner: object) -> None:
    """Activates an installed layer for a dynamic extent, beneath every entered context.

    Re-entering while the layer is already active adds no second copy of it.
    """
    current = _current_get().snapshot
    snapshot = current if layer in current.layers else snapshot_of((layer, *current.layers))
    enter(snapshot, owner)
