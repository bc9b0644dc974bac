"""The ``jit`` override: Haiku state passed in and out, and module naming that a cache hit
replays instead of silently skipping.

Haiku's private ``stateful.jit`` caches on the arguments only: called twice in one
transform, init names the second module ``linear_1`` but apply hits the cache and reuses
``linear``. Here the naming state at the call, init vs apply, and the active custom
creators, getters, setters and interceptors form a *key*, interned by content and passed
to one ``jax.jit`` as a static argument: a new situation traces anew, and a hit advances
the naming counters as the trace did (the key remembers where it left them). Params,
state and rng are ordinary arguments; nothing is keyed on object identities.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

from haiku._src import base, module as hk_module

import jaxoverride as jo
from jaxoverride.adapter_kit import resolve_argnums
from jaxoverride_haiku._frames import (
    Names,
    added_submodules,
    current_frame,
    naming_signature,
    policy_left,
    policy_received,
    policy_state,
    register_submodules,
    solve_policy,
    state_usable,
    submodule_sets,
)
from jaxoverride_haiku._rng import temporary_state, update_state

_KEY_LIMIT = 1024


class _Key:
    """One naming situation of one jitted function; hashed by identity, interned by content."""

    __slots__ = ("end", "submodules")

    def __init__(self) -> None:
        self.end: Names | None = None
        self.submodules: list[set[str]] = []

    def replay(self, frame: base.Frame) -> None:
        if self.end is not None:
            self.end.restore_into(frame)
        register_submodules(frame, self.submodules)


def customisations() -> tuple[Any, ...]:
    return tuple(
        tuple(stack._storage)
        for stack in (
            base.param_creator_stack,
            base.state_creator_stack,
            base.param_getter_stack,
            base.state_getter_stack,
            base.state_setter_stack,
            hk_module.interceptor_stack,
        )
    )


def _shift(argnums: tuple[int, ...], by: int) -> tuple[int, ...]:
    return tuple(i + by if i >= 0 else i for i in argnums)


_PREFIX = 2  # the key and the Haiku state precede the user's arguments


def _pure_signature(fun: Callable[..., Any]) -> inspect.Signature | None:
    try:
        signature = inspect.signature(fun)
    except (TypeError, ValueError):
        return None
    prefix = [
        inspect.Parameter("_jaxoverride_key", inspect.Parameter.POSITIONAL_ONLY),
        inspect.Parameter("_jaxoverride_haiku_state", inspect.Parameter.POSITIONAL_ONLY),
    ]
    return signature.replace(parameters=[*prefix, *signature.parameters.values()])


def _positional_count(fun: Callable[..., Any]) -> int:
    try:
        parameters = inspect.signature(fun).parameters.values()
    except (TypeError, ValueError):
        return 1
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(1 for p in parameters if p.kind in kinds)


class HaikuJit:
    """What ``jaxoverride.jit(fun)`` runs inside ``hk.transform`` with the adapter active."""

    def __init__(self, fun: Callable[..., Any], below: Callable[..., Any], options: dict[str, Any]):
        self._fun = fun
        self._plain = below(fun, **options)
        self._keys: dict[tuple[Any, ...], _Key] = {}
        self._lock = threading.Lock()
        inner_options = dict(options)
        # Resolve names to positions on the user's signature (JAX infers them only when
        # one of the two is missing), then make room for the key and the state.
        donate_argnums, donate_argnames, static_argnums, static_argnames = resolve_argnums(
            fun,
            options.get("donate_argnums"),
            options.get("donate_argnames"),
            options.get("static_argnums"),
            options.get("static_argnames"),
        )
        inner_options["static_argnums"] = (0, *_shift(static_argnums, _PREFIX))
        inner_options["static_argnames"] = static_argnames
        inner_options["donate_argnums"] = _shift(donate_argnums, _PREFIX)
        inner_options["donate_argnames"] = donate_argnames
        in_shardings = options.get("in_shardings")
        # The Haiku state gets None (JAX chooses: it follows the committed inputs).
        self._single_in_sharding: Any = None
        if isinstance(in_shardings, (tuple, list)):
            # Shardings are given per dynamic positional argument: the state comes first.
            inner_options["in_shardings"] = (None, *in_shardings)
        elif in_shardings is not None and "in_shardings" in options:
            # One sharding for every argument: it must not reach the state, so it is spread
            # over the positional arguments when their number is known (one jit per count).
            self._single_in_sharding = in_shardings
            del inner_options["in_shardings"]
        if "out_shardings" in options:
            inner_options["out_shardings"] = (options["out_shardings"], None)
        self._static_argnums = frozenset(static_argnums)
        self._below = below
        self._inner_options = inner_options
        self._per_count: dict[int, Callable[..., Any]] = {}
        self._inner = below(self._pure_function(), **inner_options)
        if self._single_in_sharding is not None:
            # Built now for the usual count, while the implementation below is resolvable.
            self._inner_for(_positional_count(fun))
        functools.update_wrapper(self, fun, updated=())
        jo.jit_api(self, fun, stage=self._stage, jitted=self._jitted)

    def _inner_for(self, count: int) -> Callable[..., Any]:
        """The jitted pure function for ``count`` positional arguments (single in_sharding)."""
        inner = self._per_count.get(count)
        if inner is None:
            dynamic = sum(1 for i in range(count) if i not in self._static_argnums)
            shardings = (None, *([self._single_in_sharding] * dynamic))
            options = {**self._inner_options, "in_shardings": shardings}
            with self._lock:
                inner = self._per_count.setdefault(
                    count, self._below(self._pure_function(), **options)
                )
        return inner

    def _pure_function(self) -> Callable[..., Any]:
        fun = self._fun

        def pure(key: _Key, handed: Any, *args: Any, **kwargs: Any) -> Any:
            policy = solve_policy()
            state, received = (handed, None) if policy is None else handed
            with temporary_state(state), base.push_jax_trace_level():
                inner = current_frame()
                submodules_before = submodule_sets(inner)
                # Under ``jaxoverride.solve_state`` the frozen values are this function's
                # own argument (``received`` too): nothing of the caller is baked in.
                frame = None if policy is None else policy.push(state, received=received)
                try:
                    out = fun(*args, **kwargs)
                    changed = policy_left(policy, frame, state)
                finally:
                    if policy is not None and frame is not None:
                        policy.pop(frame)
                key.end = Names.capture(inner)
                key.submodules = added_submodules(submodules_before, inner)
            return out, changed

        try:
            functools.update_wrapper(pure, fun)
        except (AttributeError, TypeError):  # pragma: no cover - exotic callables
            pass
        signature = _pure_signature(fun)
        if signature is not None:
            pure.__signature__ = signature  # type: ignore[attr-defined]
        return pure

    def _key(self, frame: base.Frame, policy: Any = None) -> _Key:
        slots = None if policy is None else frozenset(policy.frozen)
        content = (frame.freeze_params, naming_signature(frame), customisations(), slots)
        key = self._keys.get(content)
        if key is None:
            with self._lock:
                if len(self._keys) >= _KEY_LIMIT:
                    # A fresh key object can never hit an old cache entry: at worst a retrace.
                    self._keys.clear()
                key = self._keys.setdefault(content, _Key())
        return key

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not state_usable():
            return self._plain(*args, **kwargs)
        frame = current_frame()
        policy = solve_policy()
        key = self._key(frame, policy)
        inner = self._inner if self._single_in_sharding is None else self._inner_for(len(args))
        out, changed = inner(key, _handed(policy), *args, **kwargs)
        update_state(changed if policy is None else policy.written(changed))
        key.replay(frame)
        return out

    def _stage(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``lower``/``trace``/``eval_shape`` of what a call runs: inside a transform, the
        pure function with the Haiku state as its second argument (the state stays as it
        was: nothing runs); outside, the stateless jitted function."""
        if not state_usable():
            return getattr(self._plain, method)(*args, **kwargs)
        policy = solve_policy()
        key = self._key(current_frame(), policy)
        inner = self._inner if self._single_in_sharding is None else self._inner_for(len(args))
        staged = getattr(inner, method)(key, _handed(policy), *args, **kwargs)
        return staged[0] if method == "eval_shape" else staged

    def _jitted(self) -> list[Callable[..., Any]]:
        return [self._plain, self._inner, *self._per_count.values()]

    def __repr__(self) -> str:
        return f"<jaxoverride_haiku jit of {self._fun!r}>"


def _handed(policy: Any) -> Any:
    """The state argument of the jitted pure function: the frame's state, under a
    ``jaxoverride.solve_state`` with what the evaluations before the call left."""
    state = policy_state(policy)
    return state if policy is None else (state, policy_received(policy))


def jit(fun: Callable[..., Any], **options: Any) -> HaikuJit:
    """The ``"jit"`` override: ``jax.jit``'s signature; returns a ``HaikuJit``.

    One per function and options, shared by every wrapper of them (as ``jax.jit`` shares
    its cache): ``jo.jit(f)(x)`` built again inside a transform compiles nothing again.
    Its keys are naming situations, so sharing never merges two modules' names.
    """
    below = jo.next_impl("jit")
    key = (HaikuJit, tuple(sorted(options.items())), below)
    return jo.reuse_jit(fun, key, lambda: HaikuJit(fun, below, options))
