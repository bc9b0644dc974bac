"""Linen's implicit state as a kit ``StateSource``: variable collections, rng and names.

A bound Linen module keeps its variables in its root scope's ``_variables`` (one nested
dict per collection, which every child scope references into), draws rng keys by folding
a Python counter into the root key, and names submodules and variables with Python
counters and reservations kept on the modules and scopes running now. A JAX loop body
sees none of that as JAX values, so:

* the *mutable* collections (``params`` too at init: Linen's lifted transforms write
  back every variable of their scope) are the threaded state: their leaves are written
  in place, in the dicts the scopes reference, while a body runs, and the caller's
  values are put back afterwards;
* each rng stream is threaded as one *step key*: inside a body every ``make_rng`` of that
  stream folds its usual path and counter into the step key instead of the root key, so
  each iteration draws fresh keys; the counters are restored afterwards, so retracing a
  body draws the same keys again;
* the module-naming state (autoname cursors, children, scope reservations) of the modules
  on Linen's module stack is what ``names()`` copies.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax.core import scope as core_scope, tracers as core_tracers
from flax.linen import module as linen_module

from jaxoverride.errors import JaxoverrideError

Scope = core_scope.Scope
LazyRng = core_scope.LazyRng

_linen_context = linen_module._context  # the thread-local module stack of Linen
_NEXT_STEP = 0x7FFF_FFF1  # folded into a step key to get the next iteration's key
_CREATION_SALT = 0x7FFF_FFF3  # folded into the root keys during a creation pass


def in_bound_module() -> bool:
    """Whether a method of a bound Linen module is running (the adapter's predicate).

    Returns:
      True inside ``init``, ``init_with_output``, ``apply`` and methods of bound modules.

    Example:
      >>> import flax.linen as nn, jaxoverride_linen
      >>> class Probe(nn.Module):
      ...     def __call__(self, x):
      ...         return jaxoverride_linen.in_bound_module()
      >>> jaxoverride_linen.in_bound_module(), Probe().apply({}, 1.0)
      (False, True)
    """
    stack = _linen_context.module_stack
    return stack[-1] is not None


def stack_modules() -> list[Any]:
    """The bound modules whose methods are running now, outermost first."""
    return [m for m in _linen_context.module_stack if m is not None and m.scope is not None]


# -- rng substitution ------------------------------------------------------------------


class _Step:
    """One rng stream's root key and the step key that replaces it inside a body."""

    __slots__ = ("key", "root", "used")

    def __init__(self, root: Any, key: Any):
        self.root = root
        self.key = key
        self.used = False


_local = threading.local()
_original_make_rng = Scope.make_rng
_original_variable = Scope.variable
_original_put_variable = Scope.put_variable


def _substitutions() -> list[dict[int, _Step]]:
    try:
        return _local.steps
    except AttributeError:
        _local.steps = []
        return _local.steps


def _make_rng(self: Scope, name: str = "params") -> Any:
    stack = getattr(_local, "steps", None)
    if not stack:
        return _original_make_rng(self, name)
    rngs: Any = self.rngs  # LazyRng values, though Flax annotates them as keys
    resolved = name if name in rngs or "params" not in rngs else "params"
    lazy = rngs.get(resolved)
    if lazy is None:
        return _original_make_rng(self, name)
    step = stack[-1].get(id(lazy.rng))
    if step is None or step.root is not lazy.rng:
        return _original_make_rng(self, name)
    step.used = True
    rngs[resolved] = LazyRng(step.key, lazy.suffix)
    try:
        return _original_make_rng(self, name)
    finally:
        rngs[resolved] = lazy


def _variable(self: Scope, col: str, name: str, *args: Any, **kwargs: Any) -> Any:
    recorder = getattr(_local, "created", None)
    if recorder is None or self.has_variable(col, name):
        return _original_variable(self, col, name, *args, **kwargs)
    result = _original_variable(self, col, name, *args, **kwargs)
    recorder[(id(self.root._variables), col, (*self.path, name))] = self.get_variable(col, name)
    return result


def _put_variable(self: Scope, col: str, name: str, value: Any) -> Any:
    threaded = getattr(_local, "roots", None)
    if threaded:
        root = self.root
        if id(root._variables) not in threaded[-1] and root.trace_level != (
            core_tracers.current_trace()
        ):
            raise LinenStateError(
                f"Linen variable {col}/{'/'.join((*self.path, name))} was written inside a "
                "traced body, but its module is bound to a scope that does not run here "
                "(for example a module from .bind() or a module of another model): its "
                "variables are not threaded, so the write would leak a tracer. Call the "
                "module from a method of the model that runs the loop (a submodule "
                "attribute or an nn.compact submodule), or make the collection immutable."
            )
    return _original_put_variable(self, col, name, value)


# The wrappers behave exactly as Linen's own methods unless a threaded body or a
# creation pass of this adapter is running in this thread (one thread-local read).
Scope.make_rng = _make_rng  # type: ignore[method-assign]
Scope.variable = _variable  # type: ignore[method-assign]
Scope.put_variable = _put_variable  # type: ignore[method-assign]


def _threaded_roots() -> list[set[int]]:
    try:
        return _local.roots
    except AttributeError:
        _local.roots = []
        return _local.roots


# -- variable trees --------------------------------------------------------------------


def _copy_dicts(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _copy_dicts(v) for k, v in tree.items()}
    return tree


def _paths(tree: Any, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from _paths(value, (*prefix, key))
        else:
            yield (*prefix, key), value


def _lookup(tree: Any, path: tuple[str, ...]) -> tuple[dict[str, Any], str]:
    for key in path[:-1]:
        tree = tree[key]
    return tree, path[-1]


def _delete(tree: dict[str, Any], path: tuple[str, ...]) -> None:
    parents = []
    for key in path[:-1]:
        parents.append((tree, key))
        tree = tree[key]
    del tree[path[-1]]
    for parent, key in reversed(parents):
        if parent[key]:
            break
        del parent[key]


class _Root:
    """One root scope reached from the module stack (rewound copies share its dicts)."""

    __slots__ = ("counters", "rngs", "scope", "variables")

    def __init__(self, scope: Scope):
        self.scope = scope
        self.variables: dict[str, Any] = scope._variables
        self.counters: dict[Any, Any] = scope.rng_counters
        self.rngs: dict[str, Any] = scope.rngs

    def threaded_collections(self) -> list[str]:
        scope = self.scope
        return [
            col for col in self.variables if col != "params" and scope.is_mutable_collection(col)
        ]

    def writable_paths(self) -> set[tuple[str, ...]]:
        scope = self.scope
        return {
            (col, *path)
            for col, tree in self.variables.items()
            if scope.is_mutable_collection(col) and isinstance(tree, dict)
            for path, _ in _paths(tree)
        }


def _copy_counters(counters: dict[Any, Any]) -> dict[Any, Any]:
    return {k: _copy_counters(v) if isinstance(v, dict) else v for k, v in counters.items()}


def _restore_counters(live: dict[Any, Any], saved: dict[Any, Any]) -> None:
    for key in list(live):
        if key not in saved:
            del live[key]
    for key, value in saved.items():
        if isinstance(value, dict):
            if not isinstance(live.get(key), dict):
                live[key] = {}
            _restore_counters(live[key], value)
        else:
            live[key] = value


class _Token:
    __slots__ = ("counters", "roots", "saved", "slots", "steps")

    def __init__(self) -> None:
        self.slots: list[dict[tuple[str, ...], Any]] = []
        self.saved: list[dict[str, Any]] = []
        self.counters: list[dict[Any, Any]] = []
        self.roots: list[_Root] = []
        self.steps: dict[int, _Step] = {}


class LinenStateError(JaxoverrideError, ValueError):
    """A traced body created or wrote Linen variables it cannot hand back.

    Also raised for a write, inside a traced body, to a module bound to a scope that is
    not running here (``module.bind(...)`` elsewhere): its variables are not threaded.

    Example:
      >>> import jaxoverride.errors, jaxoverride_linen
      >>> issubclass(jaxoverride_linen.LinenStateError, jaxoverride.errors.JaxoverrideError)
      True
    """


def _mutable_trees(root: _Root) -> dict[str, Any]:
    scope = root.scope
    return {
        col: _copy_dicts(tree)
        for col, tree in root.variables.items()
        if isinstance(tree, dict) and scope.is_mutable_collection(col)
    }


def _restore_tree(live: dict[str, Any], saved: dict[str, Any]) -> None:
    """Makes ``live`` equal ``saved`` in place, keeping the dict objects still there."""
    for key in list(live):
        if key not in saved:
            del live[key]
    for key, value in saved.items():
        if isinstance(value, dict):
            if not isinstance(live.get(key), dict):
                live[key] = {}
            _restore_tree(live[key], value)
        else:
            live[key] = value


def _put_path(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get_path(tree: Any, path: tuple[str, ...], default: Any) -> Any:
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return default
        tree = tree[key]
    return tree


def _rebuild(live: Any, like: Any) -> Any:
    """The values of ``live`` at the paths of ``like`` (the threaded structure)."""
    if isinstance(like, dict):
        return {k: _rebuild(live[k], v) for k, v in like.items()}
    return live


def _aval(value: Any) -> Any:
    return jax.tree.map(lambda v: jax.ShapeDtypeStruct(jnp.shape(v), jnp.result_type(v)), value)


class LinenSource:
    """The ``StateSource`` of the modules on Linen's module stack now.

    Variables first written inside a loop body or branch at apply (a ``sow``) are
    *fresh*: the first trace records their shapes and asks the kit to run the call again
    (``retrace()``) with a slot for them, which each iteration refills from an absent
    entry; what comes out is the last iteration's value, written once per call. In a
    transform (``allow_fresh=False``) such a write is a ``LinenStateError``.
    """

    __slots__ = (
        "_counters_at_read",
        "_created",
        "_retrace",
        "allow_fresh",
        "fresh",
        "modules",
        "roots",
        "where",
    )

    def __init__(self, where: str, *, allow_fresh: bool = False):
        self.where = where
        self.allow_fresh = allow_fresh
        self._retrace = False
        self._created: list[tuple[_Root, set[tuple[str, ...]]]] = []
        self.modules = stack_modules()
        roots: dict[int, _Root] = {}
        for module in self.modules:
            root = module.scope.root
            roots.setdefault(id(root._variables), _Root(root))
        self.roots = list(roots.values())
        self.fresh: list[dict[tuple[str, ...], Any]] = [{} for _ in self.roots]
        self._counters_at_read: list[dict[Any, Any]] = []

    # -- threaded state ----------------------------------------------------------------

    def read(self) -> Any:
        self._counters_at_read = [_copy_counters(root.counters) for root in self.roots]
        state = []
        for root, fresh in zip(self.roots, self.fresh, strict=True):
            cols = {col: _copy_dicts(root.variables[col]) for col in root.threaded_collections()}
            keys = {name: root.scope.make_rng(name) for name in sorted(root.rngs)}
            slots = {
                path: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), aval)
                for path, aval in fresh.items()
            }
            state.append((cols, keys, slots))
        return state

    def enter(self, state: Any) -> _Token:
        token = _Token()
        outer = _substitutions()
        steps: dict[int, _Step] = dict(outer[-1]) if outer else {}
        for root, (cols, keys, slots) in zip(self.roots, state, strict=True):
            token.roots.append(root)
            token.saved.append(_mutable_trees(root))
            token.counters.append(_copy_counters(root.counters))
            token.slots.append(slots)
            for col, tree in cols.items():
                live = root.variables[col]
                for path, value in _paths(tree):
                    _put_path(live, path, value)
            for path in slots:
                if _get_path(root.variables, path, _MISSING) is not _MISSING:
                    _delete(root.variables, path)
            for name, key in keys.items():
                lazy = root.rngs[name]
                steps[id(lazy.rng)] = token.steps[id(lazy.rng)] = _Step(lazy.rng, key)
        outer.append(steps)
        roots = _threaded_roots()
        roots.append((roots[-1] if roots else set()) | {id(r.variables) for r in self.roots})
        return token

    def _undo(self, token: _Token) -> None:
        _substitutions().pop()
        _threaded_roots().pop()
        for root, saved, counters in zip(token.roots, token.saved, token.counters, strict=True):
            for col in list(root.variables):
                if col not in saved and root.scope.is_mutable_collection(col):
                    del root.variables[col]
            for col, tree in saved.items():
                _restore_tree(root.variables.setdefault(col, {}), tree)
            _restore_counters(root.counters, counters)

    def leave(self, token: _Token) -> Any:
        after = []
        created: list[tuple[Any, ...]] = []
        state = []
        for index, (root, saved) in enumerate(zip(token.roots, token.saved, strict=True)):
            known = {(col, *path) for col, tree in saved.items() for path, _ in _paths(tree)}
            fresh = self.fresh[index]
            for path in sorted(root.writable_paths() - known - set(fresh)):
                created.append((index, path))
            cols = {
                col: _rebuild(root.variables[col], _copy_dicts(tree))
                for col, tree in saved.items()
                if col in root.threaded_collections()
            }
            keys = {}
            for name in sorted(root.rngs):
                step = token.steps[id(root.rngs[name].rng)]
                keys[name] = jax.random.fold_in(step.key, _NEXT_STEP) if step.used else step.key
            slots = {path: _get_path(root.variables, path, _MISSING) for path in fresh}
            state.append((root, cols, keys, slots))
        # Values of created variables, read before the caller's values come back.
        values = {
            (index, path): _get_path(token.roots[index].variables, path, None)
            for index, path in created
        }
        self._undo(token)
        if created:
            if not self.allow_fresh or any(path[0] == "params" for _, path in created):
                raise _created_error(self.where, [p for _, p in created])
            # The trace runs to its end (aborting a JAX trace that closes over outer
            # tracers leaks it); the kit then discards the call and runs it again.
            for index, path in created:
                self.fresh[index][path] = _aval(values[(index, path)])
            self._retrace = True
        for (_, cols, keys, slots), entered in zip(state, token.slots, strict=True):
            slots = {p: entered[p] if v is _MISSING else v for p, v in slots.items()}
            after.append((cols, keys, slots))
        return after

    def retrace(self) -> bool:
        """True once after a trace met fresh variables; restores the draws of ``read()``."""
        if not self._retrace:
            return False
        self._retrace = False
        for root, counters in zip(self.roots, self._counters_at_read, strict=True):
            _restore_counters(root.counters, counters)
        return True

    def abandon(self, token: _Token) -> None:
        self._undo(token)

    def write(self, state: Any) -> None:
        for root, (cols, _, slots) in zip(self.roots, state, strict=True):
            for col, tree in cols.items():
                live = root.variables[col]
                for path, value in _paths(tree):
                    _put_path(live, path, value)
            for path, value in slots.items():
                _put_path(root.variables, path, value)

    # -- names -------------------------------------------------------------------------

    def names(self) -> Any:
        return [
            (
                module,
                dict(module._state.autoname_cursor),
                dict(module._state.children),
                module.scope,
                {k: set(v) for k, v in module.scope.reservations.items()},
            )
            for module in self.modules
        ]

    def restore_names(self, names: Any) -> None:
        for module, cursor, children, scope, reservations in names:
            module._state.autoname_cursor = dict(cursor)
            if module._state.children != children:
                module._state.children.clear()
                module._state.children.update(children)
            scope.reservations = collections.defaultdict(
                set, {k: set(v) for k, v in reservations.items()}
            )

    # -- creation ----------------------------------------------------------------------

    def initializing(self) -> bool:
        return any(root.scope.is_mutable_collection("params") for root in self.roots)

    def create(self, thunk: Callable[[], Any]) -> None:
        names = self.names()
        before = [(root, _copy_dicts(root.variables), root.writable_paths()) for root in self.roots]
        counters = [_copy_counters(root.counters) for root in self.roots]
        steps: dict[int, _Step] = {}
        for root in self.roots:
            for lazy in root.rngs.values():
                # Salted keys: what the pass creates draws keys that no later draw repeats.
                salted = jax.random.fold_in(lazy.rng, _CREATION_SALT)
                steps[id(lazy.rng)] = _Step(lazy.rng, salted)
        outer = _substitutions()
        outer.append({**(outer[-1] if outer else {}), **steps})
        previous = getattr(_local, "created", None)
        recorded: dict[Any, Any] = {}
        _local.created = recorded
        failed = True
        try:
            thunk()
            failed = False
        finally:
            _local.created = previous
            outer.pop()
            for (root, saved, paths), saved_counters in zip(before, counters, strict=True):
                _restore_after_creation(root, saved, paths, recorded, keep_new=not failed)
                _restore_counters(root.counters, saved_counters)
                if not failed:
                    self._created.append((root, root.writable_paths() - paths))
            self.restore_names(names)

    def undo_creation(self) -> None:
        """Removes what ``create`` kept, when the call after it failed."""
        for root, paths in self._created:
            for path in paths:
                if _get_path(root.variables, path, _MISSING) is not _MISSING:
                    _delete(root.variables, path)
        self._created = []


def _restore_after_creation(
    root: _Root,
    saved: dict[str, Any],
    paths_before: set[tuple[str, ...]],
    recorded: dict[Any, Any],
    keep_new: bool,
) -> None:
    """Keeps what the pass created (params; other variables at their initial value)."""
    for path in root.writable_paths() - paths_before:
        col, *rest = path
        initial = recorded.get((id(root.variables), col, tuple(rest)), _MISSING)
        if keep_new and col == "params":
            continue
        if keep_new and initial is not _MISSING:
            parent, key = _lookup(root.variables[col], tuple(rest))
            parent[key] = initial
            continue
        # Written without an initializer (``sow``): the apply pass writes it again.
        _delete(root.variables, path)
    for col, tree in saved.items():
        if col not in root.variables or not isinstance(tree, dict):
            continue
        for path, value in _paths(tree):
            parent, key = _lookup(root.variables[col], path)
            parent[key] = value


_MISSING: Any = object()


def _created_error(where: str, created: list[tuple[str, ...]]) -> LinenStateError:
    names = ", ".join("/".join(path) for path in created)
    return LinenStateError(
        f"{where}: the traced function created Linen variables {names}, which "
        "would leak out of the JAX trace. At init, jaxoverride_linen runs each body once "
        "outside the trace to create its variables; at apply, pass the variables that "
        "init returned and list the collections written inside the loop in "
        "apply(..., mutable=[...]), or create these variables before the loop."
    )


def source(where: str, *, allow_fresh: bool = False) -> LinenSource:
    """The state source of the Linen modules running now."""
    return LinenSource(where, allow_fresh=allow_fresh)
