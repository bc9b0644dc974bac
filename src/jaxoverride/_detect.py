"""The missing-adapter check: a neutral function met framework state no adapter handles.

The frameworks are the registered records (``_frameworks``); this module names none.
What it catches, once a framework is imported and no adapter that handles it is active:

- scoped frameworks (a record whose ``running()`` tells that a scope of it runs): a
  neutral function run inside such a scope that leaves tracers in the state the record's
  ``leaked_state()`` lists (the body created a parameter or wrote state under a raw JAX
  trace). Reads are harmless, so a neutral call that only reads runs as JAX.
- closure-captured frameworks (a record whose ``is_state`` recognises its state): a
  neutral transform whose function captures such state (or, for ``jit``, whose static
  arguments reach it, checked where JAX traces) and is jitted (weights baked in
  as constants) or differentiated with respect to that state (the captured copy gets a
  zero gradient); a write to captured state (the record's ``write_error()``) is re-raised
  with the fix; under an adapter of the framework, captured state its ``covers=``
  predicate does not cover is refused.

Idle cost: neutral calls (``lax.scan`` and friends, which trace) pay one length
comparison of ``sys.modules`` while no registered framework is imported. A neutral
transform pays only at creation, and is given a checked target only if it was created
inside a framework scope or captures framework state; every other ``jo.jit`` keeps JAX's
own dispatch.
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
from jaxoverride._words import counted
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


def set_adapter_check(on: bool) -> bool:
    """Turns the missing-adapter check on or off for the whole process.

    The check raises ``jaxoverride.errors.MissingAdapterError`` when a neutral function
    meets the state of a registered framework that no active adapter handles, which would
    otherwise give a silently wrong result. Turn it off only for a program that means
    it; the environment variable ``JAXOVERRIDE_ADAPTER_CHECK=0`` does the same at start-up.

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
    """Whether the check has anything to look at: it is on and a framework is imported.

    The live records are worked out again only when ``len(sys.modules)`` changed.
    """
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
    labels = _frameworks.labels[framework.key]
    return any(layer.label in labels for layer in snapshot.layers)


def _covered(framework: Framework, value: Any) -> bool:
    predicates = _frameworks.covers.get(framework.key)
    return not predicates or any(predicate(value) for predicate in predicates)


def _values_of(
    fun: Any, label: str = "the function", deep: bool = False
) -> Iterator[tuple[str, Any]]:
    """``(name, value)`` for what ``fun`` reaches without being called: closure cells, the
    globals its code names, defaults, partial arguments, a bound method's object, items of
    lists and dicts among them; nested functions too, to a fixed depth. With ``deep``
    (a jit's static arguments), containers do not count as a level and the attributes
    of plain objects are followed too."""
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
            cells = value.__closure__ or ()
            for free, cell in zip(value.__code__.co_freevars, cells, strict=False):
                try:
                    inner.append((free, cell.cell_contents))
                except ValueError:  # an empty cell
                    pass
            inner += [("default", item) for item in value.__defaults__ or ()]
            inner += list((value.__kwdefaults__ or {}).items())
            names_of = value.__globals__
            codes = [value.__code__]
            while codes:
                code = codes.pop()
                inner += [(n, names_of[n]) for n in code.co_names if n in names_of]
                codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
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


def _static_state(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Captured:
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
    """The names that ``code`` and the code nested in it look up, as ``_values_of`` reads
    them (code objects are immutable)."""
    names: list[str] = []
    codes = [code]
    while codes:
        each = codes.pop()
        names += each.co_names
        codes += [c for c in each.co_consts if isinstance(c, types.CodeType)]
    return tuple(names)


def _shallow_values(fun: Any) -> list[tuple[str, Any]] | None:
    """What ``_values_of(fun)`` yields, in its order, for a function none of whose direct
    values is searched further (the usual ``lambda x: model(x)``), without its search
    machinery; None where the full search is needed."""
    if type(fun) is not types.FunctionType:
        return None
    inner: list[tuple[str, Any]] = []
    cells = fun.__closure__
    if cells:
        for free, cell in zip(fun.__code__.co_freevars, cells, strict=False):
            try:
                inner.append((free, cell.cell_contents))
            except ValueError:  # an empty cell
                pass
    if fun.__defaults__:
        inner += [("default", item) for item in fun.__defaults__]
    if fun.__kwdefaults__:
        inner += list(fun.__kwdefaults__.items())
    names_of = fun.__globals__
    inner += [(n, names_of[n]) for n in _global_names(fun.__code__) if n in names_of]
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


Captured = list[tuple[str, Any]]


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


def _holds_state(framework: Framework, values: Any) -> bool:
    return any(framework.is_state(value) for _, value in _values_of(values))


def _owned(framework: Framework, captured: Captured) -> Captured:
    """The part of ``captured`` that is ``framework``'s state."""
    if len(_frameworks.capturing) == 1:
        return captured
    return [(name, value) for name, value in captured if framework.is_state(value)]


def _describe(captured: Captured) -> str:
    shown = [f"`{name}` ({type(value).__name__})" for name, value in captured[:4]]
    return ", ".join(shown) + (", ..." if len(captured) > 4 else "")


def _fix(framework: Framework, captured: Captured, active: bool = False) -> str:
    """The record's fix naming what ``captured`` holds: each name's root, as an
    identifier (``"model"`` for one that is not)."""
    roots = dict.fromkeys(name.split("[", 1)[0] for name, _ in captured)
    names = list(dict.fromkeys(n if n.isidentifier() else "model" for n in roots))
    if not active:
        return framework.fix_for(names)
    covered = names_of(lambda value: framework.is_state(value) and _covered(framework, value))
    return framework.fix_for(names, covered=covered)


def _raise(framework: Framework, what: str, name: str) -> None:
    raise MissingAdapterError(
        f"{call_made(f'jaxoverride.{name}')} met {framework.title}, and no adapter that handles "
        f"{framework.key} is active: {what} Fix: {framework.fix}.{_HATCH}"
    )


def _raise_on_new_tracers(
    scopes: list[Framework], before: dict[str, Any], name: str, when: str
) -> None:
    """Raises for the first framework whose state gained tracers since ``before``."""
    for framework in scopes:
        leaked = _frameworks.new_tracers(before[framework.key], framework.leaked_state())
        if leaked:
            _raise(
                framework,
                f"{leak_text(framework, leaked, 'the function', when)} (the first use "
                "then fails far from here, or the result is silently wrong).",
                name,
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
    framework: Framework,
    name: str,
    captured: Captured,
    snapshot: _stack.Snapshot,
    differentiated: Any,
) -> str | None:
    """Why running ``name`` over ``framework``'s captured state would be silently wrong,
    if it would."""
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
    if name in _DIFFERENTIATES and _holds_state(framework, differentiated):
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


def _write_errors() -> list[tuple[Framework, type[BaseException]]]:
    """The live closure-captured frameworks' errors for a write under a raw trace."""
    found = []
    for framework in _frameworks.capturing:
        error = framework.write_error()
        if error is not None:
            found.append((framework, error))
    return found


def _write_refused(
    name: str,
    error: BaseException,
    snapshot: _stack.Snapshot,
    captured: Captured,
    search: tuple[Any, ...],
) -> BaseException | None:
    """The ``MissingAdapterError`` to raise for ``error``, the own error of a framework no
    active adapter handles for a write to its state captured (``captured``, or captured by
    a function in ``search``); None to let ``error`` through."""
    for framework, framework_error in _write_errors():
        if not isinstance(error, framework_error) or _handled(framework, snapshot):
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
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    snapshot: _stack.Snapshot,
    captured: Captured,
    differentiated: Any,
    search: tuple[Any, ...] = (),
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
        if captured or search:
            refusal = _write_refused(name, error, snapshot, captured, search)
            if refusal is not None:
                raise refusal from error
        raise
    if captured:
        _refuse_captured(name, captured, snapshot, differentiated, handled=True)
    _raise_on_new_tracers(scopes, before, name, "under a raw JAX trace")
    return out


def _functions(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(
        value
        for value in (*args, *kwargs.values())
        if callable(value) and not isinstance(value, type)
    )


def run_call(
    name: str,
    run: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    snapshot: _stack.Snapshot,
) -> Any:
    """Runs a neutral call (``lax.scan``, ``jvp``, ...) under the check."""
    unhandled = False
    for framework in _frameworks.capturing:
        if not _handled_cached(framework, snapshot):
            unhandled = True
            break
    running = False
    for probe in _frameworks.probes:  # ``scope_running``, without its frame
        if probe():
            running = True
            break
    if name not in _DIFFERENTIATES and not running:
        # The common case: nothing to compare afterwards, nothing to search beforehand.
        if not unhandled:
            return run(*args, **kwargs)
        try:
            return run(*args, **kwargs)
        except BaseException as error:
            refusal = _write_refused(name, error, snapshot, [], _functions(args, kwargs))
            if refusal is None:
                raise
            raise refusal from error
    captured: Captured = []
    search: tuple[Any, ...] = ()
    # Under a framework's adapter, control flow threads what it reaches itself: no search.
    if unhandled:
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
    # Whether it read no defaults (closure cells and globals only): a call then recalls
    # it inline, in ``checked_call``.
    inline: bool = False


def _recalled(fun: types.FunctionType, memo: _Memo) -> list[Any] | None:
    """What ``_direct_values(fun)`` reads now, where each is the object ``memo`` read
    (same identity and type, so ``captured_state`` would find the same); else None.

    Inline and without comprehensions: it runs at every jitted call under ``track``.
    """
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


class TransformCheck:
    """What a neutral transform built where the check applies checks at each call.

    It keeps no captured object: what the function captures is looked up again at each
    call (a module replaced in a closure is seen; a deleted one is not kept alive). For
    a plain function that the shallow lookup serves, a call reads the objects that
    lookup reads (closure cells, defaults, the globals its code names) and, where each
    is the previous call's object (same identity and type), reuses the previous
    answer's positions instead of searching again (``_Memo``: only identities, types
    and the code object are kept).
    """

    __slots__ = ("_fast", "_memo", "framework", "fun", "name")

    def __init__(self, name: str, fun: Any):
        self.name = name
        self.fun = fun  # the transform's state holds it already
        # The closure-captured framework the inline paths serve: the one live at creation;
        # None (every call through ``run``) where none is or several are.
        capturing = _frameworks.capturing
        self.framework: Framework | None = capturing[0] if len(capturing) == 1 else None
        # One attribute, replaced whole: a thread reads one lookup's memo or another's.
        self._memo: _Memo | None = None
        # After an inline check passed for a function of one cell that holds the one
        # captured object: (snapshot, target, code, id and type of that object, the
        # predicate covering it), shared by every ``checked_call`` and ``guard`` of this
        # check. One tuple, replaced whole (threads).
        self._fast: list[Any] = [_NO_FAST]

    def captured(self) -> Captured:
        """``captured_state(self.fun)``, from the last lookup's answer where every object
        it read is the same one."""
        fun = self.fun
        if type(fun) is not types.FunctionType:
            return captured_state(fun)
        memo = self._memo
        if memo is not None and _frameworks.capturing:
            direct = _recalled(fun, memo)
            if direct is not None:
                return [(name, direct[at]) for name, at in memo.found]
        captured = captured_state(fun)
        self._memo = None
        direct = _direct_values(fun)
        if direct is not None and _frameworks.capturing and _shallow_values(fun) is not None:
            # The shallow lookup's answer depends on ``direct`` alone.
            positions = {id(value): position for position, value in enumerate(direct)}
            found = [(name, positions.get(id(value))) for name, value in captured]
            if all(at is not None for _, at in found):
                code = fun.__code__
                self._memo = _Memo(
                    code,
                    _global_names(code),
                    tuple(map(id, direct)),
                    tuple(map(type, direct)),
                    tuple(found),  # type: ignore[arg-type]
                    not fun.__defaults__,
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
        and runs it under the check. With ``directs`` (the transform's direct calls that
        serve checked calls, see ``guard``), a call whose check passed inline in a stack
        that has one makes it the wrapper's target (``go_direct``).

        A call under an adapter of ``self.framework`` whose function
        the memo serves (see the class) and that no framework scope encloses checks inline
        what ``run`` would: that each captured object is covered by the adapter, after the
        call. Every other call goes through ``run``. A function of one closure cell whose
        object passed that check under this stack is checked in fewer steps at the next
        call (``fast``): the same target, code and object there (same identity and type),
        no defaults and no framework scope, then the one covering predicate, after the call.
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
        # A call that finds all of ``_fast`` the same checks only that the object is
        # still covered.
        fast = self._fast

        def checked_call(*args: Any, **kwargs: Any) -> Any:
            snapshot = current_get().snapshot
            if _stack._guards:
                snapshot = _stack.effective_snapshot()
            target = builds_get(snapshot)
            served = fast[0]
            if (
                served[0] is snapshot
                and served[1] is target  # not dropped from ``builds`` since
                and fun.__code__ is served[2]
                and not fun.__defaults__
                and not fun.__kwdefaults__
                and "__wrapped__" not in fun.__dict__
                and enabled
            ):
                try:
                    value = one_cell.cell_contents  # type: ignore[union-attr]
                except ValueError:  # an empty cell
                    value = _EMPTY
                if id(value) == served[3] and type(value) is served[4]:
                    for running in _frameworks.probes:
                        if running():
                            break
                    else:
                        out = target(*args, **kwargs) if kwargs else target(*args)  # type: ignore[misc]
                        if served[5](value):
                            if directs and snapshot in directs and not _stack._guards:
                                go_direct(snapshot)  # type: ignore[misc]
                            return out
                        fast[0] = _NO_FAST
                        return check._covered_or_refused(out, value, snapshot)
            if snapshot is root:
                return run(plain, snapshot, args, kwargs)
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
            # What ``run`` does for a function whose captures the memo serves, under the
            # framework's adapter and no framework scope, inline: every jitted call under
            # that adapter comes this way. Same code, so as many cells as then.
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
        asks at each call, for ``target`` built in ``snapshot``; None where no call of
        this function can be served so (it is not a plain function of one closure cell).

        ``captured()`` returns a token where a call would pass the check exactly as the
        last inline check did (the state ``checked_call`` keeps after it: same stack and
        target, same code and cell object, no defaults, no ``__wrapped__``, no framework
        scope running, the check on), but for its covering predicate; else None.
        Equal tokens (the same object) stand for the same captured object. The direct
        call answers the predicate itself: it serves only under a token it saw a call
        pass the check with.
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

    def _covered_or_refused(self, out: Any, value: Any, snapshot: _stack.Snapshot) -> Any:
        """``out`` where the adapter covers ``value``, the one captured object, now."""
        assert self.framework is not None  # the inline paths run only with one
        if not _covered(self.framework, value):
            memo = self._memo
            name = memo.found[0][0] if memo is not None and memo.found else "the function"
            self._refuse([(name, value)], snapshot)
        return out

    def _refuse(self, captured: Captured, snapshot: _stack.Snapshot) -> NoReturn:
        _refuse_captured(self.name, captured, snapshot, None)
        raise AssertionError("an uncovered captured object passed the check")

    def run(
        self,
        target: Callable[..., Any],
        snapshot: _stack.Snapshot,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        if not enabled:
            return target(*args, **kwargs)
        captured = self.captured()
        framework = self.framework
        if (
            captured
            and framework is not None
            and _handled_cached(framework, snapshot)
            and not _frameworks.scope_running()
        ):
            # The usual call under the framework's adapter (``track``): what
            # ``_run_checked`` does with it handled and no scope running, without its
            # bookkeeping.
            out = target(*args, **kwargs)
            predicates = _frameworks.covers.get(framework.key)
            if predicates:
                for _, value in captured:
                    if not any(predicate(value) for predicate in predicates):
                        self._refuse(captured, snapshot)
            return out
        return _run_checked(self.name, target, args, kwargs, snapshot, captured, (args, kwargs))


_EMPTY = object()  # an empty closure cell or an absent global, in _direct_values
_NO_FAST = (object(), None, None, -1, None, None)  # ``checked_call`` with nothing to serve
_EMPTIES = itertools.repeat(_EMPTY)
_CELL_CONTENTS = operator.attrgetter("cell_contents")


def _direct_values(fun: types.FunctionType) -> list[Any] | None:
    """Every object ``_shallow_values(fun)`` reads, in a fixed order (``_EMPTY`` for an
    empty cell or an absent global); None where it reads more (keyword defaults, which
    can change in place, or ``__wrapped__``)."""
    if fun.__kwdefaults__ or getattr(fun, "__wrapped__", None) is not None:
        return None
    direct: list[Any] = []
    cells = fun.__closure__
    if cells:
        for cell in cells:
            try:
                direct.append(cell.cell_contents)
            except ValueError:  # an empty cell
                direct.append(_EMPTY)
    defaults = fun.__defaults__
    if defaults:
        direct += defaults
    names = _global_names(fun.__code__)
    if names:
        get = fun.__globals__.get
        direct += [get(name, _EMPTY) for name in names]
    return direct


def _handled_cached(framework: Framework, snapshot: _stack.Snapshot) -> bool:
    """``_handled(framework, snapshot)``, remembered per snapshot in
    ``_frameworks.handled_by``."""
    answers = _frameworks.handled_by[framework.key]
    handled = answers.get(snapshot)
    if handled is None:
        if len(answers) >= _HANDLED_LIMIT:
            answers.clear()
        handled = answers[snapshot] = _handled(framework, snapshot)
    return handled


_HANDLED_LIMIT = 256  # snapshots are interned: a bound, not a tuning knob


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


def _check_trace(name: str, fun: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """Traces ``fun`` under the check: the trace-time half of ``traced_check``."""
    scopes = [f for f in _frameworks.scoped if f.running()]
    capturing = _frameworks.capturing
    if not scopes and not capturing:
        return fun(*args, **kwargs)
    snapshot = _stack.effective_snapshot()
    if capturing:
        captured = captured_state(fun) + _static_state(args, kwargs)
        _refuse_captured(name, captured, snapshot, None, handled=False)
    scopes = [f for f in scopes if not _handled(f, snapshot)]
    if not scopes:
        return fun(*args, **kwargs)
    before = {f.key: f.leaked_state() for f in scopes}
    out = fun(*args, **kwargs)
    _raise_on_new_tracers(scopes, before, name, "while JAX's own jit traced it, no adapter active")
    return out


TRACE_CHECKED = frozenset({"jit"})


class _Traced:
    """What ``jax.jit`` traces in place of ``fun``: the check, then ``fun``.

    It holds ``fun`` weakly (the neutral transform holds it strongly), so that the one
    ``_Traced`` kept per function never keeps the function alive; ``__wrapped__``,
    ``__name__``, ``__qualname__``, ``__module__`` and ``__doc__`` make JAX name it, read
    its signature and locate its source exactly as ``fun``'s.
    """

    # No __slots__: ``__module__`` and ``__doc__`` are the function's, per instance.

    def __init__(self, name: str, fun: Any, ref: Any):
        self._name = name
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
        return _check_trace(self._name, fun, args, kwargs)


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

    ``jo.jit(f)`` built outside every framework scope (at import time, say) keeps JAX's
    own dispatch, so a call pays nothing for the check; the check runs where JAX traces
    ``f``: inside a framework scope with no adapter of it active, state that ``f``
    creates or writes under the trace raises ``MissingAdapterError``, and so does
    framework state that ``f`` captures with no adapter of it active. What JAX sees carries
    ``f``'s name, qualified name and ``__wrapped__``, so JAX's names, signatures, jaxprs
    and compile cache are ``jax.jit(f)``'s. Any other transform, a generator function
    (JAX's own error), a non-callable or an object that cannot be weakly referenced gets
    ``fun`` back unchanged.

    Args:
      name: the neutral transform's name, such as ``"jit"``.
      fun: the function given to it.

    Returns:
      The function to give JAX.
    """
    if name not in TRACE_CHECKED or not callable(fun) or inspect.isgeneratorfunction(fun):
        return fun
    key = id(fun)
    entry = _traced.get(key)
    if entry is not None and entry[0]() is fun:
        return entry[1]
    try:
        ref = weakref.ref(fun, _forget(key))
    except TypeError:  # a builtin, say: it runs no framework code
        return fun
    traced = _Traced(name, fun, ref)
    _traced[key] = (ref, traced)
    return traced
