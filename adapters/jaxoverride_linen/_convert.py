"""Closure conversion, ``make_jaxpr`` and JAX's custom solves inside bound Linen modules.

Each traces the user's function into a jaxpr with fixed inputs and outputs: at init a
creation pass first makes the variables; a write or draw inside is refused
(``PureFunctionWriteError``), since it could not come out. Under ``jaxoverride.solve_state``
frozen streams draw the solve's key, and kept collections come out of the converted
function (``kit.declared_closure_convert``) or the jaxpr (``kit.declared_make_jaxpr``).
Each call traces a fresh wrapper: JAX's conversion cache, keyed by identity and closed-over
values, would hand back a stale parameter.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import jaxoverride as jo
from jaxoverride import adapter_kit as kit
from jaxoverride.adapter_kit import init_safe, traced_arguments, zeros_for
from jaxoverride_linen import _declared, _source
from jaxoverride_linen._declared import SOLVE_STATE_FIX
from jaxoverride_linen._guards import hidden_rngs, pure

CONVERTED = (
    kit.CONVERTED_WRITE_REASON
    + ", so there this is the only way without a declaration. "
    + SOLVE_STATE_FIX
)


CONVERTED_DECLARED = (
    "{where} turns the function into a jaxpr whose outputs are fixed, so a write inside "
    "it cannot come out, even under jaxoverride.solve_state: the declaration keeps this "
    "collection at the solution, and dropping the write would leave it silently at its "
    "entry value (an rng draw is fine there: it draws the solve's one key). A map "
    "converted by jaxoverride.closure_convert (fpsolve's implicit mode) or by "
    "jaxoverride.make_jaxpr (optimistix, diffrax's default adjoint, equinox's "
    "filter_closure_convert) writes it; in a custom_root or custom_linear_solve, update "
    "the collection outside the solve (call the layer once at the solution, after the "
    "solver returns), or use the solver's non-implicit mode."
)


def pure_scope(
    source: Any,
    where: str,
    inside: str = "the function being converted",
    reason: str = CONVERTED,
    allowed: frozenset[tuple[str, str]] = _declared.NO_DECLARATION,
) -> contextlib.AbstractContextManager[None]:
    """Refuses writes and draws through the scopes of ``source`` (see ``_guards.pure``),
    but for the ``allowed`` streams and collections (a ``solve_state`` freezes them)."""
    return pure(source.roots, where, inside, reason, allowed=allowed)


def _converting(
    where: str,
    fun: Callable[..., Any],
    trace: Callable[[Callable[..., Any]], Any],
    creation: Callable[[], Any],
) -> Any:
    source = _source.source(where)
    policy = _source.declaration()
    if where == "jaxoverride.make_jaxpr" and _declared.frozen_collections_any(policy):
        # Kept collections: run through the source, written out of the jaxpr at each
        # evaluation (``kit.declared_make_jaxpr``).
        assert policy is not None
        declared = kit.declared_make_jaxpr(where, source, policy, fun)

        def written_out(*args: Any, **kwargs: Any) -> Any:
            with _declared.evaluating(policy, source.roots):
                return declared(*args, **kwargs)

        return init_safe(source, creation, lambda: trace(written_out))
    # Draws of the streams frozen: the solve's key; writes cannot come out (see above).
    allowed = frozenset(a for a in _declared.allowed(policy) if a[0] == "rng")
    reason = CONVERTED_DECLARED if _declared.frozen_collections_any(policy) else CONVERTED

    def traced(*args: Any, **kwargs: Any) -> Any:
        evaluation = _declared.evaluating(policy, source.roots, install=True)
        guard = pure_scope(source, where, reason=reason, allowed=allowed)
        with guard, evaluation:
            return fun(*args, **kwargs)

    return init_safe(source, creation, lambda: trace(traced))


CONVERSIONS: dict[str, Callable[..., Any]] = kit.conversion_overrides(
    _source.in_bound_module, _converting, module=__name__
)
"""Neutral name -> Linen override, for the names that convert a function into a jaxpr."""

_converting_closure = CONVERSIONS["closure_convert"]


def closure_convert(fun: Callable[..., Any], *example_args: Any) -> Any:
    """``jax.closure_convert`` inside bound Linen modules (``_converting``); under a
    ``jaxoverride.solve_state`` keeping collections at the solution, the kit's
    ``declared_closure_convert``: each evaluation keeps what ``fun`` wrote to them."""
    policy = _source.declaration() if _source.in_bound_module() else None
    if not _declared.frozen_collections_any(policy):
        return _converting_closure(fun, *example_args)
    assert policy is not None
    lower = jo.next_impl("closure_convert")
    where = "jaxoverride.closure_convert"
    source = _source.source(where)
    allowed = _declared.allowed(policy)

    @functools.wraps(fun)
    def guarded(*args: Any) -> Any:
        inside = "the function being converted"
        with pure(source.roots, where, inside, CONVERTED, allowed=allowed, keep_allowed=True):
            return fun(*args)

    def call() -> Any:
        with hidden_rngs(source.roots):
            return kit.declared_closure_convert(where, source, policy, lower, guarded, example_args)

    return init_safe(source, lambda: fun(*example_args), call)


closure_convert.__module__ = __name__
CONVERSIONS["closure_convert"] = closure_convert


def eval_shape(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``jax.eval_shape`` against the caller's scopes, threading nothing: writes and
    draws inside are dropped (threading would draw a key, which a call inside a loop's
    condition must not do). At init a creation pass first creates the variables."""
    below = jo.next_impl("eval_shape")
    if not _source.in_bound_module():
        return below(fun, *args, **kwargs)
    where = "jaxoverride.eval_shape"
    source = _source.source(where)

    def call() -> Any:
        # Under ``jaxoverride.solve_state`` a boundary of its own, its last state dropped.
        policy = _source.declaration()

        def traced(*a: Any, **k: Any) -> Any:
            with contextlib.nullcontext() if policy is None else policy.discarded():
                return fun(*a, **k)

        with _source.discarding(source.roots):
            return below(traced, *args, **kwargs)

    creation = lambda: fun(*traced_arguments(zeros_for(args)), **zeros_for(kwargs))
    return init_safe(source, creation, call)
