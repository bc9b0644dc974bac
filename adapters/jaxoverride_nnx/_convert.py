"""``make_jaxpr`` under ``track``, and running JAX's pure callbacks with nothing tracked.

Equinox closure-converts a user's callback with ``jax.make_jaxpr`` (``filter_closure_convert``
in optimistix, lineax and diffrax): the tracked Variables that the callback reads become
constants of the jaxpr, which Equinox then passes as explicit operands, so gradients with
respect to the module flow through them. Reads therefore need nothing but a fresh
function per call: JAX caches a trace by the function's identity, and a cached trace
would serve the weights it was first traced with.

A write cannot come out: the jaxpr has fixed outputs, and the libraries evaluate it inside
their own primitives and custom derivative rules. The override lets the callback write at
the traced level, sees the write when the trace ends and refuses it with
``PureFunctionWriteError``, instead of NNX's bare ``TraceContextError``.

``run_untracked`` runs a function that JAX calls back while it transforms (a custom rule's
backward pass, run when JAX transposes): such a function is pure by contract, and the
tracked Variables hold values of the enclosing trace there, which a neutral loop inside it
would otherwise carry in as constants that JAX does not expect.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from flax.errors import TraceContextError

import jaxoverride as jo
from jaxoverride_nnx._lift import changed, run_lifted
from jaxoverride_nnx._rules import PureFunctionWriteError
from jaxoverride_nnx._scope import ACTIVE, Tracked, current

WHERE = "jaxoverride.make_jaxpr"


def run_untracked(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Calls ``fn`` with nothing tracked: neutral calls inside it are JAX's own."""
    token = ACTIVE.set(None)
    try:
        return fn(*args, **kwargs)
    finally:
        ACTIVE.reset(token)


_WHY = (
    "A jaxpr has fixed outputs, and code that closure-converts a callback (Equinox's "
    "filter_closure_convert in optimistix, lineax and diffrax) evaluates it inside its own "
    "primitives and custom derivative rules, so the new value could never come out. Move the "
    "write out of the callback (before or after the solver call); reading tracked Variables "
    "inside is fine."
)


def _refuse_writes(tracked: Tracked, before: list[Any], after: list[Any]) -> None:
    written = changed(before, after)
    if written:
        paths = ", ".join(f"`{tracked.path(index)}`" for index in sorted(written))
        raise PureFunctionWriteError(
            f"{WHERE}: the function being traced into a jaxpr wrote the tracked NNX "
            f"Variable(s) {paths}. {_WHY}"
        )


def _refuse_write_error(error: TraceContextError) -> PureFunctionWriteError:
    return PureFunctionWriteError(
        f"{WHERE}: the function being traced into a jaxpr wrote an NNX Variable. {_WHY} If the "
        "module itself was passed to the library (not closed over), the library flattened it "
        "into arrays and the callback wrote to a copy, which is lost either way. "
        f"NNX said: {error}"
    )


def make_jaxpr(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
    """The ``"make_jaxpr"`` override: ``jax.make_jaxpr``'s signature.

    Under ``track`` each call traces a fresh function, so tracked Variables are read as
    they are now (as constants of the jaxpr, at the level of the caller's trace), and a
    Variable written while tracing is refused with ``PureFunctionWriteError``.
    """
    below = jo.next_impl("make_jaxpr")
    plain = below(fun, *args, **kwargs)

    @functools.wraps(plain)
    def call(*call_args: Any, **call_kwargs: Any) -> Any:
        tracked = current()
        if tracked is None:
            return plain(*call_args, **call_kwargs)
        before = tracked.read()

        @functools.wraps(fun)
        def fresh(*inner_args: Any, **inner_kwargs: Any) -> Any:
            try:
                out, after = run_lifted(tracked, None, fun, inner_args, inner_kwargs, WHERE)
            except TraceContextError as error:  # a write to a Variable that is not lifted
                raise _refuse_write_error(error) from error
            _refuse_writes(tracked, before, after)
            return out

        return below(fresh, *args, **kwargs)(*call_args, **call_kwargs)

    return call
