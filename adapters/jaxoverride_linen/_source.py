"""Linen's implicit state as a kit ``StateSource``: variable collections, rng and names.

A bound module keeps its variables in its root scope's ``_variables``, draws keys by
folding Python counters into the root key, and names submodules with counters kept on the
running modules and scopes; a JAX loop body sees none of that, so:

* the *mutable* collections (``params`` too at init) are threaded: written in place while
  a body runs, the caller's values put back afterwards;
* each rng stream is threaded as one *step key* that ``make_rng`` folds into instead of
  the root key; the counters are restored, so a retrace draws the same keys;
* ``names()`` copies the naming state of the modules on Linen's module stack.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax.core import scope as core_scope, tracers as core_tracers
from flax.linen import module as linen_module

from jaxoverride import adapter_kit as kit
from jaxoverride.errors import JaxoverrideError
from jaxoverride_linen import _declared, _trees as trees
from jaxoverride_linen._guards import lifted_params, stream
from jaxoverride_linen._per_thread import local as _local

Scope = core_scope.Scope
LazyRng = core_scope.LazyRng

_linen_context = linen_module._context  # the thread-local module stack of Linen
_Module = linen_module.Module
_NEXT_STEP = 0x7FFF_FFF1  # folded into a step key to get the next iteration's key
_CREATION_SALT = 0x7FFF_FFF3  # folded into the root keys during a creation pass


def in_bound_module() -> bool:
    """Whether a method of a bound Linen module is running (the adapter's predicate).

    Returns:
      True inside ``init``, ``apply`` and methods of bound modules; False inside a JAX
      primitive's rule traced apart from the module's trace, where no Linen value is usable.

    Example:
      >>> import flax.linen as nn, jaxoverride_linen
      >>> class Probe(nn.Module):
      ...     def __call__(self, x):
      ...         return jaxoverride_linen.in_bound_module()
      >>> jaxoverride_linen.in_bound_module(), Probe().apply({}, 1.0)
      (False, True)
    """
    stack = _linen_context.module_stack
    return stack[-1] is not None and not _detached(stack)


def _detached(stack: list[Any]) -> bool:
    """Whether the running modules' values are out of reach of the JAX trace running now
    (a primitive's rule traced while the method is on the Python stack: threading there
    would leak a tracer). Inside a lifted rule, ``params`` reads see the rule's argument."""
    seen: set[int] = set()
    for module in stack:
        scope = None if module is None else module.scope
        if scope is None or id(scope.root) in seen:
            continue
        root = scope.root
        seen.add(id(root))
        variables: Any = root._variables
        lifted = lifted_params(variables)
        if lifted is not None:
            variables = {col: tree for col, tree in variables.items() if col != "params"}
            variables["params"] = lifted
        if kit.escaped_tracers((variables, [lazy.rng for lazy in root.rngs.values()])):
            return True
    return False


# -- rng substitution ------------------------------------------------------------------


class _Step:
    """One rng stream's root key and the step key that replaces it inside a body."""

    __slots__ = ("key", "root", "used")

    def __init__(self, root: Any, key: Any):
        self.root = root
        self.key = key
        self.used = False


# The wrappers below behave exactly as Linen's own methods unless a threaded body or a
# creation pass of this adapter is running in this thread (one thread-local read).
# ``_patches`` puts them on ``Scope`` only while the adapter is in use.


def wrap_make_rng(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Scope.make_rng`` drawing from the step key of a threaded body, if one runs."""

    def make_rng(self: Scope, name: str = "params") -> Any:
        stack = _local.steps
        policy = declaration()
        if not stack and policy is None:
            return original(self, name)
        rngs: Any = self.rngs  # LazyRng values, though Flax annotates them as keys
        resolved = stream(self, name)
        lazy = rngs.get(resolved)
        if lazy is None:
            return original(self, name)
        step = stack[-1].get(id(lazy.rng)) if stack else None
        if step is not None and step.root is not lazy.rng:
            step = None
        # A stream that ``jaxoverride.solve_state`` freezes draws from its entry key.
        declared = None if policy is None else policy.frozen.get(_rng_slot(self.root, resolved))
        if step is None and declared is None:
            return original(self, name)
        if step is not None and declared is None:
            # Only here is the step used: a body whose draws are all frozen leaves the
            # stream as it entered it.
            step.used = True
        key = declared if declared is not None else step.key  # type: ignore[union-attr]
        rngs[resolved] = LazyRng(key, lazy.suffix)
        try:
            return original(self, name)
        finally:
            rngs[resolved] = lazy

    return make_rng


def wrap_variable(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Scope.variable`` recording the initial value of what a creation pass creates."""

    def variable(self: Scope, col: str, name: str, *args: Any, **kwargs: Any) -> Any:
        recorder = _local.created
        if recorder is None or self.has_variable(col, name):
            return original(self, col, name, *args, **kwargs)
        result = original(self, col, name, *args, **kwargs)
        key = (id(self.root._variables), col, (*self.path, name))
        recorder[key] = self.get_variable(col, name)
        return result

    return variable


def wrap_put_variable(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Scope.put_variable`` refusing, in a traced body, a write no threading carries."""

    def put_variable(self: Scope, col: str, name: str, value: Any) -> Any:
        foreign = _local.foreign
        if foreign and id(self.root._variables) in foreign and self.is_mutable_collection(col):
            raise _foreign_write_error(f"{col}/{'/'.join((*self.path, name))}")
        threaded = _local.roots
        if threaded:
            root = self.root
            if id(root._variables) not in threaded[-1] and root.trace_level != (
                core_tracers.current_trace()
            ):
                raise LinenStateError(
                    f"Linen variable {col}/{'/'.join((*self.path, name))} was written inside "
                    "a traced body, but its module is bound to a scope that does not run here "
                    "(for example a module from .bind() or a module of another model): its "
                    "variables are not threaded, so the write would leak a tracer. Call the "
                    "module from a method of the model that runs the loop (a submodule "
                    "attribute or an nn.compact submodule), or make the collection immutable."
                )
        return original(self, col, name, value)

    return put_variable


def declaration() -> kit.Participant | None:
    """The ``jaxoverride.solve_state`` that Linen's state runs under here, or None (a custom
    rule's may have exited: ``_declared.evaluating``)."""
    declared = _local.declared
    return declared[-1] if declared else kit.participant(LinenSource)


def _rng_slot(root: Scope, name: str) -> tuple[str, int, str]:
    """The ``StatePart`` slot of rng stream ``name`` of the root scope ``root``."""
    return ("rng", id(root._variables), name)


# -- variable trees --------------------------------------------------------------------


class _Root:
    """One root scope reached from the module stack (rewound copies share its dicts)."""

    __slots__ = ("counters", "modules", "rngs", "scope", "variables")

    def __init__(self, scope: Scope):
        self.modules: list[Any] = []  # the stack's modules bound under this root
        self.scope = scope
        self.variables: dict[str, Any] = scope._variables
        self.counters: dict[Any, Any] = scope.rng_counters
        self.rngs: dict[str, Any] = scope.rngs

    def threaded_collections(self) -> list[str]:
        scope = self.scope
        return [
            col for col in self.variables if col != "params" and scope.is_mutable_collection(col)
        ]

    def evict_stale_caches(self) -> None:
        """After variables were removed: the scopes of the modules that outlive this call
        (the stack's, and their submodules) forget the dicts that are gone."""
        trees.evict_stale_caches(_scopes_under(self.modules), self.variables)

    def writable_paths(self) -> set[tuple[str, ...]]:
        scope = self.scope
        return {
            (col, *path)
            for col, tree in self.variables.items()
            if scope.is_mutable_collection(col) and isinstance(tree, dict)
            for path, _ in trees.paths(tree)
        }


def _scopes_under(modules: list[Any]) -> Iterator[Any]:
    seen: set[int] = set()
    pending = list(modules)
    while pending:
        module = pending.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        if module.scope is not None:
            yield module.scope
        pending.extend(c for c in module._state.children.values() if isinstance(c, _Module))


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

    Also for a write, in a traced body, to a module bound elsewhere (``module.bind``).

    Example:
      >>> import jaxoverride.errors, jaxoverride_linen
      >>> issubclass(jaxoverride_linen.LinenStateError, jaxoverride.errors.JaxoverrideError)
      True
    """


def _mutable_trees(root: _Root) -> dict[str, Any]:
    scope = root.scope
    return {
        col: trees.copy_dicts(tree)
        for col, tree in root.variables.items()
        if isinstance(tree, dict) and scope.is_mutable_collection(col)
    }


def _restore_variables(root: _Root, saved: dict[str, Any]) -> None:
    """The root's mutable collections as ``saved`` (``_mutable_trees``), in place."""
    for col in list(root.variables):
        if col not in saved and root.scope.is_mutable_collection(col):
            del root.variables[col]
    for col, tree in saved.items():
        trees.restore(root.variables.setdefault(col, {}), tree)
    root.evict_stale_caches()


def _put_collections(root: _Root, cols: dict[str, Any]) -> None:
    for col, tree in cols.items():
        live = root.variables[col]
        for path, value in trees.paths(tree):
            trees.put_path(live, path, value)


@contextlib.contextmanager
def discarding(roots: Sequence[_Root]) -> Iterator[None]:
    """Whatever runs inside leaves the roots' variables and rng counters as they were
    (``eval_shape`` drops side effects, and draws no key of a loop's stream)."""
    saved = [(root, _mutable_trees(root), trees.copy_dicts(root.counters)) for root in roots]
    try:
        yield
    finally:
        _restore_roots(saved)


def _restore_roots(saved: Iterable[tuple[_Root, dict[str, Any], dict[Any, Any]]]) -> None:
    for root, cols, counters in saved:
        _restore_variables(root, cols)
        trees.restore(root.counters, counters, fresh=0)


def _rebuild(live: Any, like: Any) -> Any:
    """The values of ``live`` at the paths of ``like`` (the threaded structure)."""
    if isinstance(like, dict):
        return {k: _rebuild(live[k], v) for k, v in like.items()}
    return live


class LinenSource(kit.EnterLeaveSource):
    """The ``StateSource`` of the modules on Linen's module stack now.

    Variables first written inside a loop body or branch at apply (a ``sow``) are *fresh*:
    the first trace records their shapes and asks for a retrace (``retrace()``) with a slot
    for them; the last iteration's value comes out once per call (``vmap``/``pmap`` stack it:
    ``fresh_axes``). Where ``allow_fresh=False`` (``shard_map``, a custom rule) such a write
    is a ``LinenStateError``.
    """

    alternative_branches = True
    framework: ClassVar[str | None] = "linen"  # its key for ``jaxoverride.solve_state`` (``parts``)

    __slots__ = (
        "_counters_at_read",
        "_created",
        "_entry_counters",
        "_retrace",
        "_written",
        "allow_fresh",
        "fresh",
        "modules",
        "roots",
        "where",
    )

    def __init__(
        self,
        where: str,
        *,
        allow_fresh: bool = False,
        modules: list[Any] | None = None,
        solve_entry: bool = False,
    ):
        self.where = where
        # The source of a ``solve_state`` declaration (``solve_entry``): the rng counters
        # after its first ``read()`` (the entry snapshot), per root.
        self._entry_counters: dict[int, Any] | None = {} if solve_entry else None
        self.allow_fresh = allow_fresh
        self._retrace = False
        self._created: list[tuple[_Root, set[tuple[str, ...]]]] = []
        # ``modules``: those of an earlier call's stack, when a custom rule's bwd runs
        # after the call returned (``_rules._Backward``).
        if modules is None:  # the bound modules running now, outermost first
            stack = _linen_context.module_stack
            modules = [m for m in stack if m is not None and m.scope is not None]
        self.modules = modules
        roots: dict[int, _Root] = {}
        for module in self.modules:
            root = module.scope.root
            roots.setdefault(id(root._variables), _Root(root)).modules.append(module)
        self.roots = list(roots.values())
        self.fresh: list[dict[tuple[str, ...], Any]] = [{} for _ in self.roots]
        self._counters_at_read: list[dict[Any, Any]] = []
        # Per traced function since ``read()``: the fresh paths it wrote (``join_names``).
        self._written: list[frozenset[tuple[int, tuple[str, ...]]]] = []

    # -- threaded state ----------------------------------------------------------------

    def read(self) -> Any:
        self._counters_at_read = [trees.copy_dicts(root.counters) for root in self.roots]
        self._written = []
        policy = declaration()
        state = []
        for root, fresh in zip(self.roots, self.fresh, strict=True):
            threaded = root.threaded_collections()
            cols = {col: trees.copy_dicts(root.variables[col]) for col in threaded}
            keys = {name: self._key(policy, root, name) for name in sorted(root.rngs)}
            # A slot: the value, and whether it was written (a loop may run zero
            # times, a branch may not be taken): only a written slot comes out.
            slots = {
                path: (jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), aval), jnp.bool_(False))
                for path, aval in fresh.items()
            }
            state.append((cols, keys, slots))
        entry = self._entry_counters
        if entry is not None and not entry:
            entry.update((id(r.variables), trees.copy_dicts(r.counters)) for r in self.roots)
        return state if policy is None else policy.current(state)

    # -- jaxoverride.solve_state ---------------------------------------------------------

    def parts(self, state: Any) -> list[kit.StatePart | None]:
        """What each leaf of ``read()``'s state is for ``jaxoverride.solve_state``: a
        collection's leaf, a stream's key, or nothing (a fresh slot)."""
        parts: list[kit.StatePart | None] = []
        for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]:
            index, kind = path[0].idx, path[1].idx  # type: ignore[attr-defined]
            root = self.roots[index].scope
            if kind == 0:
                col = path[2].key  # type: ignore[attr-defined]
                rest = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path[3:])
                slot = ("state", id(root._variables), col, rest)
                parts.append(kit.StatePart("state", (col,), slot))
            elif kind == 1:
                name = path[2].key  # type: ignore[attr-defined]
                parts.append(kit.StatePart("rng", (name,), _rng_slot(root, name)))
            else:
                parts.append(None)
        return parts

    def _key(self, policy: Any, root: _Root, name: str) -> Any:
        """The step key of stream ``name`` to thread: a fresh draw, or, for a stream the
        declaration freezes and that no direct call drew from since the last boundary,
        its entry key itself (the kit tells an untouched stream by that identity)."""
        if policy is not None:
            key = policy.frozen.get(_rng_slot(root.scope, name))
            entry = None if key is None else policy.source._entry_counters
            if entry is not None and trees.stream_at(
                root.counters, entry.get(id(root.variables), {}), name
            ):
                return key
        return root.scope.make_rng(name)

    def _rewind_frozen(self, root: _Root, keys: dict[str, Any]) -> None:
        """Every stream the declaration freezes back at the entry's counters, where it is
        threaded with the entry key (``freeze`` put it there) or not threaded at all (a
        custom rule hides the streams): each evaluation draws the same keys."""
        policy = declaration()
        if policy is None:
            return
        rid = id(root.variables)
        for slot, key in _declared.frozen(policy):
            if slot[0] != "rng" or slot[1] != rid:
                continue
            name = slot[2]
            if keys.get(name, key) is key:
                entry = policy.source._entry_counters or {}
                trees.restore_stream(root.counters, entry.get(rid, {}), name)

    def enter(self, state: Any) -> _Token:
        token = _Token()
        outer = _local.steps
        steps: dict[int, _Step] = dict(outer[-1]) if outer else {}
        for root, (cols, keys, slots) in zip(self.roots, state, strict=True):
            token.roots.append(root)
            token.saved.append(_mutable_trees(root))
            token.counters.append(trees.copy_dicts(root.counters))
            token.slots.append(slots)
            _put_collections(root, cols)
            for path in slots:
                if trees.get_path(root.variables, path, trees.MISSING) is not trees.MISSING:
                    trees.delete_path(root.variables, path)
            if slots:
                root.evict_stale_caches()
            for name, key in keys.items():
                lazy = root.rngs[name]
                steps[id(lazy.rng)] = token.steps[id(lazy.rng)] = _Step(lazy.rng, key)
            self._rewind_frozen(root, keys)
        outer.append(steps)
        roots = _local.roots
        roots.append((roots[-1] if roots else set()) | {id(r.variables) for r in self.roots})
        return token

    def abandon(self, token: _Token) -> None:
        _local.steps.pop()
        _local.roots.pop()
        _restore_roots(zip(token.roots, token.saved, token.counters, strict=True))

    def leave(self, token: _Token) -> Any:
        after = []
        created: list[tuple[Any, ...]] = []
        written: set[tuple[int, tuple[str, ...]]] = set()
        state = []
        for index, (root, saved) in enumerate(zip(token.roots, token.saved, strict=True)):
            known = {(col, *path) for col, tree in saved.items() for path, _ in trees.paths(tree)}
            fresh = self.fresh[index]
            for path in sorted(root.writable_paths() - known - set(fresh)):
                created.append((index, path))
            cols = {
                col: _rebuild(root.variables[col], trees.copy_dicts(tree))
                for col, tree in saved.items()
                if col in root.threaded_collections()
            }
            keys = {}
            for name in sorted(root.rngs):
                step = token.steps[id(root.rngs[name].rng)]
                keys[name] = jax.random.fold_in(step.key, _NEXT_STEP) if step.used else step.key
            # The slots this trace entered with: the value written, or the one entered.
            slots = {
                path: trees.get_path(root.variables, path, trees.MISSING)
                for path in token.slots[index]
            }
            written.update(
                (index, path)
                for path in fresh
                if trees.get_path(root.variables, path, trees.MISSING) is not trees.MISSING
            )
            state.append((root, cols, keys, slots))
        # Values of created variables, read before the caller's values come back.
        values = {
            (index, path): trees.get_path(token.roots[index].variables, path, None)
            for index, path in created
        }
        self.abandon(token)
        self._written.append(frozenset(written.union(created)))
        if created:
            if not self.allow_fresh or any(path[0] == "params" for _, path in created):
                raise _created_error(self.where, [p for _, p in created])
            # The trace ran to its end (aborting one leaks tracers); the kit retraces.
            aval = lambda v: jax.ShapeDtypeStruct(jnp.shape(v), jnp.result_type(v))
            for index, path in created:
                self.fresh[index][path] = jax.tree.map(aval, values[(index, path)])
            self._retrace = True
        for (_, cols, keys, slots), entered in zip(state, token.slots, strict=True):
            slots = {
                p: entered[p] if v is trees.MISSING else (v, jnp.bool_(True))
                for p, v in slots.items()
            }
            after.append((cols, keys, slots))
        return after

    def fresh_axes(self, axis: int) -> list[Any]:
        """A prefix of the threaded state for ``vmap``'s ``out_axes``: the fresh slots
        stacked along ``axis`` (as ``nn.vmap``'s ``variable_axes``), the rest shared."""
        return [(None, None, dict.fromkeys(fresh, (axis, None))) for fresh in self.fresh]

    def retrace(self) -> bool:
        """True once after a trace met fresh variables; restores the draws of ``read()``."""
        if not self._retrace:
            return False
        self._rewind_counters()
        return True

    def check_unknown_trips(self, state: Any) -> None:
        """Refuses the fresh slots of a loop whose trip count is traced (the kit asks):
        whether they exist after it would depend on a traced value. The rng counters are
        put back as before the loop."""
        unknown = [
            path
            for (_, _, slots) in state
            for path, (_, written) in slots.items()
            if _concrete(written) is None
        ]
        if not unknown:
            return
        self._rewind_counters()
        raise _unknown_trips_error(self.where, unknown)

    def _rewind_counters(self) -> None:
        """No retrace; the rng counters back as ``read()`` found them."""
        self._retrace = False
        for root, counters in zip(self.roots, self._counters_at_read, strict=True):
            trees.restore(root.counters, counters, fresh=0)

    def write(self, state: Any) -> None:
        for root, (cols, keys, slots) in zip(self.roots, state, strict=True):
            self._rewind_frozen(root, keys)
            _put_collections(root, cols)
            for path, (value, written) in slots.items():
                # A traced flag here is of a call that ran: the kit asked
                # ``check_unknown_trips`` about every loop with a traced trip count.
                if _concrete(written) is not False:
                    trees.put_path(root.variables, path, value)

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

    def join_names(self, ends: list[Any]) -> Any:
        """The naming state after a ``cond``/``switch`` whose branches ended in ``ends``:
        every name any branch took stays taken (cursors at their furthest, children and
        reservations united). Branches that first write different variables are refused,
        as ``nn.cond`` refuses them: JAX fixes a call's outputs when it traces it."""
        if len(set(self._written)) > 1:
            raise _branch_writes_error(self.where, self._written)
        joined = []
        for entries in zip(*ends, strict=True):
            module, cursor, children, scope, reservations = entries[0]
            cursor, children = dict(cursor), dict(children)
            reservations = {k: set(v) for k, v in reservations.items()}
            for _, other_cursor, other_children, _, other_reservations in entries[1:]:
                for key, count in other_cursor.items():
                    cursor[key] = max(cursor.get(key, 0), count)
                for name, child in other_children.items():
                    children.setdefault(name, child)
                for key, names in other_reservations.items():
                    reservations.setdefault(key, set()).update(names)
            joined.append((module, cursor, children, scope, reservations))
        return joined

    # -- creation ----------------------------------------------------------------------

    def initializing(self) -> bool:
        return any(root.scope.is_mutable_collection("params") for root in self.roots)

    def create(self, thunk: Callable[[], Any]) -> None:
        names = self.names()
        before = [
            (root, trees.copy_dicts(root.variables), root.writable_paths()) for root in self.roots
        ]
        counters = [trees.copy_dicts(root.counters) for root in self.roots]
        steps: dict[int, _Step] = {}
        for root in self.roots:
            for lazy in root.rngs.values():
                # Salted keys: what the pass creates draws keys that no later draw repeats.
                salted = jax.random.fold_in(lazy.rng, _CREATION_SALT)
                steps[id(lazy.rng)] = _Step(lazy.rng, salted)
        outer = _local.steps
        outer.append({**(outer[-1] if outer else {}), **steps})
        previous = _local.created
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
                trees.restore(root.counters, saved_counters, fresh=0)
                if not failed:
                    self._created.append((root, root.writable_paths() - paths))
            self.restore_names(names)

    def undo_creation(self) -> None:
        """Removes what ``create`` kept, when the call after it failed."""
        for root, paths in self._created:
            for path in paths:
                if trees.get_path(root.variables, path, trees.MISSING) is not trees.MISSING:
                    trees.delete_path(root.variables, path)
            root.evict_stale_caches()
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
        initial = recorded.get((id(root.variables), col, tuple(rest)), trees.MISSING)
        if keep_new and col == "params":
            continue
        if keep_new and initial is not trees.MISSING:
            trees.put_path(root.variables[col], tuple(rest), initial)
            continue
        # Written without an initializer (``sow``): the apply pass writes it again.
        trees.delete_path(root.variables, path)
    for col, tree in saved.items():
        if col not in root.variables or not isinstance(tree, dict):
            continue
        for path, value in trees.paths(tree):
            trees.put_path(root.variables[col], path, value)
    root.evict_stale_caches()


def _concrete(flag: Any) -> bool | None:
    """A slot's written flag as a Python bool; None where it is traced."""
    try:
        return bool(flag)
    except jax.errors.ConcretizationTypeError:
        return None


def _unknown_trips_error(where: str, paths: list[tuple[str, ...]]) -> LinenStateError:
    described = ", ".join(f"{'/'.join(rest)} in collection {col!r}" for col, *rest in paths)
    return LinenStateError(
        f"{where}: the loop body first writes Linen variables that do not exist before "
        f"the loop ({described}), and the loop's trip count is not known when it is "
        "traced (a while_loop under jax.jit or another transform, or a fori_loop with "
        "traced bounds). Whether they exist after it would depend on a traced value, "
        "but their presence is structure, which JAX fixes when it traces the call: a "
        "loop that ran zero times would still report them (Python reports nothing). "
        "The variables a loop writes must exist before it (Flax's nn.while_loop refuses "
        "collections it does not carry, too). Sow or create an initial value before "
        "the loop (self.sow(col, name, value, reduce_fn=..., init_fn=...), or "
        "self.variable(col, name, init_fn) outside the body), or use a scan or a "
        "fori_loop with static bounds."
    )


def _foreign_write_error(variable: str) -> LinenStateError:
    return LinenStateError(
        f"Linen variable {variable} was written by a module bound outside the JAX trace "
        "that runs it: a module from .bind() (or one of its submodules) was called inside "
        "a transform or loop that no method of the module started (a jaxoverride.lax.scan "
        "or jax.jit in a free function), so nothing threads its variables and the write "
        "would leave a tracer in module.variables. Run the loop inside a method of the "
        "module (jaxoverride_linen then threads its state), use Flax's nn.scan, or bind "
        "without that collection mutable."
    )


def _branch_writes_error(
    where: str, written: list[frozenset[tuple[int, tuple[str, ...]]]]
) -> LinenStateError:
    described = "; ".join(
        f"branch {i} writes " + (", ".join(sorted("/".join(p) for _, p in w)) or "none")
        for i, w in enumerate(written)
    )
    return LinenStateError(
        f"{where}: the branches first write different Linen variables ({described}). "
        "Which of them comes out would depend on the branch taken, but JAX fixes what a "
        "cond or switch returns when it traces it (nn.cond refuses this too). Write (sow) "
        "the same names in every branch, or sow the branch's result after the call."
    )


def _created_error(where: str, created: list[tuple[str, ...]]) -> LinenStateError:
    names = ", ".join("/".join(path) for path in created)
    return LinenStateError(
        f"{where}: the traced function created Linen variables {names}, which "
        "would leak out of the JAX trace. At init, jaxoverride_linen runs each body once "
        "outside the trace to create its variables; at apply, pass the variables that "
        "init returned and list the collections written inside the loop in "
        "apply(..., mutable=[...]), or create these variables before the loop."
    )


def source(where: str, *, allow_fresh: bool = False, solve_entry: bool = False) -> LinenSource:
    """The state source of the Linen modules running now (``solve_entry``: a
    ``jaxoverride.solve_state``'s, keeping its entry rng counters)."""
    if not _in_use:
        raise LinenStateError(
            f"{where}: the Linen overrides run, but jaxoverride_linen is not in use: they "
            "were entered as a plain mapping (override_context({**jaxoverride_linen."
            "context(), ...}) or a layer copied elsewhere), so Linen's scopes are not "
            "prepared and the state would not be threaded. Enter jaxoverride_linen.context() "
            "itself (it can be nested inside or around other contexts), or call "
            "jaxoverride_linen.install()."
        )
    return LinenSource(where, allow_fresh=allow_fresh, solve_entry=solve_entry)


# Set by ``_patches`` while Linen's scopes carry this adapter's wrappers.
_in_use: list[bool] = []
