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
from typing import Any, NoReturn

import haiku as hk
from haiku._src import base

from jaxoverride import adapter_kit as kit, errors
from jaxoverride.adapter_kit import Participant
from jaxoverride_haiku._creation import init_safe_call
from jaxoverride_haiku._frames import (
    InternalState,
    Threaded,
    policy_state,
    solve_policy,
    state_names,
    state_usable,
)
from jaxoverride_haiku._rng import (
    REFUSAL,
    CountingSequence,
    RefusingSequence,
    placeholder_state,
    replayed,
)
from jaxoverride_haiku._site import current_site, init_once
from jaxoverride_haiku._source import HaikuSource


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
      jaxoverride_haiku.PureFunctionWriteError: jaxoverride.closure_convert: ...
    """


_CONVERTED = (
    "{where} turns the function into a pure jaxpr of its inputs, so nothing it writes or "
    "draws could come out, and the value would be silently lost or stale. Move the write or "
    "the draw out of the function that is converted (do it before or after the solver "
    "call), or pass the value in as an argument (optimistix's and diffrax's args, with the "
    "key drawn before the call); a solver with a non-implicit mode (fpsolve's "
    "implicit=False, jaxopt's implicit_diff=False) does not convert the function, but "
    "optimistix, lineax and diffrax (with its default adjoint) convert their callbacks. "
    + "{declare}"
)

DECLARE = (
    "Or declare what the solver's evaluations see: `with jaxoverride.solve_state(): ...` "
    "around the solver call (rng='per_solve': every evaluation draws the keys of the "
    "solve's entry; state='at_solution': every evaluation starts from the entry's state, "
    "and a backward pass's writes are dropped)."
)


def _refusal(where: str, what: str, why: tuple[str, str]) -> PureFunctionWriteError:
    inside, reason = why
    text = reason.format(where=where, declare=DECLARE)
    if "{declare}" not in reason:
        text += " " + DECLARE
    return PureFunctionWriteError(f"{where}: {what} inside {inside}. {text}")


@contextlib.contextmanager
def pure_frame(
    where: str,
    inside: str = "the function being converted",
    reason: str = _CONVERTED,
    policy: Participant | None = None,
    writes_dropped: bool = False,
) -> Iterator[None]:
    """Refuses state writes and rng draws in the current Haiku frame.

    ``inside`` names the function for the error, and ``reason`` says why nothing written
    there could come out and what to do instead (``{where}`` is filled in). ``policy``:
    the ``jaxoverride.solve_state`` declaration in force, whose frozen rng and state are
    allowed (the frame holds the entry's): draws, and writes where ``writes_dropped``
    (a backward pass's writes are dropped; a converted function's would be lost).
    """

    def refuse_write(next_setter: Any, value: Any, context: hk.SetterContext) -> Any:
        module = context.module_name
        frozen = policy is not None and policy.freezes(
            "state", (module, f"{module}/{context.name}")
        )
        if frozen and writes_dropped:
            return next_setter(value)
        if frozen:
            raise PureFunctionWriteError(
                f"{where}: the Haiku state {context.full_name!r} was written inside "
                f"{inside}, under jaxoverride.solve_state. {where} turns the function "
                "into a pure jaxpr, so nothing it writes can come out, and the solve "
                "could not keep the state at its solution (state='at_solution'): the "
                "statistics would silently stay as they were. Update the state once "
                "outside the solver (after it, at its result), or use a solver that "
                "converts the map with jax.closure_convert (fpsolve: the converted "
                "function hands its writes out) or evaluates it itself in its forward "
                "pass (fpsolve's implicit=False, jaxopt's FixedPointIteration)."
            )
        raise _refusal(
            where, f"the Haiku state {context.full_name!r} was written", (inside, reason)
        )

    def refuse_draw() -> NoReturn:
        raise _refusal(where, "an rng key was drawn (hk.next_rng_key)", (inside, reason))

    frame = base.current_frame()
    if policy is not None and policy.freezes("rng", ()):
        with hk.custom_setter(refuse_write):
            yield
        return
    sequence = frame.rng_stack.peek()
    guard = (
        None
        if sequence is None
        else RefusingSequence(placeholder_state(sequence.internal_state), refuse_draw)
    )
    token = REFUSAL.set(refuse_draw)
    try:
        with hk.custom_setter(refuse_write), frame.rng_stack(guard):
            yield
    finally:
        REFUSAL.reset(token)


_ADVANCE = "jaxoverride_haiku: draws in a converted function"


def _advanced(policy: Participant, left: InternalState, calls: list[int | None]) -> Any:
    """``left`` with the rng stream the entry's after the draws ``calls``."""
    entry = policy.freeze(left)
    return left if entry.rng is None else left._replace(rng=replayed(entry.rng, calls))


def _converting(
    where: str,
    fun: Callable[..., Any],
    trace: Callable[[Callable[..., Any]], Any],
    creation: Callable[[], Any],
) -> Any:
    """At init the creation pass; then ``trace(traced)``, where ``traced`` runs ``fun`` in a
    temporary, write-refusing frame of the caller's state, entered inside JAX's trace."""

    def apply() -> Any:
        # Under ``jaxoverride.solve_state`` the function sees the frozen state, and may
        # draw and write what the declaration freezes (nothing comes out: dropped).
        policy = solve_policy()
        state = policy_state(policy)
        thread = Threaded(1, where, check_params=False)

        site = current_site()

        draws: list[list[int | None]] = []

        def traced(*args: Any, **kwargs: Any) -> Any:
            # Nothing comes out of the jaxpr: under a declaration, what the JAX calls
            # inside leave is dropped with its boundary (``Participant.discarded``).
            dropped = contextlib.nullcontext() if policy is None else policy.discarded()
            with dropped, thread.frame(0, state) as inner, pure_frame(where, policy=policy):
                before = state_names(inner.state)
                sequence = inner.rng_stack.peek()
                if policy is None or sequence is None or REFUSAL.get() is not None:
                    out = fun(*args, **kwargs)
                else:
                    counting = CountingSequence(sequence.internal_state)
                    with inner.rng_stack(counting):
                        out = fun(*args, **kwargs)
                    draws.append(counting.calls)
                if site is not None and state_names(inner.state) - before:
                    site.state_created = True  # lost in this frame: start again
                return out

        out = trace(traced)
        thread.finish()
        if policy is not None and draws and draws[-1] and state.rng is not None:
            # The function drew the entry's keys, and nothing it drew comes out of the
            # jaxpr: at the declaration's exit the stream has advanced as if the map had
            # been called once, so the next draw after the solve never gets its keys.
            calls = draws[-1]
            policy.at_exit(_ADVANCE, lambda left: _advanced(policy, left, calls))
        return out

    return init_once(apply, lambda: init_safe_call(creation, apply))


def _declared_source(where: str) -> HaikuSource | None:
    """The source the kit's declared conversions run the function through; None for
    ``make_jaxpr``, which stays ``_converting``'s under a declaration: its draws see the
    entry's keys and advance the stream at the exit, and a write is refused (the kit's
    write-out path does not create Haiku's parameters at init yet)."""
    return None if where == "jaxoverride.make_jaxpr" else HaikuSource(where)


CONVERSIONS: dict[str, Callable[..., Any]] = kit.conversion_overrides(
    state_usable, _converting, module=__name__, source=_declared_source
)
"""Neutral name -> Haiku override, for the names that convert a function into a jaxpr."""
