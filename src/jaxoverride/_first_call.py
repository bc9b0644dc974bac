"""The first-call check: a solver library never interposed, called while an adapter is active.

A transform that a library built with raw JAX while it was imported (``optx.fixed_point``;
see ``_raw``) keeps calling raw JAX, out of the adapter's reach. On an adapter's context
entry after new imports, the imported solver libraries' raw import-time transforms are
rebound to a ``RawGuard`` where their modules hold them, and so is the ``jax.jit`` inside
an ``eqx.filter_jit`` wrapper (which reaches names a program bound to the wrapper before).
A guard called while anything is active refuses a function that captures state of a
framework whose adapter is active, or, inside a running scope, a call that leaves new
tracers in its state: ``MissingAdapterError`` names the ``interpose_on_import`` fix.
"""

from __future__ import annotations

import sys
import threading
import types
import warnings
from typing import Any

import jax

from jaxoverride import _detect, _frameworks, _interpose, _raw, _stack
from jaxoverride._frameworks import new_tracers
from jaxoverride.errors import MissingAdapterError

_local = threading.local()  # .running: a guard's raw transform runs in this thread
# id(raw object) -> its guard; the guard holds the object, so the id stays valid.
_guards: dict[int, _raw.RawGuard] = {}
_scanned: set[str] = set()  # modules whose attributes were looked at once imported


def _package_modules(packages: list[str]) -> list[tuple[str, types.ModuleType]]:
    found = []
    # A copy, not iteration: another thread may import meanwhile (see _interpose).
    for name, module in sys.modules.copy().items():
        if name in _scanned or not isinstance(module, types.ModuleType):
            continue
        if not _raw.within(name, packages):
            continue
        spec = getattr(module, "__spec__", None)
        if getattr(spec, "_initializing", False):  # its body still runs: look again later
            continue
        found.append((name, module))
    return found


def guard_imported() -> int:
    """Rebinds the raw import-time transforms of the imported solver libraries to guards.

    Returns:
      How many module attributes were rebound by this call.
    """
    packages = [p for p in _raw.SOLVER_LIBRARIES if p in sys.modules]
    if not packages:
        return 0
    rebound = 0
    with _interpose._lock:
        for name, module in _package_modules(packages):
            _scanned.add(name)
            package = name.partition(".")[0]
            for attribute, value in vars(module).copy().items():
                if not _raw.holds_raw_transform(value) or not _raw.defined_in(value, (package,)):
                    continue
                where = f"{name}.{attribute}"
                raw = _raw.unguarded(value)
                # Every name bound to the wrapper, the program's own included, reaches
                # the jit it holds: guard that one.
                for inner in _raw.held_jits(raw):
                    vars(raw)[inner] = _guard_for(_raw.unguarded(vars(raw)[inner]), where)
                guard = _guard_for(raw, where)
                if value is not guard:
                    setattr(module, attribute, guard)
                    rebound += 1
    return rebound


def _guard_for(raw: Any, where: str) -> _raw.RawGuard:
    """The one guard of ``raw``; messages name the shortest ``module.attribute`` seen."""
    guard = _guards.get(id(raw))
    if guard is None:
        guard = _guards[id(raw)] = _raw.RawGuard(raw, where)
    elif len(where) < len(guard.where):
        guard.where = where
    return guard


def refresh() -> None:
    """What a context entry runs when modules were imported since the last one."""
    if not _detect.watching():
        _stack.modules_seen = len(sys.modules)
        return
    layers, labels = _stack.context_snapshot().layers, _frameworks.labels
    if not any(layer.label in labels[f.key] for f in _frameworks.live for layer in layers):
        return  # no adapter of a watched framework entered: look again at the next entry
    _stack.modules_seen = len(sys.modules)
    try:
        guard_imported()
    except Exception as error:  # a library's odd module must not break a context entry
        _stack.on_new_modules = _stack._no_check
        warnings.warn(
            f"jaxoverride: the first-call check of raw import-time transforms stopped: "
            f"{type(error).__name__}: {error}. Other checks still run.",
            RuntimeWarning,
            stacklevel=3,
        )


def _captured(
    framework: _frameworks.Framework, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> _detect.Captured:
    """``framework``'s state captured by the functions among the arguments."""
    leaves = jax.tree_util.tree_leaves((args, kwargs), is_leaf=framework.is_state)
    found: _detect.Captured = []
    for leaf in leaves:
        if callable(leaf) and not isinstance(leaf, type) and not framework.is_state(leaf):
            found += _detect._owned(framework, _detect.captured_state(leaf))
    return found


def _refusal(guard: _raw.RawGuard, what: str) -> MissingAdapterError:
    package = guard.where.partition(".")[0]
    packages = [package, *_raw.builders([guard.where])]
    return MissingAdapterError(
        f"{guard.where} is a transform that {package!r} built with raw JAX while it was "
        f"imported, so the active adapter cannot reach inside it, and {what} Fix: call "
        f"{_raw.fix_for(packages)}, at the top of the program.{_detect._HATCH}"
    )


def _run(guard: _raw.RawGuard, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    _local.running = True
    try:
        return guard.__wrapped__(*args, **kwargs)
    finally:
        _local.running = False


def check_call(guard: _raw.RawGuard, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Runs a guarded raw transform while something is active; see the module docstring."""
    # A guard inside another guard's call: the outer one checks, and names the call the
    # program made rather than a library's inner helper.
    if not _detect.enabled or getattr(_local, "running", False):
        return guard.__wrapped__(*args, **kwargs)
    snapshot = _stack.effective_snapshot()
    for framework in _frameworks.capturing:
        if not _detect._handled(framework, snapshot):
            continue
        captured = _captured(framework, args, kwargs)
        if captured:
            raise _refusal(
                guard,
                f"a function given to it captures {_detect._describe(captured)}: raw JAX "
                "would bake their current weights in as constants (a write raises the "
                f"framework's own error), where the active adapter of {framework.key} "
                "would thread them.",
            )
    scopes = [f for f in _frameworks.scoped if _detect._handled(f, snapshot) and f.running()]
    if not scopes:
        return _run(guard, args, kwargs)
    before = {f.key: f.leaked_state() for f in scopes}
    out = _run(guard, args, kwargs)
    for framework in scopes:
        leaked = new_tracers(before[framework.key], framework.leaked_state())
        if leaked:
            subject = f"it ran {framework.title.split(' (', 1)[0]} code that"
            raise _refusal(
                guard,
                f"{_detect.leak_text(framework, leaked, subject, 'under its raw trace')}: the "
                "first use then fails far from here, or the result is silently wrong.",
            )
    return out


_raw.RawGuard.check = check_call
_stack.on_new_modules = refresh
