"""The trace layer: an override of every name that records the call and delegates down.

One ``OverrideContext`` per *compiled-in* configuration (names, progress bars and their
options), so that the stack, and every cache keyed on it, tells configurations apart.
Where records go matters only on the host: it lives in ``_SESSION``, so entering
``trace()`` again with the same configuration finds the same layer and its builds.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jaxoverride as jo
from jaxoverride import adapter_kit as kit
from jaxoverride.adapter_kit import CALLS, RULES, TRANSFORMS, describe_impl, override_position
from jaxoverride_debug._describe import (
    describe_arguments,
    describe_call,
    describe_options,
    function_name,
)
from jaxoverride_debug._progress import with_progress
from jaxoverride_debug._record import Call

LABEL = "jaxoverride_debug"


@dataclass(frozen=True)
class Config:
    """What a trace compiles into programs; equal configurations share one layer."""

    names: frozenset[str] | None
    progress: bool
    min_steps: int
    progress_options: tuple[tuple[str, Any], ...]

    def wants(self, name: str) -> bool:
        return self.names is None or name in self.names

    def label(self) -> str:
        parts = []
        if self.names is not None:
            parts.append("names=" + ",".join(sorted(self.names)))
        if self.progress:
            parts.append(f"progress, min_steps={self.min_steps}")
        return f"{LABEL}({'; '.join(parts)})" if parts else LABEL


@dataclass
class Session:
    """Where the records of one ``trace()`` object go."""

    emit_to: Callable[[Call], object]
    calls: list[Call] = field(default_factory=list)

    def emit(self, call: Call) -> None:
        self.calls.append(call)
        self.emit_to(call)


_SESSION: contextvars.ContextVar[Session | None] = contextvars.ContextVar(
    "jaxoverride_debug_session", default=None
)
# How many recorded calls enclose the running code in this thread or task.
_DEPTH: contextvars.ContextVar[int] = contextvars.ContextVar("jaxoverride_debug_depth", default=0)


def _recording(config: Config, name: str) -> tuple[Session, str, tuple[str, ...]] | None:
    """The session, the implementation below and those above, if this layer records
    ``name`` now (not where another trace layer above already records it)."""
    session = _SESSION.get()
    if session is None or not config.wants(name):
        return None
    position = override_position(name)
    if any(getattr(impl, "_jaxoverride_debug", False) for impl in position.above):
        return None
    above = tuple(describe_impl(impl, name) for impl in position.above)
    return session, describe_impl(position.below, name), above


def _below(depth: int, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``call(*args, **kwargs)`` one recorded call deeper."""
    token = _DEPTH.set(depth + 1)
    try:
        return call(*args, **kwargs)
    finally:
        _DEPTH.reset(token)


# Where the function that a call runs is among its arguments: (position, keyword).
_FUNCTION_ARGUMENT = {
    "lax.scan": (0, "f"),
    "lax.while_loop": (1, "body_fun"),
    "lax.fori_loop": (2, "body_fun"),
    "lax.map": (0, "f"),
    "jvp": (0, "fun"),
    "vjp": (0, "fun"),
    "linearize": (0, "fun"),
    "eval_shape": (0, "fun"),
    "closure_convert": (0, "fun"),
    "lax.custom_root": (0, "f"),
    "lax.custom_linear_solve": (0, "matvec"),
}


def _function_argument(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if name not in _FUNCTION_ARGUMENT:
        return None
    position, keyword = _FUNCTION_ARGUMENT[name]
    return args[position] if len(args) > position else kwargs.get(keyword)


def _make_call(name: str, config: Config) -> Callable[..., Any]:
    def traced_call(*args: Any, **kwargs: Any) -> Any:
        below = jo.next_impl(name)
        recording = _recording(config, name)
        if recording is None:
            return below(*args, **kwargs)
        session, impl, above = recording
        shapes = describe_call(name, args, kwargs)
        attached = None
        if config.progress:
            options, steps = dict(config.progress_options), config.min_steps
            attached = with_progress(name, args, kwargs, min_steps=steps, options=options)
        depth = _DEPTH.get()
        body = _function_argument(name, args, kwargs)
        function = None if body is None else function_name(body)
        session.emit(Call(name, "call", shapes, impl, depth, function, above, attached is not None))
        if attached is not None:
            args, kwargs = attached
        return _below(depth, below, *args, **kwargs)

    return _marked(traced_call, name)


def _marked(override: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``override`` named for ``name``, and marked as a trace layer's (``_recording``)."""
    override.__name__ = override.__qualname__ = f"traced {name}"
    override.__module__ = __name__
    override._jaxoverride_debug = True  # type: ignore[attr-defined]
    return override


class TracedFunction:
    """What a traced transform returns: the function built below, recording each call.

    Attributes of the built function (``lower``, ``trace`` of a jitted function) are
    forwarded, as ``jaxoverride.Transformed`` forwards them.
    """

    __slots__ = ("__wrapped__", "_config", "_function", "_impl", "_name")

    def __init__(
        self, name: str, built: Callable[..., Any], function: str, impl: str, config: Config
    ):
        self.__wrapped__ = built
        self._name = name
        self._function = function
        self._impl = impl
        self._config = config

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        session = _SESSION.get()
        if session is None or not self._config.wants(self._name):
            return self.__wrapped__(*args, **kwargs)
        depth = _DEPTH.get()
        shapes = describe_arguments(args, kwargs)
        session.emit(Call(self._name, "run", shapes, self._impl, depth, self._function))
        return _below(depth, self.__wrapped__, *args, **kwargs)

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self.__wrapped__, attribute)

    def __repr__(self) -> str:
        return f"<traced {self._name}({self._function})>"


def _make_transform(name: str, config: Config) -> Callable[..., Any]:
    def traced_transform(fun: Any, *args: Any, **kwargs: Any) -> Any:
        below = jo.next_impl(name)
        recording = _recording(config, name)
        if recording is None:
            return below(fun, *args, **kwargs)
        session, impl, above = recording
        function = function_name(fun)
        options = describe_options(kwargs, args)
        session.emit(Call(name, "build", options, impl, _DEPTH.get(), function, above))
        return TracedFunction(name, below(fun, *args, **kwargs), function, impl, config)

    return _marked(traced_transform, name)


_lock = threading.Lock()
_contexts: dict[Config, jo.OverrideContext] = {}
# Configurations differ mostly by progress_options (a new file object per run, say); past
# this many the table starts afresh: a trace keeps its own layer, later ones rebuild.
_CONTEXT_LIMIT = 64


def context_for(config: Config) -> jo.OverrideContext:
    """The one layer of ``config``, made on first use and kept for the process."""
    context = _contexts.get(config)
    if context is not None:
        return context
    with _lock:
        if config not in _contexts:
            if len(_contexts) >= _CONTEXT_LIMIT:
                _contexts.clear()
            table = kit.OverrideTable(LABEL, _impls(config), label=config.label())
            _contexts[config] = table.context()
        return _contexts[config]


def _impls(config: Config) -> dict[str, Callable[..., Any]]:
    """Every overridable name, recorded: a trace passes nothing through."""
    impls = {name: _make_call(name, config) for name in CALLS}
    # A rule's override builds an object as a transform's builds a function; the
    # record forwards ``defvjp``/``defjvp`` to it, so the core's replay reaches JAX.
    built_once = (*TRANSFORMS, *RULES)
    impls.update({name: _make_transform(name, config) for name in built_once})
    return impls


# Declared at import, so that the contract test sees it before any trace: every
# configuration's table overrides the same names.
kit.OverrideTable(LABEL, _impls(Config(None, False, 0, ())))
