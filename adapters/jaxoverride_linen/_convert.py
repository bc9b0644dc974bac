"""Closure conversion, ``make_jaxpr`` and JAX's custom solves inside bound Linen modules.

Each traces the user's function into a jaxpr whose inputs and outputs are fixed. So:

* at init, a creation pass first runs the function once outside every trace (the
  source's ``create``: variables are created once, under the names apply uses, and
  nothing else of the pass remains);
* the function is then traced against the caller's scopes: the variables it reads are
  values it closes over, which ``closure_convert`` hoists into explicit inputs when they
  are being differentiated or traced;
* a variable write or an rng draw inside it is refused at the write itself
  (``PureFunctionWriteError``): nothing written inside a converted function could come
  out of it. A neutral loop inside may still carry the state; what it leaves is put back.

JAX caches a conversion by the function's identity and its closed-over values: a
parameter read from the scope, changed since (or another tracer under ``jax.grad``),
would come back stale. Each call traces a fresh wrapper, which never hits that cache.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jaxoverride as jo
from jaxoverride.adapter_kit import init_safe, zeros_for
from jaxoverride_linen import _scope
from jaxoverride_linen._guards import discarding, pure

CONVERTED = (
    "{where} turns the function into a pure jaxpr of its inputs, so nothing it writes or "
    "draws could come out, and the value would be silently lost or stale. Move the write or "
    "the draw out of the function that is converted (do it before or after the solver "
    "call), or pass the value in as an argument (optimistix's and diffrax's args, with the "
    "key drawn before the call); a solver with a non-implicit mode (fpsolve's "
    "implicit=False, jaxopt's implicit_diff=False) does not convert the function, but "
    "optimistix, lineax and diffrax (with its default adjoint) convert their callbacks, so "
    "there this is the only way."
)


def pure_scope(
    source: Any, where: str, inside: str = "the function being converted", reason: str = CONVERTED
) -> contextlib.AbstractContextManager[None]:
    """Refuses writes and draws through the scopes of ``source`` (see ``_guards.pure``)."""
    return pure(source.roots, where, inside, reason)


def _converting(
    where: str,
    fun: Callable[..., Any],
    trace: Callable[[Callable[..., Any]], Any],
    creation: Callable[[], Any],
) -> Any:
    source = _scope.source(where)

    def traced(*args: Any, **kwargs: Any) -> Any:
        with pure_scope(source, where):
            return fun(*args, **kwargs)

    return init_safe(source, creation, lambda: trace(traced))


def closure_convert(fun: Callable[..., Any], *example_args: Any) -> Any:
    below = jo.next_impl("closure_convert")
    if not _scope.in_bound_module():
        return below(fun, *example_args)
    return _converting(
        "jaxoverride.closure_convert",
        fun,
        lambda traced: below(traced, *example_args),
        lambda: fun(*example_args),
    )


def make_jaxpr(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
    lower = jo.next_impl("make_jaxpr")
    plain = lower(fun, *args, **kwargs)

    def traced_jaxpr(*call_args: Any, **call_kwargs: Any) -> Any:
        if not _scope.in_bound_module():
            return plain(*call_args, **call_kwargs)
        return _converting(
            "jaxoverride.make_jaxpr",
            fun,
            lambda traced: lower(traced, *args, **kwargs)(*call_args, **call_kwargs),
            lambda: fun(*zeros_for(call_args), **zeros_for(call_kwargs)),
        )

    return traced_jaxpr


def custom_root(
    f: Callable[..., Any], initial_guess: Any, solve: Any, tangent_solve: Any, has_aux: bool = False
) -> Any:
    below = jo.next_impl("lax.custom_root")
    if not _scope.in_bound_module():
        return below(f, initial_guess, solve, tangent_solve, has_aux=has_aux)
    return _converting(
        "jaxoverride.lax.custom_root",
        f,
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
    if not _scope.in_bound_module():
        return below(matvec, b, solve, transpose_solve, **options)
    return _converting(
        "jaxoverride.lax.custom_linear_solve",
        matvec,
        lambda traced: below(traced, b, solve, transpose_solve, **options),
        lambda: matvec(b),
    )


def eval_shape(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``jax.eval_shape`` against the caller's scopes, threading nothing.

    Shapes need no state threaded: reads see the caller's variables (closed over), and
    writes, creations and draws inside are dropped, as ``jax.eval_shape`` drops side
    effects. Threading would draw a key from every rng stream, which a call inside a
    loop's condition (equinox checks its callbacks' shapes there) must not do. At init a
    creation pass first creates the variables the function uses.
    """
    lower = jo.next_impl("eval_shape")
    if not _scope.in_bound_module():
        return lower(fun, *args, **kwargs)
    where = "jaxoverride.eval_shape"
    source = _scope.source(where)

    def call() -> Any:
        with discarding(source.roots):
            return lower(lambda *a, **k: fun(*a, **k), *args, **kwargs)

    creation = lambda: fun(*zeros_for(args), **zeros_for(kwargs))
    return init_safe(source, creation, call)
