"""The missing-adapter check: a neutral function met framework state no adapter handles.

What it catches, once a framework is imported and no adapter that handles it is active:

- Haiku and Flax Linen: a neutral function run inside ``hk.transform`` or a bound Linen
  module that leaves tracers in the framework's parameters, state or RNG (the body
  created a parameter or wrote state under a raw JAX trace). Reads are harmless, so a
  neutral call that only reads runs as JAX.
- Flax NNX: a neutral transform whose function captures NNX modules or Variables and is
  jitted (weights baked in as constants) or differentiated with respect to NNX state
  (the captured copy gets a zero gradient); a write to a captured Variable (Flax's bare
  ``TraceContextError``) is re-raised with the fix; under ``track`` a captured module
  the tracked set does not contain is refused.

Idle cost: neutral calls (``lax.scan`` and friends, which trace) pay one ``sys.modules``
look-up per framework. A neutral transform pays only at creation, and is given a checked
target only if it was created inside a framework scope or captures NNX state; every
other ``jo.jit`` keeps JAX's own dispatch.
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

from jaxoverride import _frameworks, _stack
from jaxoverride._compat import jit_name
from jaxoverride._frameworks import ALL, HAIKU, LINEN, MODULES, NNX, SCOPED, Framework
from jaxoverride._user_frames import call_made, names_of
from jaxoverride._words import counted
from jaxoverride.errors import MissingAdapterError, _missing_adapter_also

ENV_VAR = "JAXOVERRIDE_ADAPTER_CHECK"
_OFF = {"0", "false", "off", "no"}
enabled = os.environ.get(ENV_VAR, "1").strip().lower() not in _OFF

# Names whose silent failure with captured NNX state is a wrong result, not an error.
_BAKES = frozenset({"jit", "pmap"})
_DIFFERENTIATES = frozenset(
    {"grad", "value_and_grad", "jacfwd", "jacrev", "hessian", "jvp", "vjp", "linearize"}
)
_SEARCH_DEPTH = 3
_SEARCH_LIMIT = 512  # objects visited per search: a bound, not a tuning knob


def set_adapter_check(on: bool) -> bool:
    """Turns the missing-adapter check on or off for the whole process.

    The check raises ``jaxoverride.errors.MissingAdapterError`` when a neutral function
    meets Haiku, Flax Linen or Flax NNX state that no active adapter handles, which would
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
    """Whether the check has anything to look at: it is on and a framework is imported."""
    if not enabled:
        return False
    modules = sys.modules
    # Unrolled: this runs on every neutral call once the check is on.
    return _HAIKU_MODULE in modules or _LINEN_MODULE in modules or _NNX_MODULE in modules


_HAIKU_MODULE, _LINEN_MODULE, _NNX_MODULE = MODULES

_HATCH = (
    " If the program means this, turn the check off with jaxoverride.set_adapter_check(False) "
    f"or the environment variable {ENV_VAR}=0."
)


def _handled(framework: Framework, snapshot: _stack.Snapshot) -> bool:
    return any(layer.label in framework.labels for layer in snapshot.layers)


def _covered(framework: Framework, value: Any) -> bool:
    predicates = _frameworks.covers.get(framework.key)
    return not predicates or any(predicate(value) for predicate in predicates)


def _values_of(fun: Any, label: str = "the function") -> Iterator[tuple[str, Any]]:
    """``(name, value)`` for what ``fun`` reaches without being called: closure cells, the
    globals its code names, defaults, partial arguments, a bound method's object, items of
    lists and dicts among them; nested functions too, to a fixed depth."""
    pending: list[tuple[Any, int, str]] = [(fun, 0, label)]
    seen: set[int] = set()
    while pending and len(seen) < _SEARCH_LIMIT:
        value, depth, name = pending.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        yield name, value
        if depth >= _SEARCH_DEPTH:
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
        pending += [
            (item, depth + 1, key) for key, item in inner if not isinstance(item, types.ModuleType)
        ]


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


def captured_state(fun: Any) -> Captured:
    """``(name, object)`` for the NNX modules and Variables that ``fun`` captures (empty
    while NNX is not imported)."""
    if NNX.loaded() is None:
        return []
    values = _shallow_values(fun)
    found = _values_of(fun) if values is None else values
    return [(name, value) for name, value in found if NNX.is_state(value)]


def _holds_state(values: Any) -> bool:
    if NNX.loaded() is None:
        return False
    return any(NNX.is_state(value) for _, value in _values_of(values))


def _describe(captured: Captured) -> str:
    shown = [f"`{name}` ({type(value).__name__})" for name, value in captured[:4]]
    return ", ".join(shown) + (", ..." if len(captured) > 4 else "")


def _track_fix(captured: Captured, also: str = "") -> str:
    roots = dict.fromkeys(name.split("[", 1)[0] for name, _ in captured)
    names = [n if n.isidentifier() else "model" for n in roots]
    return f"`with jaxoverride_nnx.track({also}{', '.join(dict.fromkeys(names))}):` around the call"


def _tracked_now() -> str:
    """The variables that hold the modules the active track scope holds, as the program
    names them (``"model, "``), for the fix that tracks one more."""
    names = names_of(lambda value: NNX.is_state(value) and _covered(NNX, value))
    return ", ".join(names or ["<the modules tracked now>"]) + ", "


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
        leaked = _frameworks.new_tracers(before[framework.key], framework.state_leaves())
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


def _untracked(captured: Captured) -> Captured:
    return [(name, value) for name, value in captured if not _covered(NNX, value)]


def _nnx_refusal(
    name: str, captured: Captured, snapshot: _stack.Snapshot, differentiated: Any
) -> str | None:
    """Why running ``name`` over captured NNX state would be silently wrong, if it would."""
    if not captured:
        return None
    if _handled(NNX, snapshot):
        untracked = _untracked(captured)
        if untracked:
            return (
                f"the function captures {_describe(untracked)}, which the active track scope "
                "does not hold, so its weights would be baked in or its gradient lost. Fix: "
                f"track it too, {_track_fix(untracked, _tracked_now())}."
            )
        return None
    if name in _BAKES:
        return (
            f"the function captures {_describe(captured)}; jax.{name} would bake their "
            "current weights in as constants and keep returning them after they change. "
            f"Fix: {_track_fix(captured)}."
        )
    if name in _DIFFERENTIATES and _holds_state(differentiated):
        return (
            f"the function captures {_describe(captured)} and is differentiated with respect "
            "to NNX state; the captured copy is not the one being differentiated, so its "
            f"gradient would be silently zero. Fix: {_track_fix(captured)}."
        )
    return None


def _trace_context_error() -> type[BaseException] | None:
    errors = sys.modules.get("flax.errors")
    return getattr(errors, "TraceContextError", None) if errors is not None else None


def _write_message(name: str, captured: Captured) -> str:
    return (
        f"{call_made(f'jaxoverride.{name}')} ran a function that writes a Variable of the "
        f"NNX state it captures ({_describe(captured)}), which raw JAX cannot thread, and no "
        f"NNX adapter is active. Fix: {_track_fix(captured)}.{_HATCH}"
    )


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
    """Runs ``run`` under the check. ``search`` holds what to look for captured NNX state
    in only if the call fails with Flax's ``TraceContextError`` (control flow, where a
    read is right and a write raises)."""
    nnx_handled = bool(captured) and _handled(NNX, snapshot)
    # Under an NNX adapter its own, more precise errors (a write to an untracked module)
    # come first, so the refusal waits until the call has run.
    if not nnx_handled:
        refusal = _nnx_refusal(name, captured, snapshot, differentiated)
        if refusal is not None:
            raise MissingAdapterError(
                f"{call_made(f'jaxoverride.{name}')} met {NNX.title}: {refusal}{_HATCH}"
            )
    scopes = [f for f in SCOPED if f.inside() and not _handled(f, snapshot)]
    before = {f.key: f.state_leaves() for f in scopes}
    trace_context_error = (
        _trace_context_error() if (captured or search) and not nnx_handled else None
    )
    try:
        out = run(*args, **kwargs)
    except BaseException as error:
        if trace_context_error is not None and isinstance(error, trace_context_error):
            if not captured:
                captured = [found for value in search for found in captured_state(value)]
            if not captured:
                raise
            raise _missing_adapter_also(trace_context_error)(
                _write_message(name, captured)
            ) from error
        raise
    if nnx_handled:
        refusal = _nnx_refusal(name, captured, snapshot, differentiated)
        if refusal is not None:
            raise MissingAdapterError(
                f"{call_made(f'jaxoverride.{name}')} met {NNX.title}: {refusal}{_HATCH}"
            )
    _raise_on_new_tracers(scopes, before, name, "under a raw JAX trace")
    return out


def _functions(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(
        value
        for value in (*args, *kwargs.values())
        if callable(value) and not isinstance(value, type)
    )


def _write_refusal(name: str, error: BaseException, search: tuple[Any, ...]) -> Any:
    """The ``MissingAdapterError`` to raise for Flax's ``TraceContextError`` from a write to
    NNX state that a function in ``search`` captures; None to let ``error`` through."""
    trace_context_error = _trace_context_error()
    if trace_context_error is None or not isinstance(error, trace_context_error):
        return None
    captured = [found for value in search for found in captured_state(value)]
    if not captured:
        return None
    return _missing_adapter_also(trace_context_error)(_write_message(name, captured))


def run_call(
    name: str,
    run: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    snapshot: _stack.Snapshot,
) -> Any:
    """Runs a neutral call (``lax.scan``, ``jvp``, ...) under the check."""
    nnx_unhandled = NNX.loaded() is not None and not _handled(NNX, snapshot)
    if not (HAIKU.inside() or LINEN.inside()) and name not in _DIFFERENTIATES:
        # The common case: nothing to compare afterwards, nothing to search beforehand.
        if not nnx_unhandled:
            return run(*args, **kwargs)
        try:
            return run(*args, **kwargs)
        except BaseException as error:
            refusal = _write_refusal(name, error, _functions(args, kwargs))
            if refusal is None:
                raise
            raise refusal from error
    captured: Captured = []
    search: tuple[Any, ...] = ()
    # Under an NNX adapter, control flow threads what it reaches itself: no search.
    if nnx_unhandled:
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

    __slots__ = ("_fast", "_memo", "fun", "name")

    def __init__(self, name: str, fun: Any):
        self.name = name
        self.fun = fun  # the transform's state holds it already
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
        if memo is not None and NNX.loaded() is not None:
            direct = _recalled(fun, memo)
            if direct is not None:
                return [(name, direct[at]) for name, at in memo.found]
        captured = captured_state(fun)
        self._memo = None
        direct = _direct_values(fun)
        if direct is not None and NNX.loaded() is not None and _shallow_values(fun) is not None:
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

        A call under ``track`` whose function the memo serves (see the class) and that no
        Haiku or Linen scope encloses checks inline what ``run`` would: that each captured
        object is covered by the NNX adapter, after the call. Every other call goes
        through ``run``. A function of one closure cell whose object passed that check
        under this stack is checked in fewer steps at the next call (``fast``): the same
        target, code and object there (same identity and type), no defaults and no
        Haiku or Linen scope, then the one covering predicate, after the call.
        """
        run = self.run
        check = self
        fun = self.fun
        root, current_get = _stack.ROOT, _stack._current_get
        handled_here = _frameworks.nnx_handled
        covers = _frameworks.covers
        modules_get = sys.modules.get
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
                    haiku = modules_get(_HAIKU_MODULE)
                    linen = modules_get(_LINEN_MODULE)
                    if (haiku is None or not haiku.inside_transform()) and (
                        linen is None or linen._context.module_stack[-1] is None
                    ):
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
            # What ``run`` does for a function whose captures the memo serves, under an
            # NNX adapter and no Haiku or Linen scope, inline: every jitted call under
            # ``track`` comes this way. Same code, so as many cells as then.
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
            haiku = modules_get(_HAIKU_MODULE)
            if haiku is not None and haiku.inside_transform():
                return run(target, snapshot, args, kwargs)
            linen = modules_get(_LINEN_MODULE)
            if linen is not None:  # as ``_frameworks.scope_running``, without its frame
                top = linen._context.module_stack[-1]
                if top is not None and getattr(top, "scope", None) is not None:
                    return run(target, snapshot, args, kwargs)
            out = target(*args, **kwargs) if kwargs else target(*args)
            predicates = covers.get("nnx")
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
        target, same code and cell object, no defaults, no ``__wrapped__``, no Haiku or
        Linen scope running, the check on), but for its covering predicate; else None.
        Equal tokens (the same object) stand for the same captured object. The direct
        call answers the predicate itself: it serves only under a token it saw a call
        pass the check with.
        """
        fun = self.fun
        if type(fun) is not types.FunctionType:
            return None
        cells = fun.__closure__
        if cells is None or len(cells) != 1:
            return None
        one_cell = cells[0]
        fast = self._fast
        modules_get = sys.modules.get

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
                    haiku = modules_get(_HAIKU_MODULE)
                    if haiku is not None and haiku.inside_transform():
                        return None
                    linen = modules_get(_LINEN_MODULE)
                    if linen is not None and linen._context.module_stack[-1] is not None:
                        return None
                    return served  # replaced whole by the next inline check that passes
            return None

        return captured

    def _covered_or_refused(self, out: Any, value: Any, snapshot: _stack.Snapshot) -> Any:
        """``out`` where an NNX adapter covers ``value``, the one captured object, now."""
        if not _covered(NNX, value):
            memo = self._memo
            name = memo.found[0][0] if memo is not None and memo.found else "the function"
            self._refuse([(name, value)], snapshot)
        return out

    def _refuse(self, captured: Captured, snapshot: _stack.Snapshot) -> NoReturn:
        refusal = _nnx_refusal(self.name, captured, snapshot, None)
        assert refusal is not None
        raise MissingAdapterError(
            f"{call_made(f'jaxoverride.{self.name}')} met {NNX.title}: {refusal}{_HATCH}"
        )

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
        if captured and _nnx_handled(snapshot) and not _frameworks.scope_running():
            # The usual call under ``track``: what ``_run_checked`` does with NNX handled
            # and no Haiku or Linen scope running, without its bookkeeping.
            out = target(*args, **kwargs)
            predicates = _frameworks.covers.get(NNX.key)
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


def _nnx_handled(snapshot: _stack.Snapshot) -> bool:
    """``_handled(NNX, snapshot)``, remembered per snapshot in ``_frameworks.nnx_handled``."""
    handled = _frameworks.nnx_handled.get(snapshot)
    if handled is None:
        if len(_frameworks.nnx_handled) >= _NNX_HANDLED_LIMIT:
            _frameworks.nnx_handled.clear()
        handled = _frameworks.nnx_handled[snapshot] = _handled(NNX, snapshot)
    return handled


_NNX_HANDLED_LIMIT = 256  # snapshots are interned: a bound, not a tuning knob


def transform_check(name: str, fun: Any) -> TransformCheck | None:
    """The check a new ``jaxoverride.<name>(fun)`` needs, or None for JAX's own dispatch.

    Called only while ``watching()``; a transform built inside a framework scope or over
    captured NNX state gets one.
    """
    if captured_state(fun) or any(framework.inside() for framework in SCOPED):
        return TransformCheck(name, fun)
    return None


def frameworks() -> dict[str, Framework]:
    """The frameworks the check knows, by key."""
    return dict(ALL)


def _qualified_name(fun: Any) -> str:
    while isinstance(fun, functools.partial):
        if hasattr(fun, "__qualname__"):
            break
        fun = fun.func
    name = getattr(fun, "__qualname__", None)
    return name if isinstance(name, str) else jit_name(fun)


def _check_trace(name: str, fun: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """Traces ``fun`` under the check: the trace-time half of ``traced_check``."""
    scopes = [f for f in SCOPED if f.inside()]
    nnx_loaded = NNX.loaded() is not None
    if not scopes and not nnx_loaded:
        return fun(*args, **kwargs)
    snapshot = _stack.effective_snapshot()
    if nnx_loaded and not _handled(NNX, snapshot):
        refusal = _nnx_refusal(name, captured_state(fun), snapshot, None)
        if refusal is not None:
            raise MissingAdapterError(
                f"{call_made(f'jaxoverride.{name}')} met {NNX.title}: {refusal}{_HATCH}"
            )
    scopes = [f for f in scopes if not _handled(f, snapshot)]
    if not scopes:
        return fun(*args, **kwargs)
    before = {f.key: f.state_leaves() for f in scopes}
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
    ``f``: inside ``hk.transform`` or a bound Linen module with no adapter active, state
    that ``f`` creates or writes under the trace raises ``MissingAdapterError``, and so
    does NNX state that ``f`` captures with no NNX adapter active. What JAX sees carries
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
