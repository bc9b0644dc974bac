"""Haiku: ``jaxoverride.solve_state`` around a solver whose map draws dropout and writes a
running mean (issue 29).

Under the declaration every evaluation of the map draws the solve's entry keys (one mask
per solve, a new one on the next call) and starts from the entry's state; where the
evaluations run through neutral loops, jits and rules (the non-implicit solvers, jaxopt)
the running mean ends as one EMA update at the solution, also where the solver converts
the map (fpsolve ``implicit=True``: the converted function hands its writes out; a map
converted by ``make_jaxpr``, as optimistix and diffrax convert it, hands them out of its
jaxpr at each evaluation, BatchNorm statistics and counters included). Inside
a backward rule's re-evaluation (jaxopt ``implicit_diff=True``) a draw sees the entry's
keys, never another draw's; outside a declaration it is refused, and the refusal names
the declaration.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import haiku as hk
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import jaxoverride as jo
import jaxoverride_haiku as joh
from _libraries import FreshScript, interposed
from _parity import program_text
from _solve_state_solvers import (
    fpsolve_run,
    jaxopt_converted_run,
    jaxopt_run,
    masks_seen,
    record,
)
from jaxoverride import errors

MOMENTUM = 0.9
KEEP = 0.8
X = jnp.linspace(-1.0, 1.0, 3)
Runner = Callable[..., tuple[Any, Any]]

THREADED: dict[str, Runner] = {
    "fpsolve-forward": fpsolve_run("forward", False),
    "fpsolve-anderson": fpsolve_run("anderson", False),
    "fpsolve-newton": fpsolve_run("newton", False),
    "jaxopt-unrolled": jaxopt_run(False),
    "jaxopt-implicit": jaxopt_run(True),
    "fpsolve-forward-implicit": fpsolve_run("forward", True),
    "fpsolve-anderson-implicit": fpsolve_run("anderson", True),
    "fpsolve-newton-implicit": fpsolve_run("newton", True),
}
CONVERTED: dict[str, Runner] = {
    f"fpsolve-{method}-implicit": fpsolve_run(method, True)
    for method in ("forward", "anderson", "newton")
}


def _dropout(key: jax.Array, shape: tuple[int, ...], after: bool = False) -> jax.Array:
    """A dropout mask; records the key it was drawn with (a mask of 3 may repeat), tagged
    ``after`` for the draw after the solve (a backward pass records after it)."""
    data = jax.random.key_data(key)
    record(jnp.concatenate([data, data]) if after else data)
    return jax.random.bernoulli(key, KEEP, shape)


def _split(seen: list[bytes]) -> tuple[list[bytes], list[bytes]]:
    """The keys drawn in the map, and the key the draw after the solve got."""
    solve = [s for s in seen if len(s) == 8]
    return solve, [s[:8] for s in seen if len(s) == 16]


def _forward(
    x: jax.Array, run: Runner, declare: bool, fixed: bool = False, stats: bool = True
) -> Any:
    """A DEQ layer: dropout and a running mean in the map; then one more draw.

    ``fixed``: the explicit twin (mask drawn before the solve, the mean updated once
    after it, at z*)."""
    layer = hk.Linear(3, w_init=hk.initializers.RandomNormal(0.3))
    fixed_mask = _dropout(hk.next_rng_key(), x.shape) if fixed else None

    def f(z: jax.Array) -> jax.Array:
        mask = _dropout(hk.next_rng_key(), z.shape) if fixed_mask is None else fixed_mask
        if stats and not fixed:
            mean = hk.get_state("mean", z.shape, init=jnp.zeros)
            hk.set_state("mean", MOMENTUM * mean + (1 - MOMENTUM) * z)
        return jnp.tanh(layer(jnp.where(mask, z, 0.0)) + 0.3)

    if declare:
        with jo.solve_state():
            z, steps = run(f, x)
    else:
        z, steps = run(f, x)
    if fixed and stats:
        mean = hk.get_state("mean", z.shape, init=jnp.zeros)
        hk.set_state("mean", MOMENTUM * mean + (1 - MOMENTUM) * z)
    _dropout(hk.next_rng_key(), x.shape, after=True)
    return z, steps


def _model(
    run: Runner, declare: bool = True, fixed: bool = False, stats: bool = True
) -> hk.TransformedWithState:
    forward = functools.partial(_forward, run=run, declare=declare, fixed=fixed, stats=stats)
    return hk.transform_with_state(forward)


@pytest.fixture(autouse=True)
def _context():
    with joh.context(), interposed("jaxopt"), jax.checking_leaks():
        yield


def initialised(model: hk.TransformedWithState) -> tuple[Any, Any]:
    """``model.init``'s params and state, the params set to the same values for a model
    and its twin (whose init draws the mask first, so its initialisers draw other keys)."""
    params, state = model.init(jax.random.key(0), X)
    params = jax.tree.map(
        lambda w: (
            jnp.full_like(w, 0.3) * jnp.eye(*w.shape[-2:]) - 0.1
            if w.ndim == 2
            else jnp.full_like(w, 0.05)
        ),
        params,
    )
    return params, state


def _apply(model: hk.TransformedWithState, how: str, seed: int = 1) -> tuple[Any, list[bytes]]:
    params, state = initialised(model)
    apply = jax.jit(model.apply) if how == "jit" else model.apply
    with masks_seen() as seen:
        out = apply(params, state, jax.random.key(seed), X)
    return out, seen


@pytest.mark.parametrize("how", ["eager", "jit"])
@pytest.mark.parametrize("name", list(THREADED))
def test_one_mask_per_solve_and_statistics_at_the_solution(name: str, how: str) -> None:
    run = THREADED[name]
    ((z, steps), state), seen = _apply(_model(run), how)
    solve, after = _split(seen)
    assert len(set(solve)) == 1, f"{len(set(solve))} masks in one solve"
    assert after and not set(after) & set(solve), "the draw after the solve reused a key"
    # the fixed-mask twin, with the same rng: its mask is the solve's
    # (eager: its map closes over the mask, which jit would keep in JAX's caches)
    ((z_fixed, steps_fixed), state_fixed), seen_fixed = _apply(_model(run, fixed=True), "eager")
    assert seen_fixed[0] == solve[0]
    assert int(steps) == int(steps_fixed)
    np.testing.assert_allclose(z, z_fixed, atol=1e-6)
    # one EMA update, at the solution
    np.testing.assert_allclose(state["~"]["mean"], state_fixed["~"]["mean"], atol=1e-5)
    # the next forward call (another key) draws another mask
    _, seen_next = _apply(_model(run), how, seed=2)
    assert seen_next[0] != solve[0]


# Reverse mode through a while loop (the non-implicit solvers) is refused by JAX itself,
# and jaxopt's implicit_diff=True differentiates run()'s arguments only (a closed-over
# Haiku parameter is refused by name): the implicit fpsolve solves are the ones to test,
# and jaxopt on the fix that refusal names (the map converted by jo.closure_convert, its
# parameters passed to run()).
GRADIENT: dict[str, Runner] = {
    **{n: run for n, run in THREADED.items() if n.startswith("fpsolve-") and "implicit" in n},
    "jaxopt-implicit-converted": jaxopt_converted_run,
}


@pytest.mark.parametrize("name", list(GRADIENT))
def test_the_gradient_is_the_fixed_mask_twins_eager_and_under_jit(name: str) -> None:
    # the twin draws its mask before the solve and updates the mean once after it
    model, twin = _model(GRADIENT[name]), _model(GRADIENT[name], fixed=True)
    params, state = model.init(jax.random.key(0), X)

    def loss(transformed: hk.TransformedWithState) -> Callable[[Any], Any]:
        def value(p: Any) -> Any:
            (z, _), after = transformed.apply(p, state, jax.random.key(1), X)
            return jnp.sum(z**2), after["~"]["mean"]

        return value

    (jitted, mean_jit) = jax.jit(jax.grad(loss(model), has_aux=True))(params)
    (eager, mean_eager) = jax.grad(loss(model), has_aux=True)(params)
    (expected, mean_twin) = jax.grad(loss(twin), has_aux=True)(params)
    for a, b, c in zip(*map(jax.tree.leaves, (jitted, eager, expected)), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
        np.testing.assert_allclose(a, c, atol=1e-5)
    np.testing.assert_allclose(mean_jit, mean_twin, atol=1e-5)  # one update, at z*
    np.testing.assert_allclose(mean_eager, mean_twin, atol=1e-5)


@pytest.mark.parametrize("name", list(THREADED))
def test_eager_and_jit_agree(name: str) -> None:
    (eager, eager_state), _ = _apply(_model(THREADED[name]), "eager")
    (jitted, jit_state), _ = _apply(_model(THREADED[name]), "jit")
    np.testing.assert_allclose(eager[0], jitted[0], atol=1e-6)
    np.testing.assert_allclose(eager_state["~"]["mean"], jit_state["~"]["mean"], atol=1e-6)


@pytest.mark.parametrize("how", ["eager", "jit"])
@pytest.mark.parametrize("name", list(CONVERTED))
def test_a_converted_map_draws_the_solves_mask(name: str, how: str) -> None:
    ((z, steps), _), seen = _apply(_model(CONVERTED[name], stats=False), how)
    solve, after = _split(seen)
    assert len(set(solve)) == 1
    assert after and not set(after) & set(solve), "the draw after the solve reused its key"
    twin = _model(CONVERTED[name], fixed=True, stats=False)
    ((z_fixed, steps_fixed), _), seen_fixed = _apply(twin, "eager")
    assert seen_fixed[0] == solve[0]
    assert int(steps) == int(steps_fixed)
    np.testing.assert_allclose(z, z_fixed, atol=1e-6)


# -- a map converted by make_jaxpr (as equinox's filter_closure_convert converts it) --


def jaxpr_solver(f: Callable[[jax.Array], jax.Array], z0: jax.Array) -> tuple[Any, Any]:
    """A fixed point solver that converts its map with ``jo.make_jaxpr`` and evaluates
    the jaxpr in its loop, as optimistix and diffrax do (``filter_closure_convert``)."""
    closed = jo.make_jaxpr(f)(z0)
    evaluate = jax.extend.core.jaxpr_as_fun(closed)
    return jo.lax.fori_loop(0, 40, lambda _, z: evaluate(z)[0], z0), 40


def _count() -> None:
    n = hk.get_state("count", [], jnp.int32, init=jnp.zeros)
    hk.set_state("count", n + 1)


def _batch(h: jax.Array, x: jax.Array) -> jax.Array:
    """The BatchNorm's batch: the layer's output and three rows of the input."""
    return jnp.stack([h, x + 1.0, x - 1.0, x + 2.0])


def stateful_model(
    run: Runner, fixed: bool = False, field: bool = False, declared: Any = None
) -> hk.TransformedWithState:
    """A DEQ layer whose map draws dropout, normalises with an ``hk.BatchNorm`` (its
    moving averages: ``hk.ExponentialMovingAverage``) and counts its evaluations
    (``hk.set_state``); then one more draw. ``field``: the map is ``dy/dt`` (a neural
    ODE's). ``declared``: ``jo.solve_state``'s arguments.

    ``fixed``: the explicit twin: the mask drawn before the solve, the map normalising
    with the batch's statistics without writing them, and the statistics and the count
    updated once after the solve, at its result z*."""

    def forward(x: jax.Array) -> Any:
        layer = hk.Linear(3, w_init=hk.initializers.RandomNormal(0.3))
        norm = hk.BatchNorm(True, True, MOMENTUM, name="bn")
        fixed_mask = _dropout(hk.next_rng_key(), x.shape) if fixed else None

        def f(z: jax.Array) -> jax.Array:
            mask = _dropout(hk.next_rng_key(), z.shape) if fixed_mask is None else fixed_mask
            h = layer(jnp.where(mask, z, 0.0))
            normed = norm(_batch(h, x), is_training=not fixed, test_local_stats=fixed)[0]
            if not fixed:
                _count()
            out = jnp.tanh(h + 0.1 * normed + 0.3)
            return out - z if field else out

        if fixed_mask is not None:
            z, steps = run(f, x)
            norm(_batch(layer(jnp.where(fixed_mask, z, 0.0)), x), is_training=True)
            _count()
        else:
            with jo.solve_state(**(declared or {})):
                z, steps = run(f, x)
        _dropout(hk.next_rng_key(), x.shape, after=True)
        return z, steps

    return hk.transform_with_state(forward)


def largest(a: Any, b: Any) -> float:
    """The largest difference between two pytrees of arrays of one structure."""
    diffs = jax.tree.map(lambda u, v: float(np.max(np.abs(np.asarray(u) - np.asarray(v)))), a, b)
    return max(jax.tree.leaves(diffs), default=0.0)


@pytest.mark.parametrize("how", ["eager", "jit"])
def test_a_map_converted_by_make_jaxpr_keeps_its_state_at_the_solution(how: str) -> None:
    # the BatchNorm's statistics and the count come out of the jaxpr at each evaluation
    # (refused on main), the solve keeping its last forward evaluation's: one update at z*
    ((z, steps), after), seen = _apply(stateful_model(jaxpr_solver), how)
    solve, drawn_after = _split(seen)
    assert len(solve) == steps and len(set(solve)) == 1, "one mask per solve"
    assert drawn_after and not set(drawn_after) & set(solve)
    ((z_twin, _), after_twin), seen_twin = _apply(stateful_model(jaxpr_solver, fixed=True), "eager")
    assert seen_twin[0] == solve[0]
    np.testing.assert_allclose(z, z_twin, atol=1e-6)
    _, start = initialised(stateful_model(jaxpr_solver))  # init, under the declaration
    assert jax.tree.structure(start) == jax.tree.structure(after_twin)
    assert int(after["~"]["count"]) == int(start["~"]["count"]) + 1
    assert float(np.abs(after["bn/~/mean_ema"]["average"]).max()) > 1e-2  # moved
    assert largest(after, after_twin) <= 1e-5, (after, after_twin)
    ((z_other, _), after_other), _ = _apply(
        stateful_model(jaxpr_solver), "eager" if how == "jit" else "jit"
    )
    np.testing.assert_allclose(z_other, z, atol=1e-6)
    assert largest(after_other, after) <= 1e-6


def test_a_map_converted_by_make_jaxpr_differentiates_as_its_twin() -> None:
    # under jo.jit(jo.grad): the twin's gradient, and its state (one update at z*)
    model, twin = stateful_model(jaxpr_solver), stateful_model(jaxpr_solver, fixed=True)
    params, state = initialised(model)

    def loss(transformed: hk.TransformedWithState) -> Callable[[Any], Any]:
        def value(p: Any) -> Any:
            (z, _), after = transformed.apply(p, state, jax.random.key(1), X)
            return jnp.sum(z**2), after

        return value

    with masks_seen() as seen:
        grads, after = jo.jit(jo.grad(loss(model), has_aux=True))(params)
    expected, after_twin = jax.grad(loss(twin), has_aux=True)(params)
    assert len(set(_split(seen)[0])) == 1
    assert largest(grads, expected) <= 1e-5, (grads, expected)
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(expected)) > 1e-2
    assert largest(after, after_twin) <= 1e-5


@pytest.mark.parametrize("solver", ["closure_convert", "make_jaxpr"])
@pytest.mark.parametrize(
    "declared",
    [{"state": "per_evaluation"}, {"state": {"bn": "at_solution"}}],
    ids=["per_evaluation", "bn_only"],
)
def test_a_converted_write_the_declaration_leaves_per_evaluation_is_refused(
    solver: str, declared: dict[str, Any]
) -> None:
    # one write per evaluation of a pure jaxpr cannot come out of it: refused, named
    # (``bn_only``: the statistics would come out, the count is left per evaluation)
    run = CONVERTED["fpsolve-forward-implicit"] if solver == "closure_convert" else jaxpr_solver
    model = stateful_model(run, declared=declared)
    with pytest.raises(errors.PureFunctionWriteError, match=r"leaves per evaluation"):
        model.init(jax.random.key(0), X)


def test_without_the_declaration_a_converted_draw_is_refused_naming_it() -> None:
    with pytest.raises(joh.PureFunctionWriteError, match=r"jaxoverride\.solve_state\(\)"):
        _apply(_model(CONVERTED["fpsolve-forward-implicit"], declare=False, stats=False), "eager")


def _silent(declare: bool, wrap: Callable[[Callable[..., Any], Any], Any]) -> Any:
    """jaxopt ``implicit_diff=True`` under ``jax.grad``: the backward pass re-evaluates
    the map; its draw is wrapped in a neutral call."""

    def forward(x: jax.Array) -> jax.Array:
        layer = hk.Linear(3, w_init=hk.initializers.RandomNormal(0.3))

        def drop(z: jax.Array) -> jax.Array:
            return jnp.where(_dropout(hk.next_rng_key(), z.shape), z, 0.0)

        def f(z: jax.Array) -> jax.Array:
            return jnp.tanh(layer(wrap(drop, z)) + 0.3)

        if declare:
            with jo.solve_state():
                z, _ = jaxopt_run(True)(f, x)
        else:
            z, _ = jaxopt_run(True)(f, x)
        _dropout(hk.next_rng_key(), x.shape, after=True)
        return jnp.sum(z)

    model = hk.transform(forward)
    params = model.init(jax.random.key(0), X)
    with masks_seen() as seen:
        grad = jax.grad(lambda x: model.apply(params, jax.random.key(1), x))(X)
    return grad, seen


WRAPS: dict[str, Callable[[Callable[..., Any], Any], Any]] = {
    "direct": lambda g, z: g(z),
    "fori_loop": lambda g, z: jo.lax.fori_loop(0, 1, lambda _, z: g(z), z),
    "cond": lambda g, z: jo.lax.cond(True, g, g, z),
    "jit": lambda g, z: jo.jit(g)(z),
    "checkpoint": lambda g, z: jo.checkpoint(g)(z),
    "vmap": lambda g, z: jo.vmap(g)(z[None])[0],
    "vjp": lambda g, z: jo.vjp(g, z)[0],
}


@pytest.mark.parametrize("wrap", list(WRAPS))
def test_a_backward_re_evaluation_never_reuses_another_draws_key(wrap: str) -> None:
    with pytest.raises(joh.PureFunctionWriteError, match=r"jaxoverride\.solve_state\(\)"):
        _silent(False, WRAPS[wrap])
    grad, seen = _silent(True, WRAPS[wrap])
    solve, after = _split(seen)
    assert len(set(solve)) == 1, "the backward pass drew other keys than the solve's"
    assert after and not set(after) & set(solve)
    assert np.isfinite(np.asarray(grad)).all()


def test_with_nothing_active_the_declaration_changes_nothing() -> None:
    def solve(x: jax.Array) -> jax.Array:
        return jo.lax.fori_loop(0, 3, lambda _, z: jnp.tanh(z + x), x)

    def declared(x: jax.Array) -> jax.Array:
        with jo.solve_state():
            return solve(x)

    assert program_text(jax.make_jaxpr(declared)(X)) == program_text(jax.make_jaxpr(solve)(X))
    # inside a transform, a model with no state and no rng: the same jaxpr too
    plain = hk.transform(lambda x: solve(hk.Linear(3)(x)))
    inside = hk.transform(lambda x: declared(hk.Linear(3)(x)))
    params = plain.init(jax.random.key(0), X)
    assert program_text(jax.make_jaxpr(lambda p: inside.apply(p, None, X))(params)) == program_text(
        jax.make_jaxpr(lambda p: plain.apply(p, None, X))(params)
    )


def _unrolled(f: Callable[[jax.Array], jax.Array], z0: jax.Array) -> tuple[Any, Any]:
    import fpsolve  # pyright: ignore[reportMissingImports]  (examples/, put on the path by _examples)

    solution = fpsolve.fixed_point(lambda z, _: f(z), z0, None, method="unrolled", max_iter=100)
    return solution.value, solution.iterations


@pytest.mark.parametrize("stats", [False, True])
@pytest.mark.parametrize("name", list(CONVERTED))
def test_the_implicit_gradient_is_the_unrolled_one_with_the_solves_mask(
    name: str, stats: bool
) -> None:
    model = _model(CONVERTED[name], stats=stats)
    twin = _model(_unrolled, fixed=True, stats=stats)  # backpropagated, the mask fixed
    params, state = model.init(jax.random.key(0), X)

    def loss(transformed: hk.TransformedWithState) -> Callable[[Any], jax.Array]:
        return lambda p: jnp.sum(transformed.apply(p, state, jax.random.key(1), X)[0][0] ** 2)

    jitted = jax.jit(jax.grad(loss(model)))(params)
    eager = jax.grad(loss(model))(params)
    unrolled = jax.grad(loss(twin))(params)
    for a, b, c in zip(*map(jax.tree.leaves, (jitted, eager, unrolled)), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
        np.testing.assert_allclose(a, c, atol=1e-5)


def test_state_per_module_a_counter_per_evaluation_the_mean_at_the_solution() -> None:
    def forward(x: jax.Array) -> Any:
        layer = hk.Linear(3, w_init=hk.initializers.RandomNormal(0.3))

        def count() -> None:
            with hk.experimental.name_scope("counter"):
                n = hk.get_state("n", [], jnp.int32, init=jnp.zeros)
                hk.set_state("n", n + 1)

        def f(z: jax.Array) -> jax.Array:
            count()
            mask = _dropout(hk.next_rng_key(), z.shape)
            mean = hk.get_state("mean", z.shape, init=jnp.zeros)
            hk.set_state("mean", MOMENTUM * mean + (1 - MOMENTUM) * z)
            return jnp.tanh(layer(jnp.where(mask, z, 0.0)) + 0.3)

        with jo.solve_state(rng="per_solve", state={"~": "at_solution"}):
            return fpsolve_run("forward", False)(f, x)

    model = hk.transform_with_state(forward)
    params, state = model.init(jax.random.key(0), X)
    with masks_seen() as seen:
        (z, _), after = model.apply(params, state, jax.random.key(1), X)
    assert len(set(seen)) == 1
    assert int(after["counter"]["n"]) == int(state["counter"]["n"]) + len(seen)
    np.testing.assert_allclose(after["~"]["mean"], (1 - MOMENTUM) * z, atol=1e-5)


def test_a_name_that_no_module_has_is_refused() -> None:
    def forward(x: jax.Array) -> jax.Array:
        hk.set_state("mean", x)
        with jo.solve_state(state={"no_such_module": "at_solution"}):
            return x

    model = hk.transform_with_state(forward)
    params, state = model.init(None, X)
    with pytest.raises(ValueError, match="no_such_module"):
        model.apply(params, state, None, X)


# -- optimistix and diffrax, in a fresh interpreter (tests/_solve_state_haiku_script.py) --

LIBRARIES = FreshScript(
    Path(__file__).with_name("_solve_state_haiku_script.py"),
    {
        "optimistix": ["optimistix"],
        "diffrax": ["diffrax"],
        "diffrax-direct": ["diffrax-direct"],
        "optimistix-state": ["optimistix-state"],
        "diffrax-state": ["diffrax-state"],
    },
    [jo, joh],
    timeout=1500,
)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["optimistix", "diffrax"])
def test_a_map_converted_by_make_jaxpr_draws_one_mask_and_the_stream_moves_on(case: str) -> None:
    # optimistix and diffrax's default adjoint turn the map into a jaxpr: nothing drawn
    # there comes out, yet the draw after the solve must not get the solve's key
    result = LIBRARIES.reported(case, case)
    assert result["evaluations"] > 1
    assert result["masks"] == 1 and result["masks_grad"] == 1  # the backward pass too
    assert not result["after_reuses"], "the draw after the solve reused the solve's key"
    assert result["twin_mask_is_the_solves"]
    assert result["z_vs_twin"] <= 1e-6 and result["grad_vs_twin"] <= 1e-5, result


@pytest.mark.slow
@pytest.mark.parametrize("case", ["optimistix-state", "diffrax-state"])
def test_libraries_converting_by_make_jaxpr_keep_the_state_at_the_solution(case: str) -> None:
    """optimistix's ``fixed_point`` and diffrax's default adjoint convert the map by
    ``make_jaxpr`` (equinox's ``filter_closure_convert``); the BatchNorm's statistics and
    the count come out of its jaxpr (refused on main): one mask per solve and a new key
    after it, the fixed-mask twin's steps and solution, one update at z*, init under the
    declaration, eager and ``jax.jit(apply)`` alike."""
    result = LIBRARIES.reported(case, case)
    assert result["evaluations"] > 1 and result["masks"] == 1, result
    assert result["twin_mask_is_the_solves"] and not result["after_reuses"], result
    assert result["steps"] == result["steps_twin"] == result["steps_jit"], result
    assert result["count_advanced"] == 1 and result["statistics_moved"] > 1e-3, result
    for measure in ("z_vs_twin", "jit_vs_eager", "state_vs_twin", "state_jit_vs_eager"):
        assert result[measure] <= 1e-5, (measure, result)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["optimistix-state", "diffrax-state"])
def test_libraries_converting_by_make_jaxpr_jit_grad_as_the_twin(case: str) -> None:
    """Under ``jo.jit(jo.grad)``: the fixed-mask twin's gradient through the same library,
    the solve's one mask, and the state as eager."""
    result = LIBRARIES.reported(case, case)
    assert "grad_error" not in result, result["grad_error"]
    assert result["masks_grad_entry"] and not result["after_reuses_grad"], result
    assert result["grad_vs_twin"] <= 1e-5 * max(1.0, result["grad_scale"]), result
    assert result["state_grad_vs_eager"] <= 1e-5, result


@pytest.mark.slow
def test_direct_adjoint_leaves_one_update_at_the_last_evaluation_eager_and_under_jit() -> None:
    # DirectAdjoint: equinox's bounded while loop, scans of checkpointed conds whose
    # no-op branch passes the state on; the state is the last evaluation's, not the entry's
    result = LIBRARIES.reported("diffrax-direct", "diffrax-direct")
    for how in ("eager", "jit"):
        assert result[f"{how}_evaluations"] > 1, result
        assert result[f"{how}_count"] == 1, result  # one update from the entry's
        assert result[f"{how}_mean_moved"] > 1e-3, result
        assert result[f"{how}_mean_vs_last"] <= 1e-6, result


def _gated_in(boundary: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Wraps a loop step in the neutral boundary named ``boundary``."""

    def custom_jvp(step: Callable[..., Any]) -> Callable[..., Any]:
        rule = jo.custom_jvp(step)
        rule.defjvp(lambda primals, tangents: (rule(*primals), tangents[0]))
        return rule

    return {
        "checkpoint": jo.checkpoint,
        "jit": jo.jit,
        "custom_jvp": custom_jvp,
        "vmap": lambda step: jo.vmap(step, in_axes=None, out_axes=None, axis_size=1),
    }[boundary]


@pytest.mark.parametrize("how", ["eager", "jit"])
@pytest.mark.parametrize("boundary", ["checkpoint", "jit", "custom_jvp", "vmap"])
def test_a_boundary_whose_branch_evaluates_nothing_passes_the_last_evaluations_state_on(
    boundary: str, how: str
) -> None:
    # equinox's bounded while loop (diffrax's DirectAdjoint) in small: a loop of
    # boundaries around a cond whose no-op branch runs no evaluation; on the last trip
    # the state the last evaluation left must come through, not the entry's
    def forward(x: jax.Array) -> jax.Array:
        def f(z: jax.Array) -> jax.Array:
            n = hk.get_state("n", [], jnp.int32, init=jnp.zeros)
            hk.set_state("n", n + 1)
            mean = hk.get_state("mean", z.shape, init=jnp.zeros)
            hk.set_state("mean", MOMENTUM * mean + (1 - MOMENTUM) * z)
            return 0.5 * jnp.cos(z)

        evaluate = lambda carry: (f(carry[0]), carry[1] + 1.0)
        step = _gated_in(boundary)(
            lambda carry: jo.lax.cond(carry[1] < 1.5, evaluate, lambda c: c, carry)
        )
        with jo.solve_state():
            (z, _), _ = jo.lax.scan(lambda c, _: (step(c), None), (x, 0.0), None, length=3)
        return z

    model = hk.transform_with_state(forward)
    params, state = model.init(None, X)
    apply = jax.jit(model.apply) if how == "jit" else model.apply
    _, after = apply(params, state, None, X)
    last = 0.5 * jnp.cos(X)  # the second (last) evaluation's input
    assert int(after["~"]["n"]) == int(state["~"]["n"]) + 1
    np.testing.assert_allclose(
        after["~"]["mean"], MOMENTUM * state["~"]["mean"] + (1 - MOMENTUM) * last, atol=1e-6
    )


def test_a_loop_after_a_converted_one_starts_from_no_value_of_the_conversions_trace() -> None:
    # what the loop inside make_jaxpr left belongs to that trace: the loop after it must
    # not be handed it (a leaked tracer), the draws in both are the solve's
    def forward(x: jax.Array) -> jax.Array:
        def f(z: jax.Array) -> jax.Array:
            return 0.5 * jnp.cos(z) * _dropout(hk.next_rng_key(), z.shape)

        loop = lambda z: jo.lax.scan(lambda c, _: (f(c), None), z, None, length=2)[0]
        with jo.solve_state():
            jo.make_jaxpr(loop)(x)
            return loop(x)

    model = hk.transform(forward)
    params = model.init(jax.random.key(0), X)
    with masks_seen() as seen:
        z = model.apply(params, jax.random.key(1), X)
    assert len(seen) == 2 and len(set(seen)) == 1  # the loop's two evaluations, one key
    key = jax.random.wrap_key_data(jnp.asarray(np.frombuffer(seen[0], np.uint32)))
    mask = jax.random.bernoulli(key, KEEP, X.shape)
    np.testing.assert_allclose(z, 0.5 * jnp.cos(0.5 * jnp.cos(X) * mask) * mask, atol=1e-6)


@pytest.mark.parametrize("how", ["grad", "jit(grad)"])
@pytest.mark.parametrize("what", ["rng", "state"])
def test_a_rule_that_calls_itself_on_its_tangent_differentiates_under_the_declaration(
    what: str, how: str
) -> None:
    # optimistix's _asarray in small (met in lineax's transpose of a converted map): a
    # custom_jvp whose JVP rule calls the function on the tangent too. From JAX 0.12 that
    # inner call, on an unknown tangent, is staged with only unknown outputs: the key or
    # state it merely passes on must stay the caller's, or the rule's primal output is
    # unknown (JAX's "Linearization failed to produce known values" on main, jax 0.12)
    same = jo.custom_jvp(lambda x: x)
    same.defjvp(lambda primals, tangents: (same(primals[0]), same(tangents[0])))

    def forward(x: jax.Array) -> jax.Array:
        n = hk.get_state("n", [], jnp.int32, init=jnp.zeros)
        with jo.solve_state():
            if what == "rng":
                x = jnp.where(_dropout(hk.next_rng_key(), x.shape), x, 0.0)
            else:
                hk.set_state("n", n + 1)
            return jnp.sum(same(x) ** 2)

    model = hk.transform_with_state(forward)
    key = jax.random.key(1) if what == "rng" else None
    params, state = model.init(key, X)

    def loss(x: jax.Array) -> tuple[jax.Array, Any]:
        return model.apply(params, state, key, x)

    grad = jax.grad(loss, has_aux=True)
    with masks_seen() as seen:
        grads, after = (jax.jit(grad) if how == "jit(grad)" else grad)(X)
    mask = 1.0
    if what == "rng":
        assert len(set(seen)) == 1
        drawn = jax.random.wrap_key_data(jnp.asarray(np.frombuffer(seen[0], np.uint32)))
        mask = jax.random.bernoulli(drawn, KEEP, X.shape)
    np.testing.assert_allclose(grads, 2 * X * mask, atol=1e-6)
    assert int(after["~"]["n"]) == int(state["~"]["n"]) + (what == "state")


def test_a_jvp_rule_traced_after_the_call_may_pass_the_state_on_through_a_jit() -> None:
    # optimistix's implicit JVP rule in small (it calls lineax's jitted solve, which
    # evaluates the map): under jax.jit(jax.grad) JAX traces the rule after the call has
    # returned, and the jit inside it hands back the state written before the declaration
    # as new values. Under a declaration that is no write the primal missed: no error
    def masked(x: jax.Array) -> jax.Array:
        return jnp.where(jax.random.bernoulli(hk.next_rng_key(), 1.0, x.shape), x, 0.0)

    rule = jo.custom_jvp(masked)
    rule.defjvp(lambda primals, tangents: (jo.jit(masked)(primals[0]), tangents[0]))

    def forward(x: jax.Array) -> jax.Array:
        n = hk.get_state("n", [], jnp.int32, init=jnp.zeros)
        hk.set_state("n", n + 1)
        with jo.solve_state():
            return jnp.sum(jo.jit(rule)(x) ** 2)

    model = hk.transform_with_state(forward)
    key = jax.random.key(1)
    params, state = model.init(key, X)
    grad = jax.jit(jax.grad(lambda x: model.apply(params, state, key, x), has_aux=True))
    grads, after = grad(X)
    np.testing.assert_allclose(grads, 2 * X, atol=1e-6)
    assert int(after["~"]["n"]) == int(state["~"]["n"]) + 1


@pytest.mark.parametrize("declare", [False, True])
def test_a_write_only_the_late_traced_jvp_rule_makes_is_refused(declare: bool) -> None:
    # the write could not come out (the call has returned): refused with or without a
    # declaration, which only lets a later run hand on what it was given as new values
    rule = jo.custom_jvp(lambda x: x)

    def jvp(primals: Any, tangents: Any) -> Any:
        hk.set_state("only_in_jvp", jnp.ones(()))
        return primals[0], tangents[0]

    rule.defjvp(jvp)

    def forward(x: jax.Array) -> jax.Array:
        with jo.solve_state() if declare else contextlib.nullcontext():
            return jnp.sum(jo.jit(rule)(x) ** 2)

    model = hk.transform_with_state(forward)
    params, state = model.init(None, X)
    grad = jax.jit(jax.grad(lambda x: model.apply(params, state, None, x), has_aux=True))
    # (leaks unchecked: the error leaves JAX's linearization with its tracers in the traceback)
    with (
        jax.check_tracer_leaks(False),
        pytest.raises(ValueError, match="only_in_jvp, which the primal function does not"),
    ):
        grad(X)
