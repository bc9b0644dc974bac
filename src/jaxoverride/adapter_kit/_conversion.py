"""Overrides of the names that convert a function into a pure jaxpr, written once.

``closure_convert``, ``make_jaxpr``, ``lax.custom_root`` and ``lax.custom_linear_solve``
each trace a user's function into a jaxpr whose inputs and outputs are fixed. An adapter
differs only in how it runs that function (``converting``): in which frame or scope,
what it refuses inside, and what its creation pass at init does. The overrides around
it, with JAX's signatures, are the same for every adapter and live here.

Stability: semi-public, as the rest of the kit.

Example:
  >>> import jaxoverride as jo
  >>> from jaxoverride import adapter_kit as kit
  >>> seen = []
  >>> def converting(where, fun, trace, creation):
  ...     seen.append(where)
  ...     return trace(fun)
  >>> with jo.override_context(kit.conversion_overrides(lambda: True, converting)):
  ...     jaxpr = jo.make_jaxpr(lambda x: x + 1)(1.0)
  >>> seen
  ['jaxoverride.make_jaxpr']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jaxoverride as jo
from jaxoverride.adapter_kit._control_overrides import when_active
from jaxoverride.adapter_kit._declared_conversion import (
    declared_closure_convert,
    declared_custom_root,
    declared_linear_solve,
    declared_make_jaxpr,
)
from jaxoverride.adapter_kit._jax_arguments import jax_arguments
from jaxoverride.adapter_kit._operands import zeros_for
from jaxoverride.adapter_kit._solve_policy import Participant, participant
from jaxoverride.adapter_kit._state_threading import StateSource, init_safe

CONVERTED_WRITE_REASON = (
    "{where} turns the function into a pure jaxpr of its inputs, so nothing it writes or "
    "draws could come out, and the value would be silently lost or stale. Move the write or "
    "the draw out of the function that is converted (do it before or after the solver "
    "call), or pass the value in as an argument (optimistix's and diffrax's args, with the "
    "key drawn before the call); a solver with a non-implicit mode (fpsolve's "
    "implicit=False, jaxopt's implicit_diff=False) does not convert the function, but "
    "optimistix, lineax and diffrax (with its default adjoint) convert their callbacks"
)
"""The start of an adapter's refusal of a write or a draw in a converted function.

It says why, outside a declaration, nothing written there comes out and what to do
instead; ``{where}`` is the neutral name (``str.format``). The adapter ends it with how to
declare the state (``jaxoverride.solve_state``) in its framework's words.

Example:
  >>> from jaxoverride import adapter_kit as kit
  >>> kit.CONVERTED_WRITE_REASON.format(where="jaxoverride.closure_convert")[:56]
  'jaxoverride.closure_convert turns the function into a pu'
"""


def conversion_overrides(
    active: Callable[[], bool],
    converting: Callable[[str, Callable[..., Any], Callable[..., Any], Callable[[], Any]], Any],
    module: str | None = None,
    source: Callable[[str], StateSource | None] | None = None,
) -> dict[str, Callable[..., Any]]:
    """The overrides of the converting names, from an adapter's ``converting``.

    Args:
      active: whether the framework's state is usable here (else each override is the
        implementation below it, untouched).
      converting: ``converting(where, fun, trace, creation)`` runs ``trace(traced)``,
        where ``traced`` is ``fun`` as the framework runs it inside the conversion, and
        returns its result; at init it may first run the creation pass ``creation()``.
        ``where`` is the neutral name, for messages.
      module: the adapter's module, which call logs then name as the overrides'.
      source: ``source(where)``, the framework's ``StateSource``: inside a
        ``jaxoverride.solve_state`` that its framework takes part in, ``closure_convert``,
        ``make_jaxpr``, ``custom_root`` and ``custom_linear_solve`` run the function
        through it under the declaration (``_declared_conversion``) in place of
        ``converting``; where ``source(where)`` is None, that name stays
        ``converting``'s. None: always ``converting``.

    Returns:
      ``{"closure_convert": ..., "make_jaxpr": ..., "lax.custom_root": ...,
      "lax.custom_linear_solve": ...}``, each taking the arguments of JAX's function.
      ``make_jaxpr``'s creation pass calls the function on zeros for every
      ``ShapeDtypeStruct`` argument; ``custom_root``'s on ``f(initial_guess)``;
      ``custom_linear_solve``'s on ``matvec(b)``.

    Example:
      >>> from jaxoverride import adapter_kit as kit
      >>> table = kit.conversion_overrides(lambda: False, None)
      >>> sorted(table)
      ['closure_convert', 'lax.custom_linear_solve', 'lax.custom_root', 'make_jaxpr']
    """

    def run(
        where: str,
        fun: Callable[..., Any],
        creation: Callable[[], Any],
        trace: Callable[[Callable[..., Any]], Any],
        declared_call: Callable[[str, StateSource, Participant], Any],
    ) -> Any:
        """``converting``'s run, or, inside a declaration the framework takes part in,
        ``declared_call(where, source, policy)`` (after the creation pass at init)."""
        current = None if source is None else source(where)
        policy = None if current is None else participant(current)
        if current is None or policy is None:
            return converting(where, fun, trace, creation)
        return init_safe(current, creation, lambda: declared_call(where, current, policy))

    def closure_convert(
        below: Callable[..., Any], fun: Callable[..., Any], *example_args: Any
    ) -> Any:
        return run(
            "jaxoverride.closure_convert",
            fun,
            lambda: fun(*example_args),
            lambda traced: below(traced, *example_args),
            lambda w, s, p: declared_closure_convert(w, s, p, below, fun, example_args),
        )

    def make_jaxpr(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
        below = jo.next_impl("make_jaxpr")
        plain = below(fun, *args, **kwargs)

        def traced_jaxpr(*call_args: Any, **call_kwargs: Any) -> Any:
            if not active():
                return plain(*call_args, **call_kwargs)
            # The declared function reads the source's state when it is made: at init that
            # is after the creation pass, inside the call (as closure_convert's).
            trace = lambda traced: below(traced, *args, **kwargs)(*call_args, **call_kwargs)
            return run(
                "jaxoverride.make_jaxpr",
                fun,
                lambda: fun(*zeros_for(call_args), **zeros_for(call_kwargs)),
                trace,
                lambda w, s, p: trace(declared_make_jaxpr(w, s, p, fun)),
            )

        return traced_jaxpr

    def custom_root(below: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        f, guess, solve, tangent_solve, has_aux = jax_arguments("lax.custom_root", *args, **kwargs)
        return run(
            "jaxoverride.lax.custom_root",
            f,
            lambda: f(guess),
            lambda traced: below(traced, guess, solve, tangent_solve, has_aux=has_aux),
            lambda w, s, p: declared_custom_root(
                w, s, p, below, f, guess, solve, tangent_solve, has_aux
            ),
        )

    def custom_linear_solve(below: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        matvec, b, solve, transpose_solve, symmetric, has_aux = jax_arguments(
            "lax.custom_linear_solve", *args, **kwargs
        )
        options = {"symmetric": symmetric, "has_aux": has_aux}
        rest = (b, solve, transpose_solve)
        return run(
            "jaxoverride.lax.custom_linear_solve",
            matvec,
            lambda: matvec(b),
            lambda traced: below(traced, *rest, **options),
            lambda w, s, p: declared_linear_solve(w, s, p, below, matvec, *rest, **options),
        )

    overrides: dict[str, Callable[..., Any]] = {
        "closure_convert": when_active("closure_convert", active, closure_convert),
        "make_jaxpr": make_jaxpr,
        "lax.custom_root": when_active("lax.custom_root", active, custom_root),
        "lax.custom_linear_solve": when_active(
            "lax.custom_linear_solve", active, custom_linear_solve
        ),
    }
    if module is not None:
        for override in overrides.values():
            override.__module__ = module
    return overrides
