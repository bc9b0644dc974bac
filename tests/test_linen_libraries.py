"""Unmodified solver libraries with Flax Linen modules in their callbacks.

jaxopt runs in-process (``interposed("jaxopt")`` rebinds its ``jax``/``lax`` references),
with ``implicit_diff`` on and off. The Equinox family (optimistix, lineax, diffrax) builds
``eqx.filter_jit`` at import, so it must be interposed before it is imported: those cases,
and the programs of diffrax issue #115 and flax issue #2887, run in a fresh interpreter
(``tests/_equinox_linen.py``, which prints JSON) and are asserted on here, case by case:

* init creates the parameters once, under the names a direct call of the layer gives,
  eager and under ``jax.jit`` alike, and nothing returned is a tracer;
* apply, ``jax.jit(apply)``, apply under ``install()`` instead of ``context()``,
  ``jax.grad`` and ``jax.jit(jax.grad)`` (w.r.t. the variables and the input) equal the
  same library run on the explicit parameters with raw JAX;
* a variable write or an rng draw inside the callback is refused with a
  ``PureFunctionWriteError`` that says why, and leaves the read-only model working; the
  same write outside the callback works.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import jaxopt
import numpy as np
import pytest

import jaxoverride as jo
import jaxoverride.errors as joe
import jaxoverride_linen
from _libraries import (
    REFUSALS,
    UPSTREAM_LEAK_CASES,
    UPSTREAM_LEAK_UNDER_JAX_011,
    FreshScript,
    assert_callback_refusal,
    interposed,
    run_fresh,
)

# Each test runs fresh interpreters that import the solver libraries: `make test-slow`.
pytestmark = pytest.mark.slow

N = 4
X = jnp.linspace(-1.0, 1.0, N)
RNG = jax.random.PRNGKey(0)
SOLVERS = {"fixed_point": jaxopt.FixedPointIteration, "anderson": jaxopt.AndersonAcceleration}


class JaxoptModel(nn.Module):
    """A contraction whose map calls an ``nn.Dense`` and counts its calls in ``"counters"``."""

    solver: str
    implicit_diff: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dense = nn.Dense(N, kernel_init=nn.initializers.normal(0.2), name="cell")
        calls = self.variable("counters", "calls", lambda: jnp.zeros((), jnp.int32))

        def cell(z: jax.Array) -> jax.Array:
            calls.value += 1
            return jnp.tanh(dense(z) + x)

        fixed_point = SOLVERS[self.solver](
            fixed_point_fun=cell, maxiter=50, tol=1e-5, implicit_diff=self.implicit_diff
        )
        return fixed_point.run(jnp.zeros(N)).params


def explicit_solve(params: Any, solver: str) -> jax.Array:
    """The same library call outside Linen, on the explicit parameters."""
    kernel, bias = params["cell"]["kernel"], params["cell"]["bias"]
    fun = lambda z: jnp.tanh(z @ kernel + bias + X)
    fixed_point = SOLVERS[solver](fixed_point_fun=fun, maxiter=50, tol=1e-5, implicit_diff=False)
    return fixed_point.run(jnp.zeros(N)).params


def _close(a: Any, b: Any, tol: float = 1e-5) -> None:
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=tol, atol=tol), a, b)


@pytest.mark.parametrize("implicit_diff", [False, True], ids=["unrolled", "implicit"])
@pytest.mark.parametrize("solver", list(SOLVERS))
def test_jaxopt_works_inside_linen(solver, implicit_diff):
    """Init and apply, eager and jitted, equal the explicit solve; the counter written in
    the solver's loop comes out once per call (with ``implicit_diff=True`` jaxopt wraps
    ``run`` in ``jax.custom_vjp``, whose primal function the adapter lifts)."""
    model = JaxoptModel(solver, implicit_diff)
    unrolled = JaxoptModel(solver, False)
    with interposed("jaxopt"), jaxoverride_linen.context():
        with jax.checking_leaks():
            variables = model.init(RNG, X)
            out, after = model.apply(variables, X, mutable=["counters"])
        jitted_variables = jax.jit(model.init)(RNG, X)
        jitted, after_jit = jax.jit(lambda v: model.apply(v, X, mutable=["counters"]))(variables)
        _, after_unrolled = unrolled.apply(variables, X, mutable=["counters"])
    assert jax.tree.map(jnp.shape, variables["params"]) == {
        "cell": {"bias": (N,), "kernel": (N, N)}
    }
    _close(variables, jitted_variables, 1e-6)  # eager and compiled initialisers: 1 ulp
    expected = explicit_solve(variables["params"], solver)
    _close(out, expected, 1e-6)
    _close(jitted, expected, 1e-6)
    calls = int(after["counters"]["calls"])
    assert calls == int(after_jit["counters"]["calls"]) > int(variables["counters"]["calls"]) + 2
    assert calls == int(after_unrolled["counters"]["calls"])


def test_jaxopt_unrolled_gradient_wrt_linen_params():
    """``implicit_diff=False`` differentiates jaxopt's loop: equal to the explicit gradient."""
    model = JaxoptModel("fixed_point", False)
    with interposed("jaxopt"), jaxoverride_linen.context():
        with jax.checking_leaks():
            variables = model.init(RNG, X)
        loss = lambda p: jnp.sum(
            model.apply({**variables, "params": p}, X, mutable=["counters"])[0] ** 2
        )
        grads = jax.grad(loss)(variables["params"])
        jitted = jax.jit(jax.grad(loss))(variables["params"])
    expected = jax.grad(lambda p: jnp.sum(explicit_solve(p, "fixed_point") ** 2))(
        variables["params"]
    )
    _close(grads, expected)
    _close(jitted, expected)
    assert float(jnp.abs(grads["cell"]["kernel"]).sum()) > 0


class PassedToRun(nn.Module):
    """jaxopt's documented way to differentiate: what the map needs goes to ``run``."""

    write: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param("kernel", nn.initializers.normal(0.2), (N, N))
        bias = self.param("bias", nn.initializers.zeros, (N,))
        calls = self.variable("counters", "calls", lambda: jnp.zeros((), jnp.int32))

        def fun(z: jax.Array, kernel: jax.Array, bias: jax.Array, x: jax.Array) -> jax.Array:
            if self.write:
                calls.value += 1
            return jnp.tanh(z @ kernel + bias + x)

        fixed_point = jaxopt.FixedPointIteration(fixed_point_fun=fun, maxiter=100, tol=1e-6)
        return fixed_point.run(jnp.zeros(N), kernel, bias, x).params


def _unrolled_loss(params: Any) -> jax.Array:
    z = jnp.zeros(N)
    for _ in range(100):
        z = jnp.tanh(z @ params["kernel"] + params["bias"] + X)
    return jnp.sum(z**2)


@pytest.mark.parametrize("mode", ["grad", "jit-grad", "grad-jit"])
def test_jaxopt_implicit_gradient_wrt_params_passed_to_run_equals_unrolled(mode):
    """Parameters passed to ``run`` are explicit arguments of jaxopt's rule: its implicit
    gradient equals backpropagation through the unrolled iteration."""
    model = PassedToRun()
    with interposed("jaxopt"), jaxoverride_linen.context():
        variables = model.init(RNG, X)
        apply = jax.jit(model.apply) if mode == "grad-jit" else model.apply
        grad = jax.grad(lambda p: jnp.sum(apply({**variables, "params": p}, X) ** 2))
        got = (jax.jit(grad) if mode == "jit-grad" else grad)(variables["params"])
    _close(got, jax.grad(_unrolled_loss)(variables["params"]))
    assert float(jnp.abs(got["kernel"]).sum()) > 0


@pytest.mark.parametrize("jit", [False, True], ids=["grad", "jit-grad"])
def test_jaxopt_implicit_gradient_wrt_closed_over_params_is_refused(jit):
    """A parameter the map reads without having it as an argument of jaxopt's rule would
    get a silently zero gradient: refused, naming the parameter and ``closure_convert``."""
    model = JaxoptModel("fixed_point", True)
    with interposed("jaxopt"), jaxoverride_linen.context():
        variables = model.init(RNG, X)
        loss = lambda p: jnp.sum(
            model.apply({**variables, "params": p}, X, mutable=["counters"])[0] ** 2
        )
        grad = jax.grad(loss)
        with pytest.raises(joe.ClosedOverDifferentiationError, match=r"cell.*closure_convert"):
            (jax.jit(grad) if jit else grad)(variables["params"])


def test_jaxopt_implicit_gradient_with_a_writing_function_is_refused():
    """jaxopt's ``bwd`` calls the map again; a write there could never come out of a
    backward pass: refused at the write, naming the unrolled mode."""
    model = PassedToRun(write=True)
    with interposed("jaxopt"), jaxoverride_linen.context():
        variables = model.init(RNG, X)
        _, after = model.apply(variables, X, mutable=["counters"])
        assert int(after["counters"]["calls"]) > 2  # the forward pass writes its count
        loss = lambda p: jnp.sum(
            model.apply({**variables, "params": p}, X, mutable=["counters"])[0] ** 2
        )
        with pytest.raises(joe.PureFunctionWriteError, match=r"backward.*implicit_diff=False"):
            jax.grad(loss)(variables["params"])


# -- the Equinox family, in fresh interpreters ----------------------------------------------

GROUPS = {
    "optimistix": ["fixed_point_iteration", "fixed_point_newton", "root_find_newton"],
    "lineax_diffrax": ["linear_solve_gmres", "neural_ode_tsit5"],
    "issues": ["diffrax_115", "flax_2887"],
}
SCRIPT = FreshScript(
    Path(__file__).with_name("_equinox_linen.py"), GROUPS, [jo, jaxoverride_linen], timeout=900
)
CASES = SCRIPT.cases(besides="issues")
_env, _reported = SCRIPT.env, SCRIPT.reported


@pytest.fixture(params=CASES, ids=[case for _, case in CASES])
def result(request) -> dict[str, Any]:
    return _reported(*request.param)


def test_init_creates_the_parameters_once_and_leaks_nothing(result):
    assert result["params"]["params"] == result["direct_params"]["params"]
    assert result["jit_init"] <= 1e-6  # eager and jitted init: the same variables (1 ulp)
    assert result["init_output"] <= 1e-6  # init_with_output returns what apply returns
    assert result["tracers"] == 0
    # Nothing of the adapter's keeps a tracer of the eager calls: with the library's caches
    # cleared, none is alive (under jax 0.11 also where checking_leaks cannot run).
    assert result["tracers_alive"] == 0


EVERY_CASE = [*CASES, *(("issues", case) for case in GROUPS["issues"])]


@pytest.mark.parametrize(("group", "case"), EVERY_CASE, ids=[case for _, case in EVERY_CASE])
def test_eager_init_and_apply_pass_jax_checking_leaks(group, case):
    """The eager ``init`` and ``apply`` ran inside ``jax.checking_leaks()`` (a leak would
    have crashed the script), except where the library leaks by itself under jax 0.11."""
    if case in UPSTREAM_LEAK_CASES:
        pytest.skip(UPSTREAM_LEAK_UNDER_JAX_011)
    assert _reported(group, case)["checking_leaks"] is True


def test_apply_and_jit_apply_equal_the_explicit_library_call(result):
    assert result["apply"] <= 1e-5
    assert result["jit_apply"] <= 1e-5


def test_install_works_as_the_context_does(result):
    assert result["installed_params"] == 0.0
    assert result["installed_apply"] <= 1e-5


def test_gradients_wrt_variables_and_inputs_equal_the_explicit_ones(result):
    assert result["grad_scale"] > 0.1  # O(1) gradients: a wrong or missing term would show
    assert result["grad"] <= 1e-5 * result["grad_scale"] + 1e-6
    assert result["jit_grad"] <= 1e-5 * result["grad_scale"] + 1e-6


@pytest.mark.parametrize("where", REFUSALS)
def test_writes_and_rng_draws_in_the_callback_are_refused(result, where):
    assert_callback_refusal(result, where, written="counters", drawn="rng", why="could come out")


def test_a_write_outside_the_callback_works(result):
    """The fix the refusal names: the same write, before the library call, is kept."""
    assert result["write_outside"] <= 1e-5
    assert result["write_outside_calls"] == 2  # one at init, one at apply


_UPSTREAM_LEAK = """
import equinox as eqx, equinox.internal as eqxi, jax, jax.numpy as jnp

def f(x):
    z = x * 2.0
    g = eqx.filter_closure_convert(lambda a: z + a, x)  # closes over the tracer z
    eqxi.cached_filter_eval_shape(g, x)  # as lineax's Jacobian operators do
    return g(x)

try:
    with jax.checking_leaks():
        jax.jit(f)(jnp.ones(3))
    print("no leak")
except Exception as error:
    print("leak" if "Leaked trace" in str(error) else repr(error))
"""


def test_the_upstream_leak_that_turns_checking_leaks_off_is_still_there():
    """Raw equinox under plain ``jax.jit``, no jaxoverride: under jax 0.11 the closure-
    converted function's jaxpr holds the tracer it closes over, and equinox's cached
    ``filter_eval_shape`` keeps that jaxpr: ``jax.checking_leaks()`` raises. Before 0.11 it
    does not. If this fails under 0.11, upstream fixed it: empty ``UPSTREAM_LEAK_CASES``."""
    found = run_fresh(["-c", _UPSTREAM_LEAK], _env(), timeout=300).strip().splitlines()[-1]
    assert found == ("leak" if UPSTREAM_LEAK_CASES else "no leak")


def _reported_issue(case: str) -> dict[str, Any]:
    """The report on an issue's program, which fails without the adapter: raw (the check
    off) with ``UnexpectedTracerError``, and with ``MissingAdapterError`` naming Linen."""
    reported = _reported("issues", case)
    assert reported["raw"]["type"] == "UnexpectedTracerError", reported["raw"]
    assert reported["unadapted"]["type"] == "MissingAdapterError", reported["unadapted"]
    assert "Flax Linen" in reported["unadapted"]["message"]
    assert reported["tracers"] == 0  # with the adapter, nothing leaked
    assert reported["tracers_alive"] == 0  # nor kept alive, the library's caches cleared
    return reported


def _assert_at_most(reported: dict[str, Any], **bounds: float) -> None:
    for name, bound in bounds.items():
        assert reported[name] <= bound, f"{name}: {reported[name]} > {bound}"


def test_diffrax_issue_115_program_works():
    """diffrax #115: ``diffeqsolve`` inside an ``nn.compact`` module under
    ``jax.jit(model.init)``. Raw (the missing-adapter check off), it raises
    ``UnexpectedTracerError``; with the check on, ``MissingAdapterError``; with the adapter
    installed, the reporter's program runs unchanged and equals diffrax on the explicit
    parameters, gradients included."""
    reported = _reported_issue("diffrax_115")
    assert reported["params"] == {"params": {"derivative_net": {"bias": [4], "kernel": [4, 4]}}}
    _assert_at_most(reported, eager_init=1e-6, apply=1e-5, grad=1e-4)


def test_flax_issue_2887_program_works():
    """flax #2887: ``diffeqsolve`` over a submodule defined in ``setup``, eager
    ``node.init``. With the adapter, no unbinding workaround is needed: init and apply,
    eager and jitted, equal diffrax on the explicit parameters. (Raw, today's Flax no longer
    raises the reported ``JaxTransformError``: the tracer leaks, ``UnexpectedTracerError``,
    with the missing-adapter check off; with it on, ``MissingAdapterError``.)"""
    reported = _reported_issue("flax_2887")
    assert reported["params"] == {"params": {"ode_term": {"bias": [1], "kernel": [1, 1]}}}
    _assert_at_most(reported, jit_init=1e-6, apply=1e-6, jit_apply=1e-6)
