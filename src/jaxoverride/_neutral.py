"""Factories that turn a JAX function into its neutral counterpart.

A *call* (``lax.scan``, ``jvp``, ...) resolves the stack at each call. A *transform*
(``jit``, ``vmap``, ...) returns a ``Transformed`` wrapper that resolves it at each call of
the wrapper and builds the transformed function once per snapshot; while the process is
idle its target is the plain JAX object, so ``jo.jit(f)`` costs what ``jax.jit(f)`` does.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Generic, NoReturn, TypeVar, cast

from jaxoverride import _detect, _stack
from jaxoverride._compat import rule_nondiff_argnums
from jaxoverride._dispatch import dispatch
from jaxoverride._jitapi import directs_of
from jaxoverride._stack import ROOT, effective_snapshot

F = TypeVar("F", bound=Callable[..., Any])

# Builds kept per wrapper (a program that enters a fresh stack each step would otherwise
# keep one per step). On overflow the oldest half goes: at worst a rebuild, never a stale
# hit, since snapshots are compared by identity.
BUILD_LIMIT = 64


def remember_build(builds: dict[Any, Any], snapshot: Any, built: Any) -> None:
    """Stores ``built`` for ``snapshot``, dropping the oldest past the limit.

    A dropped build's compiled code is cleared too: ``jax.jit`` objects of one function
    share one cache, keyed on the stack, which would otherwise keep every stack's code.
    """
    if len(builds) >= BUILD_LIMIT:
        dropped = [builds.pop(old) for old in list(builds)[: BUILD_LIMIT // 2]]
        kept = {id(b) for b in builds.values()} | {id(built)}
        for old in dropped:
            clear = getattr(old, "clear_cache", None)
            if clear is not None and id(old) not in kept:
                clear()
    builds[snapshot] = built


ReturnValue = TypeVar("ReturnValue")

_NOTE = (
    "Neutral ``{path}``: identical to it while no override is active; otherwise the "
    "active override of ``{name!r}`` is chosen {when}. See ``jaxoverride.override_context``."
    "\n\nThe documentation of ``{path}`` follows.\n\n"
)


def _doc(name: str, default: Callable[..., Any], when: str) -> str:
    path = f"jax.{name}"
    return _NOTE.format(path=path, name=name, when=when) + inspect.cleandoc(default.__doc__ or "")


def _dispatch_to(snapshot: _stack.Snapshot, name: str, *args: Any, **kwargs: Any) -> Any:
    return dispatch(snapshot, name, args, kwargs)


def neutral_call(name: str, default: F) -> F:
    """Builds the neutral version of a JAX function that runs at once (a call)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        if _stack.idle:
            if _detect.watching():
                return _detect.run_call(name, default, args, kwargs, ROOT)
            return default(*args, **kwargs)
        snapshot = effective_snapshot()
        if _detect.watching():
            return _detect.run_call(
                name, functools.partial(_dispatch_to, snapshot, name), args, kwargs, snapshot
            )
        return dispatch(snapshot, name, args, kwargs)

    call.__name__ = default.__name__
    call.__qualname__ = name
    call.__module__ = "jaxoverride.lax" if name.startswith("lax.") else "jaxoverride"
    call.__doc__ = _doc(name, default, "at every call")
    call.__wrapped__ = default  # type: ignore[attr-defined]
    return cast(F, call)


@dataclasses.dataclass(eq=False, repr=False, slots=True)
class _TransformState:
    """Everything a ``Transformed`` needs off its fast path; it never refers back strongly.

    ``check``: the missing-adapter check, where it applies (the wrapper then never goes
    fast). ``directs``: per snapshot, the build's direct call (see ``jit_api``);
    ``direct``: the snapshot whose direct call is the wrapper's target now, if any.
    """

    name: str
    default: Callable[..., Any]
    fun: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    plain: Callable[..., Any]
    builds: dict[_stack.Snapshot, Callable[..., Any]] = dataclasses.field(default_factory=dict)
    owner: weakref.ref[Transformed] | None = None
    check: _detect.TransformCheck | None = None
    directs: dict[_stack.Snapshot, Callable[..., Any]] = dataclasses.field(default_factory=dict)
    direct: _stack.Snapshot | None = None
    fallback: Callable[..., Any] | None = None

    def target(self) -> Callable[..., Any]:
        """The transformed function for the stack active here and now."""
        snapshot = effective_snapshot()
        if snapshot is ROOT:
            return self.plain
        built = self.builds.get(snapshot)
        return self.build(snapshot) if built is None else built

    def build(self, snapshot: _stack.Snapshot) -> Callable[..., Any]:
        built = dispatch(snapshot, self.name, (self.fun, *self.args), dict(self.kwargs))
        remember_build(self.builds, snapshot, built)
        directs = self.directs
        for dropped in [old for old in list(directs) if old not in self.builds]:
            directs.pop(dropped, None)  # another thread may build meanwhile
        if self.direct is not None and self.direct not in directs:
            # The direct target calls a build that was just dropped: back to dispatching.
            owner = self.owner() if self.owner is not None else None
            if owner is not None:
                owner._switch_to_slow()
        # A checked wrapper goes direct only to an override that answers the check's
        # covering predicate itself, and only for a function the check can hand it.
        check = self.check
        holder = directs_of(built)
        make = None if holder is None else holder.make if check is None else holder.checked
        guard = None if check is None or make is None else check.guard(snapshot, built)
        if make is not None and (check is None or guard is not None):
            if self.fallback is None:  # dispatch, or the check in full, with no redirect
                self.fallback = (
                    _slow_call(self, redirect=False)
                    if check is None
                    else check.checked_call(self.plain, self.builds, self.build)
                )
                self.fallback.__wrapped__ = self.plain  # type: ignore[attr-defined]
            guarded = () if guard is None else (guard,)
            direct = make(_stack.snapshot_now, snapshot, self.fallback, *guarded)
            try:  # ``__wrapped__`` as for the slow target: see ``_slow_target``
                direct.__wrapped__ = self.plain  # type: ignore[attr-defined]
                directs[snapshot] = direct
            except AttributeError:
                pass  # not a function: this wrapper keeps dispatching, which is as right
        return built

    def go_direct(self, snapshot: _stack.Snapshot) -> None:
        """Makes the build's direct call for ``snapshot`` the wrapper's target, if any."""
        direct = self.directs.get(snapshot)
        owner = self.owner() if self.owner is not None else None
        if direct is None or owner is None:
            return

        def switch() -> None:
            self.direct = snapshot
            owner.__setstate__((direct, (), None, owner.__dict__))

        _stack.register_direct(owner, switch)


def _slow_target(state: _TransformState) -> Callable[..., Any]:
    """The target of a ``Transformed`` while anything is active anywhere in the process.

    Its ``__wrapped__`` is the plain JAX object, as for the idle target: JAX unwraps it
    to name the traced function in debug info and errors, which must stay the user's.
    """
    plain, builds, build = state.plain, state.builds, state.build
    check = state.check
    if check is not None:
        checked_call = check.checked_call(plain, builds, build, state.directs, state.go_direct)
        checked_call.__wrapped__ = plain  # type: ignore[attr-defined]
        return checked_call
    return _slow_call(state, redirect=bool(state.directs))


def _slow_call(state: _TransformState, *, redirect: bool) -> Callable[..., Any]:
    """The dispatching call of an unchecked ``Transformed``.

    A build's direct call (see ``jit_api``) becomes the wrapper's target once built; the
    wrapper is switched back here when a guarded adapter is installed, the process goes
    idle or the build is dropped. With ``redirect`` (the slow target) a call in such a
    build's stack makes it the target again; without (a direct call's fallback, taken in
    another stack) it only builds anew, so a wrapper used in two stacks stays direct.
    """
    plain, builds, build = state.plain, state.builds, state.build
    current_get = _stack._current_get  # the contextvar's bound ``get``: never rebound
    builds_get = builds.get
    directs = state.directs
    go_direct = state.go_direct

    def slow_call(*args: Any, **kwargs: Any) -> Any:
        # Hot while any override is alive anywhere: no extra frame unless guards exist,
        # and no keyword unpacking for a call that has none.
        snapshot = current_get().snapshot
        guarded = _stack._guards
        if guarded:
            snapshot = effective_snapshot()
        if snapshot is ROOT:
            if _stack.idle and state.owner is not None and (owner := state.owner()) is not None:
                owner._switch_to_fast()
            return plain(*args, **kwargs)
        built = builds_get(snapshot)
        if built is None:
            built = build(snapshot)
            if snapshot in directs and not guarded:
                go_direct(snapshot)
        elif redirect and snapshot in directs and not guarded:
            go_direct(snapshot)
        return built(*args, **kwargs) if kwargs else built(*args)

    slow_call.__wrapped__ = plain  # type: ignore[attr-defined]
    return slow_call


class Transformed(functools.partial):  # type: ignore[type-arg]
    """The function returned by a neutral transform such as ``jaxoverride.jit(f)``.

    Calling it runs the transform that the active stack selects for ``f``: JAX's own
    while nothing is active, an override's otherwise, built once per distinct stack.
    Attributes of the selected function, such as ``lower``, ``trace`` and
    ``eval_shape`` of a jitted function, are forwarded, ``clear_cache()`` clears the
    builds of every stack, and ``__wrapped__`` is ``f``.

    Example:
      >>> import jax.numpy as jnp, jaxoverride as jo
      >>> f = jo.jit(lambda x: x * 2)
      >>> f(jnp.arange(3))
      Array([0, 2, 4], dtype=int32)
      >>> f.lower(jnp.arange(3)).as_text()[:6]
      'module'
    """

    # The partial's target is switched between ``state.plain`` (process idle) and
    # ``_slow_target(state)``: a call then never pays for a Python frame while nothing
    # can be active.

    def __new__(
        cls,
        name: str,
        default: Callable[..., Any],
        fun: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Transformed:
        # The missing-adapter check of a trace (see ``_detect.traced_check``): it costs
        # nothing per call, so the idle dispatch stays JAX's.
        given = _detect.traced_check(name, fun)
        plain = default(given, *args, **kwargs)
        self = super().__new__(cls, plain)
        state = _TransformState(name, default, fun, args, kwargs, plain)
        state.owner = weakref.ref(self)
        attributes = self.__dict__
        for attribute in ("__module__", "__name__", "__qualname__", "__doc__"):
            value = getattr(plain, attribute, None) or getattr(fun, attribute, None)
            if value is not None:
                attributes[attribute] = value
        wrapped = getattr(plain, "__wrapped__", fun)
        attributes["__wrapped__"] = fun if wrapped is given and given is not fun else wrapped
        attributes["_jaxoverride_state"] = state
        if _detect.watching():
            state.check = _detect.transform_check(name, fun)
        if state.check is not None or not _stack.register_fast(self):
            self._switch_to_slow()
        return self

    def _switch_to_slow(self) -> None:
        self._retarget(_slow_target(self.__dict__["_jaxoverride_state"]))

    def _switch_to_fast(self) -> None:
        state: _TransformState = self.__dict__["_jaxoverride_state"]
        if state.check is None and _stack.register_fast(self):
            self._retarget(state.plain)

    def _retarget(self, target: Callable[..., Any]) -> None:
        """Makes ``target`` the partial's function, which stops any direct target."""
        state: _TransformState = self.__dict__["_jaxoverride_state"]
        self.__setstate__((target, (), None, self.__dict__))
        if state.direct is not None:
            state.direct = None
            _stack.forget_direct(self)

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        return self if instance is None else types.MethodType(self, instance)

    def clear_cache(self) -> None:
        """Clears the compiled code of this function under every stack, as
        ``jax.jit(f).clear_cache()`` does for ``f``; the next call compiles again."""
        state: _TransformState = self.__dict__["_jaxoverride_state"]
        self._selected_attribute("clear_cache")  # refused if the selected one lacks it
        for built in {id(b): b for b in (state.plain, *list(state.builds.values()))}.values():
            clear = getattr(built, "clear_cache", None)
            if clear is not None:
                clear()

    def _selected_attribute(self, attribute: str) -> Any:
        state: _TransformState = self.__dict__["_jaxoverride_state"]
        target = state.target()
        try:
            return getattr(target, attribute)
        except AttributeError:
            raise AttributeError(
                f"jaxoverride.{state.name}({getattr(state.fun, '__name__', state.fun)!r}) "
                f"has no attribute {attribute!r} under the active stack: the implementation "
                f"of {state.name!r} selected here returned {type(target).__name__}, which "
                "lacks it. See jaxoverride.current_stack() for what is active."
            ) from None

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__") or attribute == "_jaxoverride_state":
            raise AttributeError(attribute)
        return self._selected_attribute(attribute)

    def __repr__(self) -> str:
        state: _TransformState = self.__dict__["_jaxoverride_state"]
        return f"<jaxoverride.{state.name} of {state.fun!r}>"

    def __copy__(self) -> Transformed:
        """A new neutral transform of the same function and options, as ``copy.copy`` of
        ``jax.jit(f)`` is a new jitted ``f``; it builds and caches on its own."""
        state: _TransformState = self.__dict__["_jaxoverride_state"]
        return Transformed(state.name, state.default, state.fun, state.args, dict(state.kwargs))

    def __deepcopy__(self, memo: dict[int, Any]) -> Transformed:
        """As ``__copy__``, over deep copies of the function and options (``jax.jit``'s
        object copies the same way): a jitted bound method in a deep-copied object is
        bound to the copy."""
        state: _TransformState = self.__dict__["_jaxoverride_state"]
        fun, args, kwargs = copy.deepcopy((state.fun, state.args, state.kwargs), memo)
        return Transformed(state.name, state.default, fun, args, kwargs)

    def __reduce__(self) -> Any:
        raise TypeError(
            "jaxoverride transformed functions cannot be pickled; pickle the "
            "underlying function and transform it again after loading."
        )


def neutral_transform(name: str, default: F) -> F:
    """Builds the neutral version of a JAX transform (a function of a function)."""
    parameter = next(iter(inspect.signature(default).parameters.values()))
    optional = parameter.default is not inspect.Parameter.empty
    by_keyword = parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD

    def transform(*args: Any, **kwargs: Any) -> Any:
        if args:
            fun, rest = args[0], args[1:]
        elif by_keyword and parameter.name in kwargs:
            fun, rest = kwargs.pop(parameter.name), ()
        elif optional:
            fun, rest = parameter.default, ()
        else:
            return default(**kwargs)  # JAX reports the missing function in its own words.
        if optional and fun is parameter.default:
            # As in JAX, ``transform(**options)`` returns a decorator; JAX checks the
            # options now (a misspelt or missing one), so let it.
            default(*rest, **kwargs)
            return functools.partial(transform, *rest, **kwargs)
        return Transformed(name, default, fun, rest, kwargs)

    functools.update_wrapper(transform, default, assigned=("__name__", "__annotations__"))
    transform.__qualname__ = name
    transform.__module__ = "jaxoverride"
    transform.__doc__ = _doc(name, default, "each time the returned function is called")
    return cast(F, transform)


def _check_rule_function(value: object, role: str, where: str, example: str) -> None:
    if not callable(value):
        raise TypeError(
            f"{where}: {role} must be a function, got {type(value).__name__} {value!r}. "
            f"Pass the function itself, as in {example}."
        )


def _jax_constructor(jax_class: type) -> Callable[..., None]:
    """``NeutralRule.__init__`` with the signature ``inspect.signature(jax_class)`` shows.

    JAX's moves between releases (an annotated ``__init__``, or a ``__new__`` without
    annotations), so it is read, not written. Set on ``__init__``, not the class, so that
    an instance's signature is still that of the function it wraps.
    """

    def __init__(self, fun, nondiff_argnums=(), nondiff_argnames=()):  # noqa: N807
        NeutralRule.__init__(self, fun, nondiff_argnums, nondiff_argnames)

    theirs = inspect.signature(jax_class)
    self = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    __init__.__signature__ = theirs.replace(  # type: ignore[attr-defined]
        parameters=[self, *theirs.parameters.values()]
    )
    return __init__


class NeutralRule(Generic[ReturnValue]):
    """Base of ``jaxoverride.custom_vjp`` and ``jaxoverride.custom_jvp``.

    While nothing is active a call is a call of the JAX object built from the same
    definition. Otherwise the active override of the name builds one object per stack,
    the rules defined on this one are replayed onto it, and the call goes there.
    Redefining a rule drops every build.

    Example:
      >>> import jax, jax.numpy as jnp, jaxoverride as jo
      >>> @jo.custom_vjp
      ... def clip_gradient(x):
      ...     return x
      >>> clip_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1.0, 1.0),))
      >>> isinstance(clip_gradient, jo.NeutralRule)
      True
      >>> float(jax.grad(lambda x: 3.0 * clip_gradient(x))(2.0))
      1.0
    """

    _name: str
    _default: Callable[..., Any]
    _kind: str  # "VJP" or "JVP", for JAX's own wording of a missing rule

    def __init_subclass__(cls, jax_class: type | None = None, **options: Any):
        """A neutral class over ``jax_class``: it builds ``jax_class``, with its constructor's
        signature (``_jax_constructor``), and is named as JAX's (``custom_vjp``: "VJP")."""
        super().__init_subclass__(**options)
        if jax_class is not None:
            cls._name = cls.__name__
            cls._default = jax_class
            cls._kind = cls.__name__.removeprefix("custom_").upper()
            cls.__init__ = _jax_constructor(jax_class)
            cls.__doc__ = _doc(cls._name, jax_class, "each time the decorated function is called")
            cls.__module__ = "jaxoverride"

    # The annotations are JAX's, to the letter: ``inspect.signature`` compares them.
    def __init__(
        self,
        fun: Callable[..., ReturnValue],
        nondiff_argnums: Sequence[int] = (),
        nondiff_argnames: Sequence[str] = (),
    ):
        where = f"jaxoverride.{self._name}"
        _check_rule_function(fun, "the decorated function", where, f"{where}(my_function)")
        _check_nondiff_argnums(fun, nondiff_argnums, where=where)
        plain = self._default(
            fun, nondiff_argnums=nondiff_argnums, nondiff_argnames=nondiff_argnames
        )
        functools.update_wrapper(self, fun)
        self.__dict__.pop("_jaxoverride_state", None)  # fun may itself be neutral
        self.fun = fun
        self.nondiff_argnums = rule_nondiff_argnums(plain)
        self._plain = plain
        self._options = {"nondiff_argnums": nondiff_argnums, "nondiff_argnames": nondiff_argnames}
        self._rules: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self._builds: dict[_stack.Snapshot, Any] = {}

    def _define(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Defines the rule on JAX's object; returns what JAX's method returned, with JAX's
        object replaced by this one (``custom_vjp3.defvjp`` returns its rule, for chaining)."""
        returned = getattr(self._plain, method)(*args, **kwargs)
        self._rules = [(method, args, kwargs)]  # a new definition replaces the old one
        self._builds.clear()
        return self if returned is self._plain else returned

    def __call__(self, *args: Any, **kwargs: Any) -> ReturnValue:
        if not self._rules:
            self._refuse_undefined(args, kwargs)
        if _stack.idle:
            return self._plain(*args, **kwargs)
        snapshot = effective_snapshot()
        if snapshot is ROOT:
            return self._plain(*args, **kwargs)
        built = self._builds.get(snapshot)
        if built is None:
            built = self._build(snapshot)
        return built(*args, **kwargs)

    def _refuse_undefined(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> NoReturn:
        """Raises JAX's own error for a rule never defined, with the fix added.

        JAX's text differs between versions and flags ("using defvjp or defremat" under
        ``jax_custom_vjp3`` in JAX 0.12), so JAX's object is called to raise it: it checks
        for the rule before it evaluates anything.
        """
        fix = "defvjp(fwd, bwd)" if self._kind == "VJP" else "defjvp(f_jvp)"
        fix = f"Define the rule before calling it: f.{fix}."
        try:
            self._plain(*args, **kwargs)
        except AttributeError as error:
            raise AttributeError(f"{error} {fix}") from None
        raise AttributeError(  # JAX ran without the rule: its 0.10 message, with the fix
            f"No {self._kind} defined for {self._name} function "
            f"{getattr(self.fun, '__name__', self.fun)} using "
            f"{'defvjp' if self._kind == 'VJP' else 'defjvp'}. {fix}"
        )

    def _build(self, snapshot: _stack.Snapshot) -> Any:
        built = dispatch(snapshot, self._name, (self.fun,), dict(self._options))
        for method, args, kwargs in self._rules:
            getattr(built, method)(*args, **kwargs)
        remember_build(self._builds, snapshot, built)
        return built

    def __getattr__(self, attribute: str) -> Any:
        # JAX's object exposes the rules it holds (``fwd``, ``bwd``, ``jvp``, ...).
        if attribute.startswith("__") or attribute in ("_plain", "_rules", "_builds"):
            raise AttributeError(attribute)
        return getattr(self._plain, attribute)

    def __repr__(self) -> str:
        return f"<jaxoverride.{self._name} of {self.fun!r}>"


def _check_nondiff_argnums(fun: Callable[..., Any], nondiff_argnums: Any, *, where: str) -> None:
    """Refuses what JAX would only trip over at the first call (an ``IndexError``)."""
    try:
        argnums = tuple(nondiff_argnums)
    except TypeError:
        raise TypeError(
            f"{where}: nondiff_argnums must be a sequence of argument positions such as (0,), "
            f"got {type(nondiff_argnums).__name__} {nondiff_argnums!r}."
        ) from None
    if not all(isinstance(argnum, int) and not isinstance(argnum, bool) for argnum in argnums):
        raise TypeError(
            f"{where}: nondiff_argnums must hold ints (argument positions), got {argnums!r}."
        )
    try:
        parameters = inspect.signature(fun).parameters.values()
    except (TypeError, ValueError):
        return
    kinds = [parameter.kind for parameter in parameters]
    if inspect.Parameter.VAR_POSITIONAL in kinds:
        return
    positional = sum(
        kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        for kind in kinds
    )
    if bad := [argnum for argnum in argnums if not -positional <= argnum < positional]:
        raise IndexError(
            f"{where}: nondiff_argnums {argnums!r} names position(s) {bad} of "
            f"{getattr(fun, '__name__', fun)!r}, which takes {positional} positional "
            "argument(s). Number the non-differentiable arguments from 0."
        )
