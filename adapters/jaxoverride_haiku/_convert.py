"""Closure conversion, ``make_jaxpr`` and JAX's custom solves inside ``hk.transform``.

Each traces the user's function into a jaxpr whose inputs and outputs are fixed. So:

* at init the function is traced once, as at apply: a parameter it creates is made at
  the call's site (``_site``), outside the trace, under the name apply uses (only where
  it creates state does init fall back to a creation pass first);
* the function is then traced in a temporary Haiku frame built from the caller's
  params, state and rng: parameters it reads are values it closes over, which
  ``closure_convert`` hoists when they are being differentiated or traced;
* a state write (``hk.set_state``) or an rng draw inside it is refused at the write
  itself: nothing written inside a converted function could come out of it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import haiku as hk
from haiku._src import base, stateful

import jaxoverride as jo
from jaxoverride import errors
from jaxoverride.adapter_kit import zeros_for
from jaxoverride_haiku._creation import init_safe_call
from jaxoverride_haiku._frames import Threaded, state_names, state_usable
from jaxoverride_haiku._rng import CheckedSequence
from jaxoverride_haiku._site import current_site, init_once


class PureFunctionWriteError(errors.PureFunctionWriteError):
    """A Haiku state write or rng draw inside a function that JAX makes pure.

    The Haiku case of ``jaxoverride.errors.PureFunctionWriteError``.

    Raised by ``closure_convert``, ``make_jaxpr``, ``lax.custom_root`` and
    ``lax.custom_linear_solve`` inside ``hk.transform``: nothing written or drawn inside
    the converted function could come out of it.

    Example:
      >>> import jax, jax.numpy as jnp, haiku as hk
      >>> import jaxoverride as jo, jaxoverride_haiku as joh
      >>> def f(x):
      ...     def g(v):
      ...         hk.set_state("n", jnp.ones(()))
      ...         return v
      ...     return jo.closure_convert(g, x)
      >>> with joh.context():
      ...     hk.transform_with_state(f).init(None, jnp.ones(2))
      Traceback (most recent call last):
      ...
      jaxoverride_haiku._convert.PureFunctionWriteError: jaxoverride.closure_convert: ...
    """


_CONVERTED = (
    "{where} turns the function into a pure jaxpr of its inputs, so nothing it writes or "
    "draws could come out, and the value would be silently lost or stale. Move the write or "
    "the draw out of the function that is converted (do it before or after the solver "
    "call), or pass the value in as an argument (optimistix's and diffrax's args, with the "
    "key drawn before the call); a solver with a non-implicit mode "
    "(jaxopt's implicit_diff=False) does not convert the function, but "
    "optimistix, lineax and diffrax (with its default adjoint) convert their callbacks, so "
    "there this is the only way."
)


def _refusal(where: str, what: str, why: tuple[str, str]) -> PureFunctionWriteError:
    inside, reason = why
    return PureFunctionWriteError(f"{where}: {what} inside {inside}. " + reason.format(where=where))


class _RefusingSequence(CheckedSequence):
    """An rng sequence that refuses every draw; loops may still carry its state."""

    def __init__(self, state: Any, where: str, why: tuple[str, str]):
        super().__init__(state)
        self._where = where
        self._why = why

    def _refuse(self, *_: Any) -> Any:
        raise _refusal(self._where, "an rng key was drawn (hk.next_rng_key)", self._why)

    __next__ = next = take = reserve = _refuse  # type: ignore[assignment]


@contextlib.contextmanager
def pure_frame(
    where: str, inside: str = "the function being converted", reason: str = _CONVERTED
) -> Iterator[None]:
    """Refuses state writes and rng draws in the current Haiku frame.

    ``inside`` names the function for the error, and ``reason`` says why nothing written
    there could come out and what to do instead (``{where}`` is filled in).
    """

    def refuse_write(next_setter: Any, value: Any, context: hk.SetterContext) -> Any:
        del next_setter, value
        raise _refusal(
            where, f"the Haiku state {context.full_name!r} was written", (inside, reason)
        )

    frame = base.current_frame()
    sequence = frame.rng_stack.peek()
    guard = (
        None
        if sequence is None
        else _RefusingSequence(sequence.internal_state, where, (inside, reason))
    )
    with hk.custom_setter(refuse_write), frame.rng_stack(guard):
        yield


def _converting(
    fun: Callable[..., Any],
    where: str,
    trace: Callable[[Callable[..., Any]], Any],
    creation: Callable[[], Any],
) -> Any:
    """At init the creation pass; then ``trace(traced)``, where ``traced`` runs ``fun`` in a
    temporary, write-refusing frame of the caller's state, entered inside JAX's trace."""

    def apply() -> Any:
        state = stateful.internal_state()
        thread = Threaded(1, where, check_params=False)

        site = current_site()

        def traced(*args: Any, **kwargs: Any) -> Any:
            with thread.frame(0, state) as inner, pure_frame(where):
                before = state_names(inner.state)
                out = fun(*args, **kwargs)
                if site is not None and state_names(inner.state) - before:
                    site.state_created = True  # lost in this frame: start again
                return out

        out = trace(traced)
        thread.finish()
        return out

    return init_once(apply, lambda: init_safe_call(creation, apply))


def closure_convert(fun: Callable[..., Any], *example_args: Any) -> Any:
    below = jo.next_impl("closure_convert")
    if not state_usable():
        return below(fun, *example_args)
    return _converting(
        fun,
        "jaxoverride.closure_convert",
        lambda traced: below(traced, *example_args),
        lambda: fun(*example_args),
    )


def make_jaxpr(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
    lower = jo.next_impl("make_jaxpr")
    plain = lower(fun, *args, **kwargs)

    def traced_jaxpr(*call_args: Any, **call_kwargs: Any) -> Any:
        if not state_usable():
            return plain(*call_args, **call_kwargs)
        return _converting(
            fun,
            "jaxoverride.make_jaxpr",
            lambda traced: lower(traced, *args, **kwargs)(*call_args, **call_kwargs),
            lambda: fun(*zeros_for(call_args), **zeros_for(call_kwargs)),
        )

    return traced_jaxpr


def custom_root(
    f: Callable[..., Any], initial_guess: Any, solve: Any, tangent_solve: Any, has_aux: bool = False
) -> Any:
    below = jo.next_impl("lax.custom_root")
    if not state_usable():
        return below(f, initial_guess, solve, tangent_solve, has_aux=has_aux)
    return _converting(
        f,
        "jaxoverride.lax.custom_root",
        lambda traced: below(traced, initial_guess, solve, tangent_solve, has_aux=has_aux),
        lambda: f(initial_guess),
    )


def custom_linear_solve(
    matvec: Callable[..., Any],
    b: Any,
    solve: Any,
    transpose_solve: Any = None,
    symmetric: bool = False,
    has_aux: bool = False,
) -> Any:
    below = jo.next_impl("lax.custom_linear_solve")
    options = {"symmetric": symmetric, "has_aux": has_aux}
    if not state_usable():
        return below(matvec, b, solve, transpose_solve, **options)
    return _converting(
        matvec,
        "jaxoverride.lax.custom_linear_solve",
        lambda traced: below(traced, b, solve, transpose_solve, **options),
        lambda: matvec(b),
    )
