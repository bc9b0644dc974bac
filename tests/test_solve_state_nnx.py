"""``jaxoverride.solve_state`` with Flax NNX: dropout and BatchNorm inside a solver's map.

A DEQ module calls a solver in ``__call__``; its map holds an ``nnx.Dropout`` (a stream
``dropout`` of ``nnx.Rngs``) and an ``nnx.BatchNorm`` in training mode (momentum 0.9), and
the module is tracked with ``jaxoverride_nnx.track``. Under the declaration every
evaluation of the map draws one mask (``masks_seen``: a host callback per evaluation),
the solve converges as the fixed-mask twin does, the rng count advances once, and the
running statistics are one EMA update at the solution; implicit gradients equal the
unrolled gradient of the fixed-mask twin. Without the declaration each evaluation draws
a new mask (non-implicit solvers) or the write is refused with the declaration named
(implicit ones). On main the declaration does not exist, and every test here fails.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxoverride as jo
import jaxoverride_nnx as jon
from _libraries import FreshScript, interposed
from _parity import program_text
from _solve_state_solvers import (
    DIRECT_ADJOINT_GRAD_BEFORE_JAX_010,
    fpsolve_run,
    jaxopt_converted_run,
    jaxopt_run,
    masks_seen,
    record,
)

D, B = 4, 8
X = jax.random.normal(jax.random.key(3), (B, D))
EPS = 1e-5  # nnx.BatchNorm's default epsilon


class Counter(nnx.Variable):
    """A custom Variable type: counts the map's evaluations."""


class Deq(nnx.Module):
    """``z -> tanh(dropout(lin(z)) + x + 0.1 * bn(z))``, solved in ``__call__``."""

    def __init__(self, run: Callable[..., Any], declared: Any = True, seed: int = 0):
        rngs = nnx.Rngs(seed, dropout=seed + 1)
        self.lin = nnx.Linear(D, D, rngs=rngs)
        self.lin.kernel[...] = self.lin.kernel[...] * 0.3
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.bn = nnx.BatchNorm(D, use_running_average=False, momentum=0.9, rngs=rngs)
        self.calls = Counter(jnp.array(0))
        self.run = run
        self.declared = declared  # the solve_state kwargs, True for the defaults, or None

    def f(self, z: jax.Array) -> jax.Array:
        self.calls[...] += 1
        mask = self.drop(jnp.ones_like(z))
        record(mask)
        return jnp.tanh(self.lin(z) * mask + X + 0.1 * self.bn(z))

    def __call__(self) -> tuple[jax.Array, Any]:
        if self.declared is None:
            return self.run(self.f, jnp.zeros_like(X))
        kwargs = {} if self.declared is True else self.declared
        with jo.solve_state(**kwargs):
            return self.run(self.f, jnp.zeros_like(X))


def entry_mask(model: Any) -> np.ndarray:
    """The mask the next draw of the model's dropout stream gives (nothing advanced)."""
    key = jax.random.fold_in(model.drop.rngs.key[...], model.drop.rngs.count[...])
    return np.asarray(jax.random.bernoulli(key, 0.5, X.shape)) * 2.0


def twin_map(params: dict[str, jax.Array], mask: np.ndarray) -> Callable[..., Any]:
    """The map with a fixed mask and batch statistics, on explicit parameters."""

    def f(z: jax.Array) -> jax.Array:
        bn = (z - z.mean(0)) / jnp.sqrt(z.var(0) + EPS) * params["scale"] + params["shift"]
        return jnp.tanh((z @ params["kernel"] + params["bias"]) * mask + X + 0.1 * bn)

    return f


def params_of(model: Any) -> dict[str, jax.Array]:
    return {
        "kernel": model.lin.kernel[...],
        "bias": model.lin.bias[...],
        "scale": model.bn.scale[...],
        "shift": model.bn.bias[...],
    }


def one_update(mean: Any, var: Any, z: jax.Array) -> tuple[Any, Any]:
    """The running statistics after one EMA update at ``z`` from ``mean``/``var``."""
    return 0.9 * mean + 0.1 * z.mean(0), 0.9 * var + 0.1 * z.var(0)


def state_of(model: Any) -> dict[str, np.ndarray]:
    return {
        "count": np.asarray(model.drop.rngs.count[...]),
        "mean": np.asarray(model.bn.mean[...]),
        "var": np.asarray(model.bn.var[...]),
        "calls": np.asarray(model.calls[...]),
    }


FPSOLVE = [
    pytest.param("forward", False, id="forward"),
    pytest.param("anderson", False, id="anderson"),
    pytest.param("newton", False, id="newton"),
    pytest.param("forward", True, id="forward-implicit"),
    pytest.param("anderson", True, id="anderson-implicit"),
    pytest.param("newton", True, id="newton-implicit"),
]


def apply(model: Deq, mode: str) -> tuple[jax.Array, Any]:
    if mode == "jit":
        return jo.jit(lambda: model())()
    return model()


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize(("method", "implicit"), FPSOLVE)
def test_one_mask_per_solve_state_at_the_solution(method: str, implicit: bool, mode: str):
    """(1) one mask per solve, another on the next call; (2) the fixed-mask twin's
    iterations and residual; (4) one EMA update at z*; (5) eager and jit agree."""
    run = fpsolve_run(method, implicit)
    model = Deq(run)
    start = state_of(model)
    mask = entry_mask(model)
    with jon.track(model), jax.checking_leaks(), masks_seen() as seen:
        z, steps = apply(model, mode)
    assert len(seen) > 2 and set(seen) == {mask.astype(np.float32).tobytes()}
    twin_z, twin_steps = run(twin_map(params_of(model), mask), jnp.zeros_like(X))
    assert int(steps) == int(twin_steps)
    np.testing.assert_allclose(z, twin_z, rtol=1e-5, atol=1e-6)
    after = state_of(model)
    assert int(after["count"]) == int(start["count"]) + 1  # advanced once
    assert int(after["calls"]) == int(start["calls"]) + 1  # at the solution: once
    mean, var = one_update(start["mean"], start["var"], z)
    np.testing.assert_allclose(after["mean"], mean, atol=1e-5)
    np.testing.assert_allclose(after["var"], var, atol=1e-5)

    next_mask = entry_mask(model)
    with jon.track(model), masks_seen() as seen:
        apply(model, mode)
    assert set(seen) == {next_mask.astype(np.float32).tobytes()}
    assert not np.array_equal(next_mask, mask)

    other = Deq(run)  # the other mode, from the same state: the same results
    with jon.track(other):
        z_other, steps_other = apply(other, "jit" if mode == "eager" else "eager")
    np.testing.assert_allclose(z_other, z, rtol=1e-5, atol=1e-6)
    assert int(steps_other) == int(steps)
    for name, value in state_of(other).items():
        np.testing.assert_allclose(value, after[name], atol=1e-5)


def unrolled_loss(params: dict[str, jax.Array], mask: np.ndarray) -> jax.Array:
    f = twin_map(params, mask)
    z, _ = jax.lax.scan(lambda z, _: (f(z), None), jnp.zeros_like(X), length=100)
    return jnp.sum(z**2)


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize(
    "method",
    ["forward", "anderson", "newton"],
)
def test_implicit_gradient_equals_the_unrolled_one(method: str, mode: str):
    """(3) the implicit gradient is the fixed-mask twin's unrolled gradient; one mask,
    the backward pass's re-evaluations included, and the state at the solution."""
    model = Deq(fpsolve_run(method, True))
    start = state_of(model)
    mask = entry_mask(model)
    expected = jax.grad(unrolled_loss)(params_of(model), mask)

    def loss(m: Deq) -> jax.Array:
        return jnp.sum(m()[0] ** 2)

    grad = jo.grad(loss) if mode == "eager" else jo.jit(jo.grad(loss))
    with jon.track(model), jax.checking_leaks(), masks_seen() as seen:
        grads = grad(model)
    assert set(seen) == {mask.astype(np.float32).tobytes()}
    np.testing.assert_allclose(grads["lin"]["kernel"][...], expected["kernel"], atol=1e-5)
    np.testing.assert_allclose(grads["lin"]["bias"][...], expected["bias"], atol=1e-5)
    np.testing.assert_allclose(grads["bn"]["scale"][...], expected["scale"], atol=1e-5)
    after = state_of(model)
    assert int(after["count"]) == int(start["count"]) + 1
    assert int(after["calls"]) == int(start["calls"]) + 1


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_jaxopt_implicit_on_the_converted_map_differentiates_as_the_unrolled_twin(mode: str):
    """The fix that jaxopt's refusal below names: the map converted by
    ``jo.closure_convert``, its parameters passed to ``run()``. (3) the implicit gradient
    is the fixed-mask twin's unrolled one, to 1e-5 of the gradient's scale (jaxopt's
    linear solve in float32); one mask, the backward pass's re-evaluations included;
    the state at the solution."""
    model = Deq(jaxopt_converted_run)
    start = state_of(model)
    mask = entry_mask(model)
    expected = jax.grad(unrolled_loss)(params_of(model), mask)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(expected))

    def loss(m: Deq) -> jax.Array:
        return jnp.sum(m()[0] ** 2)

    grad = jo.grad(loss) if mode == "eager" else jo.jit(jo.grad(loss))
    with interposed("jaxopt"), jon.track(model), jax.checking_leaks(), masks_seen() as seen:
        grads = grad(model)
    assert set(seen) == {mask.astype(np.float32).tobytes()}
    got = {
        "kernel": grads["lin"]["kernel"][...],
        "bias": grads["lin"]["bias"][...],
        "scale": grads["bn"]["scale"][...],
        "shift": grads["bn"]["bias"][...],
    }
    for name, value in got.items():
        np.testing.assert_allclose(value, expected[name], atol=1e-5 * max(1.0, scale))
    after = state_of(model)
    assert int(after["count"]) == int(start["count"]) + 1
    assert int(after["calls"]) == int(start["calls"]) + 1
    # (4) one EMA update at z*, the twin's solution
    f = twin_map(params_of(model), mask)
    z_twin, _ = jax.lax.scan(lambda z, _: (f(z), None), jnp.zeros_like(X), length=100)
    mean, var = one_update(start["mean"], start["var"], z_twin)
    np.testing.assert_allclose(after["mean"], mean, atol=1e-5)
    np.testing.assert_allclose(after["var"], var, atol=1e-5)


@pytest.mark.parametrize("implicit_diff", [False, True])
def test_jaxopt_fixed_point_iteration(implicit_diff: bool):
    """jaxopt, interposed: one mask, the twin's iterations, one EMA update at z*. With
    ``implicit_diff=True`` a closed-over module's gradient stays refused (the rule reads
    its parameters without having them as arguments), as without a declaration."""
    run = jaxopt_run(implicit_diff)
    model = Deq(run)
    start = state_of(model)
    mask = entry_mask(model)
    with interposed("jaxopt"), jon.track(model), masks_seen() as seen:
        z, steps = model()
        if implicit_diff:
            with pytest.raises(jon.ClosedOverDifferentiationError, match="closure_convert"):
                jo.grad(lambda m: jnp.sum(m()[0]))(model)
    assert set(seen) == {mask.astype(np.float32).tobytes()}
    twin_z, twin_steps = run(twin_map(params_of(model), mask), jnp.zeros_like(X))
    assert int(steps) == int(twin_steps)
    np.testing.assert_allclose(z, twin_z, rtol=1e-5, atol=1e-6)
    after = state_of(model)
    assert int(after["count"]) == int(start["count"]) + 1
    mean, var = one_update(start["mean"], start["var"], z)
    np.testing.assert_allclose(after["mean"], mean, atol=1e-5)
    np.testing.assert_allclose(after["var"], var, atol=1e-5)


@pytest.mark.parametrize("method", ["forward", "anderson"])
def test_without_the_declaration_each_evaluation_draws(method: str):
    """(6) today's semantics: a new mask per evaluation, a write per evaluation."""
    model = Deq(fpsolve_run(method, False), declared=None)
    with jon.track(model), masks_seen() as seen:
        model()
    assert len(set(seen)) == len(seen) > 2
    assert int(model.calls[...]) == len(seen)


def test_without_the_declaration_an_implicit_solve_refuses_naming_it():
    """(6) implicit: the write is refused, and the message names the declaration."""
    model = Deq(fpsolve_run("anderson", True), declared=None)
    before = state_of(model)
    with jon.track(model), pytest.raises(jon.PureFunctionWriteError, match="solve_state"):
        model()
    for name, value in state_of(model).items():
        np.testing.assert_array_equal(value, before[name])


def test_nothing_tracked_the_declaration_changes_nothing():
    """(7) outside every framework: the same jaxpr."""
    f = lambda z: jnp.tanh(z * 0.5 + 1.0)
    solve = lambda z0: fpsolve_run("anderson", True)(f, z0)[0]

    def declared(z0: jax.Array) -> jax.Array:
        with jo.solve_state():
            return solve(z0)

    assert program_text(jax.make_jaxpr(declared)(X)) == program_text(jax.make_jaxpr(solve)(X))
    marked = lambda z0: fpsolve_run("anderson", True)(jo.solver_map(f), z0)[0]
    assert program_text(jax.make_jaxpr(marked)(X)) == program_text(jax.make_jaxpr(solve)(X))


@pytest.mark.parametrize("declared", [None, {"rng": "per_evaluation", "state": "per_evaluation"}])
def test_a_marked_map_with_nothing_to_do_is_the_same_jaxpr(declared: Any):
    """Tracked, with no declaration (or one that freezes nothing): ``solver_map`` calls
    the map and nothing else."""
    run = fpsolve_run("forward", False)
    jaxprs = []
    for marked in (False, True):
        model = Deq(lambda f, z0, m=marked: run(jo.solver_map(f) if m else f, z0), declared)
        graph, state = nnx.split(model)

        def program(state: Any, graph: Any = graph) -> Any:
            inner = nnx.merge(graph, state)
            with jon.track(inner):
                out = inner()
            return out, nnx.state(inner)

        jaxprs.append(program_text(jax.make_jaxpr(program)(state)))
    assert jaxprs[0] == jaxprs[1]


@pytest.mark.parametrize(
    "state", [{nnx.BatchStat: "at_solution"}, {"BatchStat": "at_solution"}], ids=["type", "name"]
)
def test_per_stream_and_per_variable_type(state: dict[Any, str]):
    """Dropout frozen per solve, the BatchNorm statistics at the solution, the Counter
    (not named: per evaluation) counting every evaluation."""
    model = Deq(fpsolve_run("forward", False), declared={"rng": {"dropout": "per_solve"}})
    model.declared["state"] = state
    start = state_of(model)
    mask = entry_mask(model)
    with jon.track(model), masks_seen() as seen:
        z, _ = model()
    assert set(seen) == {mask.astype(np.float32).tobytes()}
    after = state_of(model)
    assert int(after["calls"]) == int(start["calls"]) + len(seen)
    mean, var = one_update(start["mean"], start["var"], z)
    np.testing.assert_allclose(after["mean"], mean, atol=1e-5)
    np.testing.assert_allclose(after["var"], var, atol=1e-5)


def test_rng_per_evaluation_state_at_the_solution():
    """``rng="per_evaluation"``: each evaluation draws; the statistics still once."""
    model = Deq(fpsolve_run("forward", False), declared={"rng": "per_evaluation"})
    start = state_of(model)
    with jon.track(model), masks_seen() as seen:
        model()
    assert len(set(seen)) == len(seen) > 2
    assert int(model.calls[...]) == int(start["calls"]) + 1


def test_a_name_no_variable_has_is_refused():
    model = Deq(fpsolve_run("forward", False), declared={"state": {"batch_stats": "at_solution"}})
    with jon.track(model), pytest.raises(ValueError, match="batch_stats"):
        model()


# -- optimistix and diffrax, in a fresh interpreter (tests/_solve_state_nnx_script.py) --

LIBRARIES = FreshScript(
    Path(__file__).with_name("_solve_state_nnx_script.py"),
    {"optimistix": ["optimistix"], "diffrax": ["diffrax"], "diffrax_direct": ["diffrax_direct"]},
    [jo, jon],
    timeout=1500,
)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["optimistix", "diffrax", "diffrax_direct"])
def test_libraries_converting_by_make_jaxpr_keep_the_statistics_at_the_solution(case: str):
    """optimistix's ``fixed_point`` and diffrax's default adjoint convert the map by
    ``make_jaxpr`` (equinox's ``filter_closure_convert``); the BatchNorm's statistics
    and the counter come out of its jaxpr (refused on main): (1) one mask per solve,
    (2) the fixed-mask twin's steps and solution, (4) one EMA update at z*, (5) eager
    and ``jo.jit`` agree."""
    result = LIBRARIES.reported(case, case)
    assert result["evaluations"] > 1 and result["masks"] == 1 and result["masks_entry"]
    assert result["steps"] == result["steps_twin"] == result["steps_jit"]
    assert result["count_advanced"] == 1 and result["calls_advanced"] == 1
    assert result["statistics_moved"] > 1e-3
    for measure in ("z_vs_twin", "jit_vs_eager", "statistics_vs_twin", "state_jit_vs_eager"):
        assert result[measure] <= 1e-5, (measure, result)


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        "optimistix",
        "diffrax",
        pytest.param(
            "diffrax_direct", marks=DIRECT_ADJOINT_GRAD_BEFORE_JAX_010, id="diffrax_direct"
        ),
    ],
)
def test_libraries_converting_by_make_jaxpr_jit_grad_as_the_twin(case: str):
    """(3) under ``jo.jit(jo.grad)`` the gradient equals the fixed-mask twin's through
    the same library, one mask, and the state as eager."""
    result = LIBRARIES.reported(case, case)
    assert "grad_error" not in result, result["grad_error"]
    assert result["masks_grad_entry"]
    assert result["grad_vs_twin"] <= 1e-5 * max(1.0, result["grad_scale"]), result
    assert result["state_grad_vs_eager"] <= 1e-5, result


class _Counted(nnx.Module):
    """A map that counts its evaluations and keeps a running mean of its input."""

    def __init__(self) -> None:
        self.mean = nnx.BatchStat(jnp.zeros(3))
        self.count = nnx.BatchStat(jnp.zeros((), jnp.int32))

    def __call__(self, z: jax.Array) -> jax.Array:
        self.mean.value = 0.9 * self.mean.value + 0.1 * z
        self.count.value = self.count.value + 1
        return 0.5 * jnp.cos(z)


def _ruled(f: Any) -> Any:
    ruled = jo.custom_jvp(f)
    ruled.defjvp(lambda primals, tangents: (ruled(*primals), tangents[0]))
    return ruled


BOUNDARIES = {"jit": jo.jit, "checkpoint": jo.checkpoint, "custom_jvp": _ruled}


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("boundary", list(BOUNDARIES))
def test_a_boundary_whose_branch_evaluates_nothing_passes_the_last_evaluation_on(
    boundary: str, jitted: bool
) -> None:
    # The loop's last trips take the no-op branch inside the boundary (as equinox's
    # bounded loop does): the statistics are the last evaluation's, not the entry's.
    model = _Counted()
    wrap = BOUNDARIES[boundary]

    def step(carry: Any, _: Any) -> Any:
        z, i = carry
        inner = wrap(lambda z, evaluate: jo.lax.cond(evaluate > 0, model, lambda z: z, z))
        return (inner(z, jnp.float32(i < 2)), i + 1), None

    def solve(x: jax.Array) -> jax.Array:
        with jo.solve_state():
            (z, _), _ = jo.lax.scan(step, (x, 0), None, length=4)
        return z

    x = jnp.linspace(-1.0, 1.0, 3)
    with jon.context(), jon.track(model), jax.checking_leaks():
        (jo.jit(solve) if jitted else solve)(x)
    # evaluations at x (i = 0) and at 0.5 cos(x) (i = 1): the last one's update, once
    assert int(model.count.value) == 1
    np.testing.assert_allclose(model.mean.value, 0.1 * (0.5 * jnp.cos(x)), atol=1e-6)
