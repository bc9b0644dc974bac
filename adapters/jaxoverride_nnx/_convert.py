"""``make_jaxpr`` under ``track``: tracked Variables read at the traced level, writes refused.

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
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from flax.errors import TraceContextError

import jaxoverride as jo
from jaxoverride_nnx._rules import PureFunctionWriteError, _pure
from jaxoverride_nnx._scope import current

WHERE = "jaxoverride.make_jaxpr"


_WHAT = "the function being traced into a jaxpr"
_WHY = (
    "A jaxpr has fixed outputs, and code that closure-converts a callback (Equinox's "
    "filter_closure_convert in optimistix, lineax and diffrax) evaluates it inside its own "
    "primitives and custom derivative rules"
)
_FIX = (
    "Move the write out of the callback (before or after the solver call); reading tracked "
    "Variables inside is fine."
)


def _refuse_write_error(error: TraceContextError) -> PureFunctionWriteError:
    return PureFunctionWriteError(
        f"{WHERE}: {_WHAT} wrote an NNX Variable. {_WHY}, so the write could never come out. "
        f"{_FIX} If the module itself was passed to the library (not closed over), the library "
        f"flattened it into arrays and the callback wrote to a copy. NNX said: {error}"
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
        pure = _pure(tracked, fun, _WHAT, WHERE, why=_WHY, fix=_FIX)

        @functools.wraps(fun)
        def fresh(*inner_args: Any, **inner_kwargs: Any) -> Any:
            try:
                return pure(*inner_args, **inner_kwargs)
            except TraceContextError as error:  # a write to a Variable that is not lifted
                raise _refuse_write_error(error) from error

        return below(fresh, *args, **kwargs)(*call_args, **call_kwargs)

    return call
