"""Conversion to pure functions under ``track``: ``closure_convert``, ``make_jaxpr``,
``lax.custom_root`` and ``lax.custom_linear_solve``.

Each turns the user's function into a jaxpr of its inputs: tracked Variables are *read*
at the traced level (JAX hoists what the function closes over into explicit inputs; so
does Equinox's ``filter_closure_convert``, so gradients reach the module), and a *write*
could never come out, so it is refused with ``PureFunctionWriteError``, every Variable
left as it was. JAX caches such traces by the function's identity, closed-over values
included, so each call converts a fresh function.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from flax.errors import TraceContextError

import jaxoverride as jo
from jaxoverride import adapter_kit as kit
from jaxoverride_nnx._errors import LevelError, written_variable
from jaxoverride_nnx._graph import RAW
from jaxoverride_nnx._lift import changed, run_lifted, write_back
from jaxoverride_nnx._probes import check_given
from jaxoverride_nnx._rules import PureFunctionWriteError, write_refused
from jaxoverride_nnx._solve import discarded, policy_for, stateful
from jaxoverride_nnx._stale_reads import own_jit_trace
from jaxoverride_nnx._tracked import Tracked, current

WHERE = "jaxoverride.make_jaxpr"


_WHAT = "the function being traced into a jaxpr"
_WHY = (
    "A jaxpr has fixed outputs, and code that closure-converts a callback (Equinox's "
    "filter_closure_convert in optimistix, lineax and diffrax) evaluates it inside its own "
    "primitives and custom derivative rules"
)
_WHY_ELSEWHERE = (
    "Its jaxpr was evaluated where those Variables are not tracked (outside the "
    "jaxoverride_nnx.track they were converted in)"
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
        policy = policy_for(tracked)
        if policy is not None:
            declared = own_jit_trace(_written_out(tracked, policy, fun))
            return below(declared, *args, **kwargs)(*call_args, **call_kwargs)
        pure = _pure(tracked, fun, _WHAT, WHERE, why=_WHY, fix=_FIX)

        @own_jit_trace  # its constants are read afresh at each call: not stale
        @functools.wraps(fun)
        def fresh(*inner_args: Any, **inner_kwargs: Any) -> Any:
            try:
                return pure(*inner_args, **inner_kwargs)
            except TraceContextError as error:  # a write to a Variable that is not lifted
                raise _refuse_write_error(error) from error

        return below(fresh, *args, **kwargs)(*call_args, **call_kwargs)

    return call


def _written_out(tracked: Tracked, policy: kit.Participant, fun: Callable[..., Any]) -> Any:
    """``fun`` to trace into a jaxpr under ``jaxoverride.solve_state``: what it writes is
    handed out at each evaluation (``kit.write_out``), as a direct call would write it
    there; a write to a Variable the declaration does not freeze is refused."""
    count = len(tracked.variables)

    indices: list[int] = []

    def given() -> None:
        # A Variable the map writes that the evaluation's boundary was not given (a probe)
        # retraces that boundary with it, before the evaluation stages anything.
        check_given([RAW.__get__(tracked.variables[i]) for i in indices])

    @functools.wraps(fun)
    def traced(*args: Any, **kwargs: Any) -> Any:
        kit.ahead_of_evaluation(policy, given, WHERE)
        before = list(map(RAW.__get__, tracked.variables))
        try:
            out, after = run_lifted(tracked, None, fun, args, kwargs, WHERE, policy=policy)
        except TraceContextError as error:  # a write to a Variable that is not lifted
            raise _refuse_write_error(error) from error
        written = changed(before, after[:count])
        frozen = policy.frozen
        unfrozen = {i: v for i, v in written.items() if (id(tracked.variables[i]), 0) not in frozen}
        if unfrozen:
            raise write_refused(tracked, unfrozen, _WHAT, _WHY, _FIX, WHERE)
        indices[:] = sorted(written)
        leaves, treedef = jax.tree.flatten(written)

        def write(values: list[Any]) -> None:
            # as a direct call of ``fun`` there writes: the boundary threads it out
            here = current() or tracked
            position = {id(v): i for i, v in enumerate(here.variables)}
            updates = jax.tree.unflatten(treedef, values)
            if missing := {
                i: v for i, v in updates.items() if id(tracked.variables[i]) not in position
            }:
                raise write_refused(tracked, missing, _WHAT, _WHY_ELSEWHERE, _FIX, WHERE)
            moved = {position[id(tracked.variables[i])]: v for i, v in updates.items()}
            write_back(here, moved, WHERE)

        kit.write_out(policy, leaves, write, WHERE)
        return out

    return traced


def closure_convert(fun: Callable[..., Any], *example_args: Any) -> Any:
    below = jo.next_impl("closure_convert")
    tracked = current()
    if tracked is None:
        return below(fun, *example_args)
    if policy_for(tracked) is not None:
        return _declared_convert(below, tracked, fun, example_args)
    # JAX caches a conversion by the function's identity and argument types, constants
    # included: a tracked module's weights, changed since, would come back stale (and,
    # under jo.grad, unperturbed: a silently zero gradient). A new function per call
    # never hits that cache.
    fresh = lambda *args: fun(*args)
    try:
        return below(fresh, *example_args)
    except (LevelError, TraceContextError) as error:
        variable = written_variable(error) or "a tracked NNX Variable"
        rng = " (drawing a key from nnx.Rngs writes its count)" if "RngCount" in variable else ""
        raise PureFunctionWriteError(
            f"jaxoverride.closure_convert: {variable} was written inside the function being "
            f"converted{rng}. Closure conversion "
            "turns it into a pure jaxpr of its inputs, so the write could never come out. "
            "Move the write out of the converted function (before or after the solver call); "
            "for randomness, draw the key before the call and pass it in through the "
            "solver's arguments (optimistix's and diffrax's args), using jax.random with it "
            "inside; or declare what the solver's evaluations see, with "
            "`with jaxoverride.solve_state(): ...` around the solver call (one key per "
            "solve, the state at the solution); or use the solver's non-implicit mode, if "
            "it has one (fpsolve's implicit=False, jaxopt's implicit_diff=False). "
            f"NNX said: {error}"
        ) from error


def _declared_convert(
    below: Callable[..., Any],
    tracked: Tracked,
    fun: Callable[..., Any],
    example_args: tuple[Any, ...],
) -> Any:
    """``closure_convert`` under ``jaxoverride.solve_state``: the tracked state (all but
    the Params, which JAX hoists) is an explicit input of the jaxpr, read where the
    converted function is called, and what ``fun`` writes an output written there, so
    the boundaries around those calls apply the declaration and nothing goes stale."""
    where = "jaxoverride.closure_convert"
    state = stateful(tracked)
    written: list[tuple[int, ...]] = []

    @own_jit_trace  # a fresh function per call: its reads are not stale
    def lifted(*args: Any) -> Any:
        *user, given = args
        values = tracked.read()
        for index, value in zip(state, given, strict=True):
            values[index] = value
        out, after = run_lifted(tracked, values, fun, user, {}, where)
        indices = tuple(i for i in state if after[i] is not values[i])
        written.append(indices)
        return out, [after[i] for i in indices]

    now = tracked.read()
    pure, constants = below(lifted, *example_args, [now[i] for i in state])
    indices = written[-1]
    count = len(example_args)

    def converted(*args: Any) -> Any:
        here = current() or tracked
        values = [RAW.__get__(here.variables[i]) for i in state]
        check_given(values)  # a probe of an enclosing call: that call threads it
        out, after = pure(*args[:count], values, *args[count:])
        write_back(here, dict(zip(indices, after, strict=True)), where)
        return out

    return functools.wraps(fun)(converted), constants


# -- lax.custom_root and lax.custom_linear_solve ---------------------------------------


def _pure(
    tracked: Any,
    fn: Callable[..., Any] | None,
    role: str,
    where: str,
    why: str = "JAX traces it into a pure jaxpr of its inputs",
    fix: str = "Move the write out of the solve (before or after the call), or use the "
    "library's non-implicit mode (jaxopt's implicit_diff=False).",
    jitted: bool = False,
) -> Any:
    """``fn`` run with the tracked Variables readable and any write refused.

    JAX hoists what it closes over into explicit inputs, so reads come out right; the
    caller hands a fresh wrapper per call past JAX's trace cache (which would keep old
    weights), and where JAX traces it through ``jax.jit`` (``jitted``: ``custom_root``
    from JAX 0.12) that trace is marked as the adapter's own (reads are current).
    """
    if fn is None or not callable(fn):
        return fn  # JAX's own error for JAX's misuse, as with nothing active

    def pure(*args: Any, **kwargs: Any) -> Any:
        with discarded(policy_for(tracked)):
            out, after = run_lifted(tracked, None, fn, args, kwargs, where)
        if written := changed(tracked.read(), after):
            raise write_refused(tracked, written, role, why, fix, where)
        return out

    return own_jit_trace(pure) if jitted else pure


def custom_root(*args: Any, **kwargs: Any) -> Any:
    below = jo.next_impl("lax.custom_root")
    tracked = current()
    if tracked is None:
        return below(*args, **kwargs)
    f, initial_guess, solve, tangent_solve, has_aux = kit.jax_arguments(
        "lax.custom_root", *args, **kwargs
    )
    where = "jaxoverride.lax.custom_root"
    return below(
        _pure(tracked, f, "f (the function whose root is found)", where, jitted=True),
        initial_guess,
        _pure(tracked, solve, "solve", where, jitted=True),
        _pure(tracked, tangent_solve, "tangent_solve", where, jitted=True),
        has_aux=has_aux,
    )


def custom_linear_solve(*args: Any, **kwargs: Any) -> Any:
    below = jo.next_impl("lax.custom_linear_solve")
    tracked = current()
    if tracked is None:
        return below(*args, **kwargs)
    matvec, b, solve, transpose_solve, symmetric, has_aux = kit.jax_arguments(
        "lax.custom_linear_solve", *args, **kwargs
    )
    where = "jaxoverride.lax.custom_linear_solve"
    return below(
        _pure(tracked, matvec, "matvec", where),
        b,
        _pure(tracked, solve, "solve", where),
        _pure(tracked, transpose_solve, "transpose_solve", where),
        symmetric=symmetric,
        has_aux=has_aux,
    )
