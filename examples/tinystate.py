"""tinystate: a tiny Haiku-like framework, the subject of docs/writing-an-adapter.md.

A function reads parameters (``param``), reads and writes state (``get_state``,
``set_state``) and draws rng keys (``next_key``); ``transform`` makes it pure:
``init(rng, *args) -> (params, state)``, ``apply(params, state, rng, *args) -> (out, state)``.
Nothing here knows jaxoverride: ``tinystate_adapter`` makes the neutral API work inside.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import tinystate as ts
  >>> def count(x):
  ...     n = ts.get_state("n", (), jnp.zeros)
  ...     ts.set_state("n", n + 1)
  ...     return x * ts.param("w", (), jax.nn.initializers.ones)
  >>> model = ts.transform(count)
  >>> params, state = model.init(jax.random.key(0), 2.0)
  >>> out, state = model.apply(params, state, None, 2.0)
  >>> float(out), float(state["n"])
  (2.0, 2.0)
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax


class TinyStateError(Exception):
    """A misuse of tinystate: outside ``transform``, a missing entry, a refused write."""


class Frame:
    """One running transform: its parameters, state and rng key, and whether it initialises.

    ``refuse``, when set, makes writes, draws and creations raise ``refuse(what)``: a tool
    that runs a function where nothing it writes could come out sets it.
    """

    __slots__ = ("initializing", "param_key", "params", "refuse", "rng", "state")

    def __init__(self, params: dict[str, Any], state: dict[str, Any], rng: Any, init: bool):
        self.params, self.state, self.rng = params, state, rng
        self.initializing = init
        self.param_key = rng  # initializers draw from it, salted with the parameter's name
        self.refuse: Callable[[str], Exception] | None = None


_local = threading.local()


def _frames() -> list[Frame]:
    return _local.__dict__.setdefault("frames", [])


def in_transform() -> bool:
    """Whether a transformed function is running in this thread."""
    return bool(_frames())


def current_frame() -> Frame:
    """The innermost running transform's frame."""
    if not _frames():
        raise TinyStateError(
            "tinystate: param, get_state, set_state and next_key work only inside a "
            "function transformed by tinystate.transform."
        )
    return _frames()[-1]


def _check_writable(frame: Frame, what: str) -> None:
    if frame.refuse is not None:
        raise frame.refuse(what)


def param(name: str, shape: tuple[int, ...], init: Callable[[Any, tuple[int, ...]], Any]) -> Any:
    """The parameter ``name``; at init, created as ``init(key, shape)`` if missing."""
    frame = current_frame()
    if name not in frame.params:
        if not frame.initializing:
            raise TinyStateError(
                f"tinystate: no parameter {name!r} (params has {sorted(frame.params)}); "
                "init creates parameters, apply only reads them."
            )
        _check_writable(frame, f"creating parameter {name!r}")
        if frame.param_key is None:
            raise TinyStateError(
                f"tinystate: creating {name!r} needs an rng key; pass one to init."
            )
        key = jax.random.fold_in(frame.param_key, zlib.crc32(name.encode()))
        frame.params[name] = init(key, tuple(shape))
    return frame.params[name]


def get_state(
    name: str, shape: tuple[int, ...] = (), init: Callable[..., Any] | None = None
) -> Any:
    """The state entry ``name``; at init, created as ``init(shape)`` if missing."""
    frame = current_frame()
    if name not in frame.state:
        if init is None or not frame.initializing:
            raise TinyStateError(f"tinystate: no state {name!r}; init creates state entries.")
        _check_writable(frame, f"creating state {name!r}")
        frame.state[name] = init(tuple(shape))
    return frame.state[name]


def set_state(name: str, value: Any) -> None:
    """Sets the state entry ``name`` (a new one at init only)."""
    frame = current_frame()
    _check_writable(frame, f"set_state({name!r})")
    if name not in frame.state and not frame.initializing:
        raise TinyStateError(f"tinystate: no state {name!r}; init creates state entries.")
    frame.state[name] = value


def next_key() -> Any:
    """A fresh rng key, split from the transform's rng."""
    frame = current_frame()
    _check_writable(frame, "next_key()")
    if frame.rng is None:
        raise TinyStateError("tinystate: next_key() needs an rng key; pass one to init/apply.")
    frame.rng, key = jax.random.split(frame.rng)
    return key


def _run(frame: Frame, f: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    _frames().append(frame)
    try:
        return f(*args, **kwargs)
    finally:
        _frames().pop()


class Transformed(NamedTuple):
    init: Callable[..., tuple[dict[str, Any], dict[str, Any]]]
    apply: Callable[..., tuple[Any, dict[str, Any]]]
    init_with_output: Callable[..., tuple[Any, tuple[dict[str, Any], dict[str, Any]]]]


def transform(f: Callable[..., Any]) -> Transformed:
    """``f`` as pure ``init``, ``apply`` and ``init_with_output`` functions."""

    def init_with_output(rng: Any, *args: Any, **kwargs: Any) -> Any:
        frame = Frame({}, {}, rng, init=True)
        out = _run(frame, f, args, kwargs)
        return out, (frame.params, frame.state)

    def init(rng: Any, *args: Any, **kwargs: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        return init_with_output(rng, *args, **kwargs)[1]

    def apply(params: Any, state: Any, rng: Any, *args: Any, **kwargs: Any) -> Any:
        frame = Frame(dict(params), dict(state), rng, init=False)
        out = _run(frame, f, args, kwargs)
        return out, frame.state

    return Transformed(init, apply, init_with_output)
