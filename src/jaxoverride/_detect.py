"""The missing-adapter check: a neutral function met framework state no adapter handles.

Once a registered framework (``_frameworks``) is imported and no adapter of it is active,
the check refuses: inside a scope of a scoped framework, a call that leaves tracers in its
``leaked_state()``; for a closure-captured framework, a transform whose function (or a
jit's static arguments) captures its state and is jitted (weights baked in) or
differentiated with respect to it (a zero gradient), and a write to captured state. Under
an adapter of the framework, captured state its ``covers=`` predicate does not cover.

Idle cost: one length comparison of ``sys.modules`` per neutral call while no framework is
imported; a transform pays at creation, and gets a checked target only if built inside a
framework scope or over captured state.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import operator
import os
import sys
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, NoReturn

import jax
import numpy as np
from jax.core import Tracer

from jaxoverride import _frameworks, _stack
from jaxoverride._compat import jit_name
from jaxoverride._frameworks import Framework
from jaxoverride._user_frames import call_made, names_of
from jaxoverride._words import counted, listed
from jaxoverride.errors import MissingAdapterError, _missing_adapter_also

ENV_VAR = "JAXOVERRIDE_ADAPTER_CHECK"
_OFF = {"0", "false", "off", "no"}
enabled = os.environ.get(ENV_VAR, "1").strip().lower() not in _OFF

# Names whose silent failure with captured framework state is a wrong result, not an error.
_BAKES = frozenset({"jit", "pmap"})
_DIFFERENTIATES = frozenset(
    {"grad", "value_and_grad", "jacfwd", "jacrev", "hessian", "jvp", "vjp", "linearize"}
)
_SEARCH_DEPTH = 3
_SEARCH_LIMIT = 512  # objects visited per search: a bound, not a tuning knob
Captured = list[tuple[str, Any]]
Args = tuple[Any, ...]
Kwargs = dict[str, Any]


def set_adapter_check(on: bool) -> bool:
    """Turns the missing-adapter check on or off for the whole process.

    The check raises ``MissingAdapterError`` where a neutral function meets state of a
    registered framework that no active adapter handles (a silently wrong result). Turn it
    off only for a program that means it; ``JAXOVERRIDE_ADAPTER_CHECK=0`` does at start-up.

    Args:
      on: whether the check runs.

    Returns:
      Whether it ran before this call.

    Example:
      >>> import jaxoverride as jo
      >>> previous = jo.set_adapter_check(False)
      >>> jo.set_adapter_check(previous)
      False
    """
    global enabled
    if not isinstance(on, bool):
        raise TypeError(f"jaxoverride.set_adapter_check expects True or False, got {on!r}.")
    previous, enabled = enabled, on
    if on and not previous:
        _stack.modules_seen = -1  # the first-call check looks at the solver libraries again
    return previous


def watching() -> bool:
    """Whether the check is on and a framework is imported (re-read when modules change)."""
    if not enabled:
        return False
    if len(_MODULES) != _frameworks.seen:
        _frameworks.refresh()
    return _frameworks.watched


_MODULES = sys.modules  # one object for the life of the interpreter


_HATCH = (
    " If the program means this, turn the check off with jaxoverride.set_adapter_check(False) "
    f"or the environment variable {ENV_VAR}=0."
)


def _handled(framework: Framework, snapshot: _stack.Snapshot) -> bool:
    """Whether a layer of ``snapshot`` handles ``framework``, remembered per snapshot."""
    answers = _frameworks.handled_by[framework.key]
    handled = answers.get(snapshot)
    if handled is None:
        if len(answers) >= _HANDLED_LIMIT:
            answers.clear()
        labels = _frameworks.labels[framework.key]
        handled = answers[snapshot] = any(layer.label in labels for layer in snapshot.layers)
    return handled


_HANDLED_LIMIT = 256  # snapshots are interned: a bound, not a tuning knob


def _covered(framework: Framework, value: Any) -> bool:
    predicates = _frameworks.covers.get(framework.key)
    return not predicates or any(predicate(value) for predicate in predicates)


def _values_of(
    fun: Any, label: str = "the function", deep: bool = False
) -> Iterator[tuple[str, Any]]:
    """``(name, value)`` for what ``fun`` reaches without being called (``_function_values``,
    partial arguments, a bound method's object, items of lists and dicts), to a fixed
    depth. With ``deep`` (a jit's static arguments), containers do not count as a level
    and the attributes of plain objects are followed too."""
    pending: list[tuple[Any, int, str]] = [(fun, 0, label)]
    seen: set[int] = set()
    while pending and len(seen) < _SEARCH_LIMIT:
        value, depth, name = pending.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        yield name, value
        container = isinstance(value, (list, tuple, dict))
        if depth >= _SEARCH_DEPTH and not (deep and container):
            continue
        inner: list[tuple[str, Any]] = []
        if isinstance(value, functools.partial):
            inner = [("partial", item) for item in (value.func, *value.args)]
            inner += list(value.keywords.items())
        elif isinstance(value, types.MethodType):
            inner = [("self", value.__self__), (name, value.__func__)]
        elif isinstance(value, types.FunctionType):
            inner = _function_values(value)
            wrapped = getattr(value, "__wrapped__", None)
            if wrapped is not None:
                inner.append((name, wrapped))
        elif isinstance(value, (list, tuple)):
            inner = [(f"{name}[{i}]", item) for i, item in enumerate(value[:64])]
        elif isinstance(value, dict):
            inner = [(f"{name}[{k!r}]", item) for k, item in list(value.items())[:64]]
        elif deep and not isinstance(value, _OPAQUE) and not is_state(value):
            try:  # the instance's own attributes: no property or __getattr__ runs
                attributes = object.__getattribute__(value, "__dict__")
            except AttributeError:
                attributes = None
            if isinstance(attributes, dict):
                inner = [(f"{name}.{k}", item) for k, item in list(attributes.items())[:64]]
        step = depth if deep and container else depth + 1
        pending += [
            (item, step, key) for key, item in inner if not isinstance(item, types.ModuleType)
        ]


# What a deep search does not look inside: it holds no framework state.
_OPAQUE = (str, bytes, int, float, complex, type, types.CodeType, jax.Array, np.ndarray)


def _static_state(args: Args, kwargs: Kwargs) -> Captured:
    """The framework state that the static arguments of a ``jax.jit`` trace reach (those with a
    leaf that is not a tracer): JAX caches the trace by them, so their weights are baked
    in as the function's own captured ones are. Asked where JAX traces, never per call."""
    found: Captured = []
    for label, value in [*(("a static argument", arg) for arg in args), *kwargs.items()]:
        leaves = jax.tree_util.tree_leaves(value)
        if leaves and all(isinstance(leaf, Tracer) for leaf in leaves):
            continue
        found += [(n, v) for n, v in _values_of(value, label, deep=True) if is_state(v)]
    return found


_WALKED = (functools.partial, types.MethodType, types.FunctionType, list, tuple, dict)


@functools.lru_cache(maxsize=1024)
def _global_names(code: types.CodeType) -> tuple[str, ...]:
    """The names that ``code`` and the code nested in it look up (code is immutable)."""
    names: list[str] = []
    codes = [code]
    while codes:
        each = codes.pop()
        names += each.co_names
        codes += [c for c in each.co_consts if isinstance(c, types.CodeType)]
    return tuple(names)


def _function_values(fun: types.FunctionType) -> list[tuple[str, Any]]:
    """``(name, value)`` of ``fun``'s closure cells, defaults, keyword defaults and the
    globals its code names."""
    inner: list[tuple[str, Any]] = []
    for free, cell in zip(fun.__code__.co_freevars, fun.__closure__ or (), strict=False):
        try:
            inner.append((free, cell.cell_contents))
        except ValueError:  # an empty cell
            pass
    inner += [("default", item) for item in fun.__defaults__ or ()]
    inner += list((fun.__kwdefaults__ or {}).items())
    namespace = fun.__globals__
    return inner + [(n, namespace[n]) for n in _global_names(fun.__code__) if n in namespace]


def _shallow_values(fun: Any) -> list[tuple[str, Any]] | None:
    """What ``_values_of(fun)`` yields, in its order, for a function none of whose direct
    values is searched further (``lambda x: model(x)``); None where it needs the search."""
    if type(fun) is not types.FunctionType:
        return None
    inner = _function_values(fun)
    if len(inner) >= _SEARCH_LIMIT or getattr(fun, "__wrapped__", None) is not None:
        return None
    seen = {id(fun)}
    values = []
    for name, value in reversed(inner):  # the search pops its pending list from the end
        if isinstance(value, _WALKED):
            return None
        if isinstance(value, types.ModuleType) or id(value) in seen:
            continue
        seen.add(id(value))
        values.append((name, value))
    return values


def is_state(value: Any) -> bool:
    """Whether ``value`` is the state of a live closure-captured framework."""
    return any(framework.is_state(value) for framework in _frameworks.capturing)


def captured_state(fun: Any) -> Captured:
    """``(name, object)`` for the framework state that ``fun`` captures (empty while no
    closure-captured framework is imported)."""
    capturing = _frameworks.capturing
    if not capturing:
        return []
    values = _shallow_values(fun)
    found = _values_of(fun) if values is None else values
    if len(capturing) == 1:
        one = capturing[0].is_state
        return [(name, value) for name, value in found if one(value)]
    return [(name, value) for name, value in found if is_state(value)]


def _owned(framework: Framework, captured: Captured) -> Captured:
    """The part of ``captured`` that is ``framework``'s state."""
    if len(_frameworks.capturing) == 1:
        return captured
    return [(name, value) for name, value in captured if framework.is_state(value)]


def _describe(captured: Captured) -> str:
    return listed([f"`{name}` ({type(value).__name__})" for name, value in captured], 4)


def _fix(framework: Framework, captured: Captured, active: bool = False) -> str:
    """The record's fix naming what ``captured`` holds: each name's root, as an
    identifier (``"model"`` for one that is not)."""
    roots = (name.split("[", 1)[0] for name, _ in captured)
    names = list(dict.fromkeys(root if root.isidentifier() else "model" for root in roots))
    if not active:
        return framework.fix_for(names)
    covered = names_of(lambda value: framework.is_state(value) and _covered(framework, value))
    return framework.fix_for(names, covered=covered)


def _raise_on_new_tracers(scopes: list[Framework], before: Kwargs, name: str, when: str) -> None:
    """Raises for the first framework whose state gained tracers since ``before``."""
    for framework in scopes:
        leaked = _frameworks.new_tracers(before[framework.key], framework.leaked_state())
        if leaked:
            raise MissingAdapterError(
                f"{call_made(f'jaxoverride.{name}')} met {framework.title}, and no adapter "
                f"that handles {framework.key} is active: "
                f"{leak_text(framework, leaked, 'the function', when)} (the first use then "
                "fails far from here, or the result is silently wrong). "
                f"Fix: {framework.fix}.{_HATCH}"
            )


def leak_text(framework: Framework, leaked: list[Any], subject: str, when: str) -> str:
    """What ``leaked`` (the framework's new tracers) means, for a message: ``subject``
    (``"the function"``) did what left them ``when`` (``"under a raw JAX trace"``)."""
    count = framework.counted(leaked)
    if not count:  # only the framework's own bookkeeping: Haiku's rng key sequence
        return f"{subject} drew an rng key {when}, so the key sequence would hold a tracer"
    tracers = counted(count, "of them would be a tracer", "of them would be tracers")
    return f"{subject} created parameters or wrote state {when}, so {tracers}"


def _refusal(
    framework: Framework, name: str, captured: Captured, snapshot: _stack.Snapshot, diff: Any
) -> str | None:
    """Why running ``name`` over ``framework``'s captured state would be silently wrong."""
    if not captured:
        return None
    if _handled(framework, snapshot):
        uncovered = [(n, value) for n, value in captured if not _covered(framework, value)]
        if uncovered:
            return (
                f"the function captures {_describe(uncovered)}, which the active adapter of "
                f"{framework.key} does not cover, so its weights would be baked in or its "
                f"gradient lost. Fix: {_fix(framework, uncovered, active=True)}."
            )
        return None
    if name in _BAKES:
        return (
            f"the function captures {_describe(captured)}; jax.{name} would bake their "
            "current weights in as constants and keep returning them after they change. "
            f"Fix: {_fix(framework, captured)}."
        )
    if name in _DIFFERENTIATES and any(framework.is_state(v) for _, v in _values_of(diff)):
        return (
            f"the function captures {_describe(captured)} and is differentiated with respect "
            f"to {framework.key} state; the captured copy is not the one being "
            f"differentiated, so its gradient would be silently zero. "
            f"Fix: {_fix(framework, captured)}."
        )
    return None


def _refuse_captured(
    name: str,
    captured: Captured,
    snapshot: _stack.Snapshot,
    differentiated: Any,
    handled: bool | None = None,
) -> None:
    """Raises for the first closure-captured framework whose captured state running
    ``name`` would get silently wrong; only those whose adapter is active (``handled``
    True), or not (False), or either (None)."""
    for framework in _frameworks.capturing:
        if handled is not None and _handled(framework, snapshot) is not handled:
            continue
        owned = _owned(framework, captured)
        refusal = _refusal(framework, name, owned, snapshot, differentiated)
        if refusal is not None:
            raise MissingAdapterError(
                f"{call_made(f'jaxoverride.{name}')} met {framework.title}: {refusal}{_HATCH}"
            )


def _write_refused(
    name: str,
    error: BaseException,
    snapshot: _stack.Snapshot,
    captured: Captured,
    search: Args,
) -> BaseException | None:
    """The ``MissingAdapterError`` for ``error``, a framework's own error for a write to its
    state captured (``captured``, or by a function in ``search``) under no adapter of it;
    None to let ``error`` through."""
    for framework in _frameworks.capturing:
        framework_error = framework.write_error()
        if framework_error is None or not isinstance(error, framework_error):
            continue
        if _handled(framework, snapshot):
            continue
        found = captured or [item for value in search for item in captured_state(value)]
        found = _owned(framework, found)
        if not found:
            continue
        return _missing_adapter_also(framework_error)(
            f"{call_made(f'jaxoverride.{name}')} ran a function that writes the "
            f"{framework.key} state it captures ({_describe(found)}), which raw JAX cannot "
            f"thread, and no adapter of {framework.key} is active. "
            f"Fix: {_fix(framework, found)}.{_HATCH}"
        )
    return None


def _run_checked(
    name: str,
    run: Callable[..., Any],
    args: Args,
    kwargs: Kwargs,
    snapshot: _stack.Snapshot,
    captured: Captured,
    differentiated: Any,
    search: Args = (),
) -> Any:
    """Runs ``run`` under the check. ``search`` holds what to look for captured framework
    state in only if the call fails with the framework's own write error (control flow,
    where a read is right and a write raises)."""
    # Under a framework's adapter its own, more precise errors (a write to state it does
    # not cover) come first, so that refusal waits until the call has run.
    if captured:
        _refuse_captured(name, captured, snapshot, differentiated, handled=False)
    scopes = [f for f in _frameworks.scoped if f.running() and not _handled(f, snapshot)]
    before = {f.key: f.leaked_state() for f in scopes}
    try:
        out = run(*args, **kwargs)
    except BaseException as error:
        refusal = _write_refused(name, error, snapshot, captured, search)
        if refusal is not None:
            raise refusal from error
        raise
    if captured:
        _refuse_captured(name, captured, snapshot, differentiated, handled=True)
    _raise_on_new_tracers(scopes, before, name, "under a raw JAX trace")
    return out


def _functions(args: Args, kwargs: Kwargs) -> Args:
    return tuple(
        value
        for value in (*args, *kwargs.values())
        if callable(value) and not isinstance(value, type)
    )


def run_call(
    name: str,
    run: Callable[..., Any],
    args: Args,
    kwargs: Kwargs,
    snapshot: _stack.Snapshot,
) -> Any:
    """Runs a neutral call (``lax.scan``, ``jvp``, ...) under the check."""
    running = False
    for probe in _frameworks.probes:  # ``scope_running``, without its frame
        if probe():
            running = True
            break
    if name not in _DIFFERENTIATES and not running:
        # The common case: nothing to compare afterwards, nothing to search beforehand.
        try:
            return run(*args, **kwargs)
        except BaseException as error:
            refusal = _write_refused(name, error, snapshot, [], _functions(args, kwargs))
            if refusal is None:
                raise
            raise refusal from error
    captured: Captured = []
    search: Args = ()
    # Under a framework's adapter, control flow threads what it reaches itself: no search.
    if any(not _handled(framework, snapshot) for framework in _frameworks.capturing):
        functions = _functions(args, kwargs)
        if name in _DIFFERENTIATES:
            captured = [found for value in functions for found in captured_state(value)]
        else:  # searched only if the call fails: an idle eager loop pays nothing for it
            search = functions
    # A call's first argument is the function; what it differentiates comes after.
    return _run_checked(name, run, args, kwargs, snapshot, captured, (args[1:], kwargs), search)


class _Memo(NamedTuple):
    """The last shallow lookup of a ``TransformCheck``: what it read and what it found."""

    code: types.CodeType  # the function's code then (its global names follow from it)
    names: tuple[str, ...]  # the globals that code names
    ids: tuple[int, ...]  # of the objects _direct_values read
    classes: tuple[type, ...]  # of the same objects
    found: tuple[tuple[str, int], ...]  # the captured ones: (name, position among them)
    inline: bool = False  # it read no defaults: ``checked_call`` recalls it inline


_EMPTY = object()  # an empty closure cell or an absent global, in _direct_values
_NO_FAST = (object(), None, None, -1, None, None)  # ``guard`` with nothing to serve


def _recalled(fun: types.FunctionType, memo: _Memo) -> list[Any] | None:
    """What ``_direct_values(fun)`` reads now, where each is the object ``memo`` read
    (same identity and type); else None. Without a comprehension or a call of ours: it
    runs at every checked jitted call under an adapter."""
    if fun.__code__ is not memo.code or fun.__kwdefaults__ or "__wrapped__" in fun.__dict__:
        return None
    cells = fun.__closure__
    try:
        direct = list(map(_CELL_CONTENTS, cells)) if cells else []
    except ValueError:  # an empty cell
        return None
    if fun.__defaults__:
        direct += fun.__defaults__
    if memo.names:
        direct += map(fun.__globals__.get, memo.names, _EMPTIES)
    if tuple(map(id, direct)) == memo.ids and tuple(map(type, direct)) == memo.classes:
        return direct
    return None


_EMPTIES = itertools.repeat(_EMPTY)
_CELL_CONTENTS = operator.attrgetter("cell_contents")


def _direct_values(fun: types.FunctionType) -> list[Any] | None:
    """Every object ``_shallow_values(fun)`` reads, in a fixed order (``_EMPTY`` for an
    empty cell or an absent global); None where it reads more (keyword defaults, which
    can change in place, or ``__wrapped__``)."""
    if fun.__kwdefaults__ or getattr(fun, "__wrapped__", None) is not None:
        return None
    direct: list[Any] = []
    for cell in fun.__closure__ or ():
        try:
            direct.append(cell.cell_contents)
        except ValueError:  # an empty cell
            direct.append(_EMPTY)
    direct += fun.__defaults__ or ()
    get = fun.__globals__.get
    return direct + [get(name, _EMPTY) for name in _global_names(fun.__code__)]


class TransformCheck:
    """What a neutral transform built where the check applies checks at each call.

    It keeps no captured object, only the last lookup's ``_Memo`` (identities, types and
    the code): a call whose function reads the same objects reuses its answer, so a module
    replaced in a closure is seen and a deleted one is not kept alive.
    """

    __slots__ = ("_fast", "_memo", "framework", "fun", "name")

    def __init__(self, name: str, fun: Any):
        self.name = name
        self.fun = fun  # the transform's state holds it already
        # The one closure-captured framework live at creation, which the inline paths
        # serve; None (every call through ``run``) where none is or several are.
        capturing = _frameworks.capturing
        self.framework: Framework | None = capturing[0] if len(capturing) == 1 else None
        self._memo: _Memo | None = None  # replaced whole (threads)
        # After an inline check passed for a function of one cell that holds the one
        # captured object: (snapshot, target, code, id and type of that object, the
        # predicate covering it), for ``guard``. One tuple, replaced whole (threads).
        self._fast: list[Any] = [_NO_FAST]

    def captured(self) -> Captured:
        """``captured_state(self.fun)``, from the memo while the same objects are read."""
        fun = self.fun
        if type(fun) is not types.FunctionType or not _frameworks.capturing:
            return captured_state(fun)
        memo = self._memo
        if memo is not None:
            direct = _recalled(fun, memo)
            if direct is not None:
                return [(name, direct[at]) for name, at in memo.found]
        captured = captured_state(fun)
        self._memo = None
        direct = _direct_values(fun)
        if direct is not None and _shallow_values(fun) is not None:
            # The shallow lookup's answer depends on ``direct`` alone.
            positions = {id(value): position for position, value in enumerate(direct)}
            found = tuple((name, positions.get(id(value), -1)) for name, value in captured)
            if all(at >= 0 for _, at in found):
                code = fun.__code__
                ids, classes = tuple(map(id, direct)), tuple(map(type, direct))
                self._memo = _Memo(
                    code, _global_names(code), ids, classes, found, not fun.__defaults__
                )
        return captured

    def checked_call(
        self,
        plain: Callable[..., Any],
        builds: dict[_stack.Snapshot, Callable[..., Any]],
        build: Callable[[_stack.Snapshot], Callable[..., Any]],
        directs: dict[_stack.Snapshot, Callable[..., Any]] | None = None,
        go_direct: Callable[[_stack.Snapshot], None] | None = None,
    ) -> Callable[..., Any]:
        """The call of a checked neutral transform: it picks the target for the active
        stack (``plain`` at the root, else ``builds[snapshot]`` or ``build(snapshot)``)
        and runs it under the check. With ``directs`` (see ``guard``), a call whose check
        passed inline, in a stack that has a direct call, makes it the target (``go_direct``).

        Under an adapter of ``self.framework`` and no framework scope, a call whose
        function the memo serves checks inline what ``run`` would: that the adapter covers
        each captured object, after the call. Every other call goes through ``run``.
        """
        run = self.run
        check = self
        fun = self.fun
        root, current_get = _stack.ROOT, _stack._current_get
        framework = self.framework
        # Empty where no one framework is served: every call then goes through ``run``.
        handled_here = {} if framework is None else _frameworks.handled_by[framework.key]
        covers_of = _frameworks.covers
        key = None if framework is None else framework.key
        builds_get = builds.get
        # A function's cells are fixed for its life (``__closure__`` is read-only), and
        # so is their count for any code it may be given: only their contents change.
        plain_function = type(fun) is types.FunctionType
        cells = fun.__closure__ if plain_function else None
        one_cell = cells[0] if cells is not None and len(cells) == 1 else None
        fast = self._fast

        def checked_call(*args: Any, **kwargs: Any) -> Any:
            snapshot = current_get().snapshot
            if _stack._guards:
                snapshot = _stack.effective_snapshot()
            if snapshot is root:
                return run(plain, snapshot, args, kwargs)
            target = builds_get(snapshot)
            if target is None:
                target = build(snapshot)
            memo = check._memo
            if (
                memo is None
                or not memo.inline
                or not plain_function
                or fun.__code__ is not memo.code
                or fun.__defaults__
                or fun.__kwdefaults__
                or "__wrapped__" in fun.__dict__
                or not enabled
                or not memo.found
                or not handled_here.get(snapshot)
            ):
                return run(target, snapshot, args, kwargs)
            # Every jitted call under the adapter comes this way, or goes direct. Same
            # code, so as many cells as then.
            names = memo.names
            try:
                if one_cell is not None and not names:
                    direct = [one_cell.cell_contents]
                else:
                    direct = [cell.cell_contents for cell in cells] if cells else []
                    if names:
                        get = fun.__globals__.get
                        direct += [get(global_name, _EMPTY) for global_name in names]
            except ValueError:  # an empty cell
                return run(target, snapshot, args, kwargs)
            ids, classes = memo.ids, memo.classes
            for at, value in enumerate(direct):
                if id(value) != ids[at] or type(value) is not classes[at]:
                    return run(target, snapshot, args, kwargs)
            for running in _frameworks.probes:  # ``scope_running``, without its frame
                if running():
                    return run(target, snapshot, args, kwargs)
            out = target(*args, **kwargs) if kwargs else target(*args)
            predicates = covers_of.get(key)  # type: ignore[arg-type]
            if predicates:
                for _, at in memo.found:
                    value = direct[at]
                    for predicate in predicates:
                        if predicate(value):
                            break
                    else:
                        fast[0] = _NO_FAST
                        check._refuse([(name, direct[i]) for name, i in memo.found], snapshot)
                if one_cell is not None and not names and len(predicates) == 1:
                    fast[0] = (snapshot, target, memo.code, ids[0], classes[0], predicates[0])
                    if directs and snapshot in directs and not _stack._guards:
                        go_direct(snapshot)  # type: ignore[misc]
            return out

        return checked_call

    def guard(
        self, snapshot: _stack.Snapshot, target: Callable[..., Any]
    ) -> Callable[[], Any] | None:
        """What a direct call that serves checked calls (``jit_api``'s ``checked_direct``)
        asks at each call, for ``target`` built in ``snapshot``; None for a function that
        is not a plain one of one closure cell.

        ``captured()`` returns a token (the same object for the same captured object) where
        a call would pass the check as the last inline one did (same stack, target, code and
        cell object, no defaults, no ``__wrapped__``, no framework scope, the check on),
        but for the covering predicate, which the direct call answers itself; else None.
        """
        fun = self.fun
        if type(fun) is not types.FunctionType or self.framework is None:
            return None
        cells = fun.__closure__
        if cells is None or len(cells) != 1:
            return None
        one_cell = cells[0]
        fast = self._fast

        def captured() -> Any:
            served = fast[0]
            if (
                served[0] is snapshot
                and served[1] is target
                and fun.__code__ is served[2]
                and not fun.__defaults__
                and not fun.__kwdefaults__
                and "__wrapped__" not in fun.__dict__
                and enabled
            ):
                try:
                    value = one_cell.cell_contents
                except ValueError:  # an empty cell
                    return None
                if id(value) == served[3] and type(value) is served[4]:
                    for running in _frameworks.probes:
                        if running():
                            return None
                    return served  # replaced whole by the next inline check that passes
            return None

        return captured

    def _refuse(self, captured: Captured, snapshot: _stack.Snapshot) -> NoReturn:
        _refuse_captured(self.name, captured, snapshot, None)
        raise AssertionError("an uncovered captured object passed the check")

    def run(
        self,
        target: Callable[..., Any],
        snapshot: _stack.Snapshot,
        args: Args,
        kwargs: Kwargs,
    ) -> Any:
        if not enabled:
            return target(*args, **kwargs)
        captured = self.captured()
        framework = self.framework
        if (
            captured
            and framework is not None
            and _handled(framework, snapshot)
            and not _frameworks.scope_running()
        ):
            # The usual call under the adapter (a bound method under ``track``, say):
            # ``_run_checked``'s work for it, without its bookkeeping.
            out = target(*args, **kwargs)
            predicates = _frameworks.covers.get(framework.key)
            if predicates:
                for _, value in captured:
                    if not any(predicate(value) for predicate in predicates):
                        self._refuse(captured, snapshot)
            return out
        return _run_checked(self.name, target, args, kwargs, snapshot, captured, (args, kwargs))


def transform_check(name: str, fun: Any) -> TransformCheck | None:
    """The check a new ``jaxoverride.<name>(fun)`` needs, or None for JAX's own dispatch.

    Called only while ``watching()``; a transform built inside a framework scope or over
    captured framework state gets one.
    """
    if captured_state(fun) or _frameworks.scope_running():
        return TransformCheck(name, fun)
    return None


def frameworks() -> dict[str, Framework]:
    """The frameworks the check knows, by key: the registered records, after loading
    those whose watched module is imported."""
    _frameworks.refresh()
    return dict(_frameworks.registered)


def _qualified_name(fun: Any) -> str:
    while isinstance(fun, functools.partial):
        if hasattr(fun, "__qualname__"):
            break
        fun = fun.func
    name = getattr(fun, "__qualname__", None)
    return name if isinstance(name, str) else jit_name(fun)


def _check_trace(fun: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """Traces ``fun`` under the check: the trace-time half of ``traced_check``."""
    scopes = [f for f in _frameworks.scoped if f.running()]
    capturing = _frameworks.capturing
    if not scopes and not capturing:
        return fun(*args, **kwargs)
    snapshot = _stack.effective_snapshot()
    if capturing:
        captured = captured_state(fun) + _static_state(args, kwargs)
        _refuse_captured("jit", captured, snapshot, None, handled=False)
    scopes = [f for f in scopes if not _handled(f, snapshot)]
    before = {f.key: f.leaked_state() for f in scopes}
    out = fun(*args, **kwargs)
    _raise_on_new_tracers(scopes, before, "jit", "while JAX's own jit traced it, no adapter active")
    return out


class _Traced:
    """What ``jax.jit`` traces in place of ``fun``: the check, then ``fun``.

    It holds ``fun`` weakly (the neutral transform holds it strongly), so the one kept per
    function never keeps it alive; its names and ``__wrapped__`` make JAX name it, read its
    signature and locate its source as ``fun``'s.
    """

    # No __slots__: ``__module__`` and ``__doc__`` are the function's, per instance.

    def __init__(self, fun: Any, ref: Any):
        self._fun = ref
        self.__name__ = jit_name(fun)
        self.__qualname__ = _qualified_name(fun)
        self.__module__ = getattr(fun, "__module__", None)  # pyright: ignore[reportAttributeAccessIssue]
        self.__doc__ = getattr(fun, "__doc__", None)

    @property
    def __wrapped__(self) -> Any:
        return self._fun()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fun = self._fun()
        if not watching():
            return fun(*args, **kwargs)
        return _check_trace(fun, args, kwargs)


# id(fun) -> (weak reference to fun, its _Traced): one per function, so that jo.jit(f)
# built again hits the compiled code of the first, as jax.jit(f) does.
_traced: dict[int, tuple[Any, _Traced]] = {}


def _forget(key: int, table: dict[int, tuple[Any, _Traced]] = _traced) -> Callable[[Any], None]:
    # ``table`` is bound now: at interpreter shutdown the module's globals may be gone.
    def callback(dead: Any) -> None:
        entry = table.get(key)
        if entry is not None and entry[0] is dead:
            del table[key]

    return callback


def traced_check(name: str, fun: Any) -> Any:
    """What a neutral ``jit`` hands JAX's own ``jax.jit`` instead of ``fun``.

    ``jo.jit(f)`` built outside every framework scope keeps JAX's own dispatch, so the
    check runs where JAX traces ``f`` (state created or written under the trace, or
    captured, with no adapter of its framework active), at no cost per call; JAX's names,
    signatures, jaxprs and compile cache stay ``jax.jit(f)``'s. Any other transform, a
    generator function, a non-callable or an object with no weak reference gets ``fun``.
    """
    if name != "jit" or not callable(fun) or inspect.isgeneratorfunction(fun):
        return fun
    key = id(fun)
    entry = _traced.get(key)
    if entry is not None and entry[0]() is fun:
        return entry[1]
    try:
        ref = weakref.ref(fun, _forget(key))
    except TypeError:  # a builtin, say: it runs no framework code
        return fun
    traced = _Traced(fun, ref)
    _traced[key] = (ref, traced)
    return traced
