"""Closure conversion, ``make_jaxpr`` and JAX's custom solves inside ``hk.transform``.

Each traces the user's function into a jaxpr with fixed inputs and outputs: at init once,
a parameter it creates made at the call's site (``_site``); it runs in a temporary frame of
the caller's params, state and rng, and a state write or rng draw inside is refused, since
it could not come out. Under ``jaxoverride.solve_state`` all four run through
``HaikuSource`` (the kit's declared conversions): writes to the frozen parts come out, so
a solve ends with its last forward evaluation's state (BatchNorm statistics at the
solution); a write to a part left per evaluation is refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import haiku as hk
from haiku._src import base, stateful

from jaxoverride import adapter_kit as kit, errors
from jaxoverride.adapter_kit import Participant
from jaxoverride_haiku._creation import init_safe_call
from jaxoverride_haiku._frames import Threaded, state_names, state_usable
from jaxoverride_haiku._rng import REFUSAL, RefusingSequence, placeholder_state
from jaxoverride_haiku._site import current_site, init_once
from jaxoverride_haiku._source import HaikuSource


class PureFunctionWriteError(errors.PureFunctionWriteError):
    """A Haiku state write or rng draw inside a function that JAX makes pure.

    The Haiku case of ``jaxoverride.errors.PureFunctionWriteError``, raised by
    ``closure_convert``, ``make_jaxpr`` and the custom solves inside ``hk.transform``:
    nothing written or drawn inside the converted function could come out of it.

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


_CONVERTED = kit.CONVERTED_WRITE_REASON + ". {declare}"

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
) -> Iterator[None]:
    """Refuses state writes and rng draws in the current Haiku frame (``inside`` names the
    function, ``reason`` why and the fix). Under ``policy`` (a backward pass's
    ``jaxoverride.solve_state``) draws and writes of what it freezes pass (writes dropped)."""

    def refuse_write(next_setter: Any, value: Any, context: hk.SetterContext) -> Any:
        module = context.module_name
        if policy is not None and policy.freezes("state", (module, f"{module}/{context.name}")):
            return next_setter(value)
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


def _converting(
    where: str,
    fun: Callable[..., Any],
    trace: Callable[[Callable[..., Any]], Any],
    creation: Callable[[], Any],
) -> Any:
    """``trace(traced)``, ``traced`` running ``fun`` in a temporary, write-refusing frame of
    the caller's state (at init a creation pass first where needed)."""

    def apply() -> Any:
        thread = Threaded(1, where, check_params=False)
        site = current_site()

        def traced(*args: Any, **kwargs: Any) -> Any:
            with thread.frame(0, stateful.internal_state()) as inner, pure_frame(where):
                before = state_names(inner.state)
                out = fun(*args, **kwargs)
                if site is not None and state_names(inner.state) - before:
                    site.state_created = True  # lost in this frame: start again
                return out

        out = trace(traced)
        thread.finish()
        return out

    return init_once(apply, lambda: init_safe_call(creation, apply))


CONVERSIONS: dict[str, Callable[..., Any]] = kit.conversion_overrides(
    state_usable, _converting, module=__name__, source=HaikuSource
)
"""Neutral name -> Haiku override, for the names that convert a function into a jaxpr."""
