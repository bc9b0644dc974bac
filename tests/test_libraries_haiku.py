"""Unmodified installed solver libraries with Haiku modules in their callbacks.

Each library runs unchanged; ``jo.interpose`` rebinds its ``jax``/``lax`` globals to the
neutral API and ``jaxoverride_haiku`` makes those calls work inside ``hk.transform``. Every
"works" case is checked both ways: raw (fails) and interposed (init and apply, eager and
under ``jax.jit``, equal to the same library run on the explicit parameters outside Haiku).
Every "does not work" case pins its failure mode.
"""

from __future__ import annotations

import contextlib
from typing import Any

import diffrax
import haiku as hk
import jax
import jax.numpy as jnp
import jaxopt
import lineax
import numpy as np
import optax
import optimistix as optx
import pytest

import jaxoverride as jo
import jaxoverride_haiku as joh
from _libraries import EQUINOX_FAMILY, eager_calls, interposed

N = 4
X = jnp.linspace(-1.0, 1.0, N)
RNG = jax.random.PRNGKey(0)
SOLVERS = {"fixed_point": jaxopt.FixedPointIteration, "anderson": jaxopt.AndersonAcceleration}


def cell(layer: hk.Linear, z: jax.Array, x: jax.Array) -> jax.Array:
    """A contraction with Haiku parameters and a call counter in Haiku state."""
    calls = hk.get_state("calls", [], jnp.int32, init=jnp.zeros)
    hk.set_state("calls", calls + 1)
    return jnp.tanh(layer(z) + x)


def jaxopt_model(solver: str, implicit_diff: bool) -> hk.TransformedWithState:
    def forward(x: jax.Array) -> jax.Array:
        layer = hk.Linear(N, w_init=hk.initializers.RandomNormal(0.2), name="cell")
        fixed_point = SOLVERS[solver](
            fixed_point_fun=lambda z: cell(layer, z, x),
            maxiter=50,
            tol=1e-5,
            implicit_diff=implicit_diff,
        )
        return fixed_point.run(jnp.zeros(N)).params

    return hk.transform_with_state(forward)


def explicit_solve(params: hk.Params, solver: str, fun=None) -> jax.Array:
    """The same library call outside Haiku, on the explicit parameters."""
    w, b = params["cell"]["w"], params["cell"]["b"]
    fun = fun or (lambda z: jnp.tanh(z @ w + b + X))
    fixed_point = SOLVERS[solver](fixed_point_fun=fun, maxiter=50, tol=1e-5, implicit_diff=False)
    return fixed_point.run(jnp.zeros(N)).params


def run_interposed(model: hk.TransformedWithState) -> tuple[Any, ...]:
    """Init and apply (eager, leaks checked) and jitted apply, with jaxopt interposed.

    Returns ``(params, state, out, state after apply, jitted out, state after it)``.
    """
    with jax.checking_leaks():
        params, state = model.init(RNG, X)
        out, after = model.apply(params, state, None, X)
    # (checking_leaks flags JAX's own separate_consts cache under an outer jit; a leak
    # into Haiku state would come back as a tracer and fail the comparisons of the tests.)
    jitted, after_jit = jax.jit(model.apply)(params, state, None, X)
    return params, state, out, after, jitted, after_jit


def assert_solves_explicitly(params: hk.Params, solver: str, *outs: jax.Array) -> None:
    """The parameters have Haiku's shapes and every output is the explicit solve's."""
    assert jax.tree.map(jnp.shape, params) == {"cell": {"b": (N,), "w": (N, N)}}
    expected = explicit_solve(params, solver)
    for out in outs:
        np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("solver", list(SOLVERS))
def test_jaxopt_raw_fails_inside_haiku(solver):
    """Without jaxoverride, the state written in the jitted/looped callback leaks out."""
    model = jaxopt_model(solver, implicit_diff=True)

    def init_and_apply():
        params, state = model.init(RNG, X)
        return model.apply(params, state, None, X)[1]["~"]["calls"] + 1

    with pytest.raises(jax.errors.UnexpectedTracerError):
        init_and_apply()


@pytest.mark.parametrize("solver", list(SOLVERS))
def test_jaxopt_works_inside_haiku(solver):
    """``implicit_diff=False``: init and apply, eager and jitted, equal the explicit solve."""
    model = jaxopt_model(solver, implicit_diff=False)
    with interposed("jaxopt"), joh.context():
        params, _, out, after, jitted, after_jit = run_interposed(model)
    assert_solves_explicitly(params, solver, out, jitted)
    # The counter advanced once per callback call, as the eager library would call it.
    assert int(after["~"]["calls"]) == int(after_jit["~"]["calls"]) > 2
    if solver == "fixed_point":  # (eager Anderson under disable_jit is too slow to repeat)
        w, b = params["cell"]["w"], params["cell"]["b"]
        calls = eager_calls(
            lambda f: explicit_solve(params, solver, f), lambda z: jnp.tanh(z @ w + b + X)
        )
        assert int(after["~"]["calls"]) == calls


@pytest.mark.parametrize("solver", list(SOLVERS))
def test_jaxopt_implicit_diff_works_inside_haiku(solver):
    """The default ``implicit_diff=True``: jaxopt wraps ``run`` in ``jax.custom_vjp``, which
    interposition makes ``jo.custom_vjp``: ``run`` runs in the rule's primal function with
    Haiku's values as an argument, so the state written in its loop comes out once, eager
    and under ``jax.jit``, as with ``implicit_diff=False``."""
    model = jaxopt_model(solver, implicit_diff=True)
    unrolled = jaxopt_model(solver, implicit_diff=False)
    with interposed("jaxopt"), joh.context():
        params, state, out, after, jitted, after_jit = run_interposed(model)
        _, after_unrolled = unrolled.apply(params, state, None, X)
    assert int(state["~"]["calls"]) == 0
    assert_solves_explicitly(params, solver, out, jitted)
    assert int(after["~"]["calls"]) == int(after_jit["~"]["calls"]) > 2
    assert int(after["~"]["calls"]) == int(after_unrolled["~"]["calls"])


def passed_to_run_model(write_state: bool = False) -> hk.TransformedWithState:
    """jaxopt's documented way to differentiate: what the function needs goes to ``run``."""

    def forward(x: jax.Array) -> jax.Array:
        w = hk.get_parameter("w", [N, N], init=hk.initializers.RandomNormal(0.2))
        b = hk.get_parameter("b", [N], init=jnp.zeros)

        def fun(z, w, b, x):
            if write_state:
                hk.set_state("calls", hk.get_state("calls", [], jnp.int32, init=jnp.zeros) + 1)
            return jnp.tanh(z @ w + b + x)

        fixed_point = jaxopt.FixedPointIteration(fixed_point_fun=fun, maxiter=100, tol=1e-6)
        return fixed_point.run(jnp.zeros(N), w, b, x).params

    return hk.transform_with_state(forward)


def unrolled_loss(params: hk.Params) -> jax.Array:
    z = jnp.zeros(N)
    for _ in range(100):
        z = jnp.tanh(z @ params["~"]["w"] + params["~"]["b"] + X)
    return jnp.sum(z**2)


@pytest.mark.parametrize("mode", ["grad", "jit-grad", "grad-jit"])
def test_jaxopt_implicit_gradient_wrt_params_passed_to_run_equals_unrolled(mode):
    """Parameters passed to ``run`` are explicit arguments of jaxopt's rule: its implicit
    gradient equals backpropagation through the unrolled iteration. (An input closed over
    by the fixed-point function fails under ``jax.grad(jax.jit(...))`` in raw JAX too:
    jaxopt's ``bwd``, traced after the jit trace ended, closes over its tracer.)"""
    model = passed_to_run_model()
    with interposed("jaxopt"), joh.context():
        params, state = model.init(RNG, X)
        apply = jax.jit(model.apply) if mode == "grad-jit" else model.apply
        grad = jax.grad(lambda p: jnp.sum(apply(p, state, None, X)[0] ** 2))
        with jax.checking_leaks():
            got = (jax.jit(grad) if mode == "jit-grad" else grad)(params)
    expected = jax.grad(unrolled_loss)(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, expected)
    assert float(jnp.abs(got["~"]["w"]).sum()) > 0


@pytest.mark.parametrize("jit", [False, True], ids=["grad", "jit-grad"])
def test_jaxopt_implicit_gradient_wrt_closed_over_params_is_refused(jit):
    """A parameter the fixed-point function closes over is not an argument of jaxopt's
    rule, which would give it a silently zero gradient: refused, naming the fix."""
    model = jaxopt_model("fixed_point", implicit_diff=True)
    with interposed("jaxopt"), joh.context():
        params, state = model.init(RNG, X)
        grad = jax.grad(lambda p: jnp.sum(model.apply(p, state, None, X)[0] ** 2))
        with pytest.raises(joh.ClosedOverDifferentiationError, match=r"'cell/w'.*closure_convert"):
            (jax.jit(grad) if jit else grad)(params)


def test_jaxopt_implicit_gradient_with_a_state_writing_function_is_refused():
    """jaxopt's ``bwd`` calls the fixed-point function again; a state write there could
    never come out of a backward pass: refused at the write, naming the unrolled mode."""
    model = passed_to_run_model(write_state=True)
    with interposed("jaxopt"), joh.context():
        params, state = model.init(RNG, X)
        _, after = model.apply(params, state, None, X)
        assert int(after["~"]["calls"]) > 2  # the forward pass writes its count
        with pytest.raises(joh.PureFunctionWriteError, match=r"backward rule.*implicit_diff=False"):
            jax.grad(lambda p: jnp.sum(model.apply(p, state, None, X)[0] ** 2))(params)


def test_jaxopt_unrolled_gradient_wrt_haiku_params():
    """``implicit_diff=False`` differentiates the (scan) loop: equal to the explicit gradient."""
    model = jaxopt_model("fixed_point", implicit_diff=False)
    with interposed("jaxopt"), joh.context(), jax.checking_leaks():
        params, state = model.init(RNG, X)
        grads = jax.grad(lambda p: jnp.sum(model.apply(p, state, None, X)[0] ** 2))(params)
    expected = jax.grad(lambda p: jnp.sum(explicit_solve(p, "fixed_point") ** 2))(params)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads, expected
    )


class CountingOperator(hk.Module):
    """A linear operator that counts its applications in Haiku state."""

    def __call__(self, v: jax.Array) -> jax.Array:
        calls = hk.get_state("calls", [], jnp.int32, init=jnp.zeros)
        hk.set_state("calls", calls + 1)
        return hk.Linear(N, with_bias=False, name="linear")(v)


def spectral_radius(v0: jax.Array):
    return optax.power_iteration(
        CountingOperator(name="op"), v0=v0, num_iters=30, error_tolerance=0.0
    )


def test_optax_power_iteration_raw_and_interposed():
    model = hk.transform_with_state(spectral_radius)
    params, state = model.init(RNG, X)
    _, state = model.apply(params, state, None, X)
    with pytest.raises(jax.errors.UnexpectedTracerError):
        state["op"]["calls"] + 1  # the count leaked out of the loop as a tracer

    joh.install()  # process-wide, but active only inside Haiku transforms
    try:
        with interposed("optax"), jax.checking_leaks():
            params, state = model.init(RNG, X)
            (value, vector), after = model.apply(params, state, None, X)
    finally:
        joh.uninstall()
    w = params["op/linear"]["w"]
    expected_value, expected_vector = optax.power_iteration(
        w.T, v0=X, num_iters=30, error_tolerance=0.0
    )
    np.testing.assert_allclose(value, expected_value, rtol=1e-5)
    np.testing.assert_allclose(vector, expected_vector, rtol=1e-4, atol=1e-5)
    assert int(after["op"]["calls"]) == eager_calls(
        lambda f: optax.power_iteration(f, v0=X, num_iters=30, error_tolerance=0.0),
        lambda v: v @ w,
    )


def optimistix_forward(x: jax.Array, create_first: bool = False) -> jax.Array:
    layer = hk.Linear(N, w_init=hk.initializers.RandomNormal(0.2), name="cell")
    if create_first:
        layer(x)  # the parameters exist before the library's trace reads them
    solver = optx.FixedPointIteration(rtol=1e-6, atol=1e-6)
    fun = lambda z, args: jnp.tanh(layer(z) + x)
    return optx.fixed_point(fun, solver, jnp.zeros(N), max_steps=50).value


def test_optimistix_fails_at_init_even_interposed():
    """``optx.fixed_point`` is ``eqx.filter_jit``-compiled at import: the raw ``jax.jit`` lives
    inside an equinox ``_JitWrapper``, out of interposition's reach, and inside it the callback
    is closure-converted with ``jax.make_jaxpr``. Haiku creates the parameters inside that
    trace; the first-call check refuses the call instead of letting them leak out of init,
    and names the fix."""
    model = hk.transform(optimistix_forward)
    with interposed(*EQUINOX_FAMILY), joh.context():
        with pytest.raises(jo.errors.MissingAdapterError, match="interpose_on_import"):
            model.init(RNG, X)
    jo.set_adapter_check(False)  # the escape hatch shows the silent failure it stood for
    try:
        with interposed(*EQUINOX_FAMILY), joh.context():
            params = model.init(RNG, X)
            assert isinstance(params["cell"]["w"], jax.core.Tracer)  # leaked out of init
            with pytest.raises(jax.errors.UnexpectedTracerError):
                model.apply(params, None, X)
    finally:
        jo.set_adapter_check(True)


def diffrax_forward(x: jax.Array) -> jax.Array:
    layer = hk.Linear(N, w_init=hk.initializers.RandomNormal(0.2), name="cell")
    term = diffrax.ODETerm(lambda t, y, _: jnp.tanh(layer(y) + x) - y)
    return diffrax.diffeqsolve(term, diffrax.Tsit5(), 0.0, 1.0, 0.25, jnp.zeros(N)).ys[-1]


def lineax_forward(x: jax.Array) -> jax.Array:
    layer = hk.Linear(N, w_init=hk.initializers.RandomNormal(0.2), name="cell")
    operator = lineax.FunctionLinearOperator(lambda v: v - 0.5 * layer(v), jnp.zeros(N))
    return lineax.linear_solve(operator, x, lineax.GMRES(rtol=1e-6, atol=1e-6)).value


def test_diffrax_fails_inside_haiku_even_interposed():
    """As optimistix: ``filter_jit`` compiled at import puts the callback in a trace that no
    adapter sees, so Haiku's parameters escape as tracers (issue 12: interpose on import)."""
    model = hk.transform(diffrax_forward)
    for interposing in (False, True):
        with contextlib.ExitStack() as stack:
            if interposing:
                stack.enter_context(interposed(*EQUINOX_FAMILY))
                stack.enter_context(joh.context())
            with pytest.raises(jax.errors.UnexpectedTracerError):
                model.apply(model.init(RNG, X), None, X)


def test_lineax_works_inside_haiku_once_interposed():
    """Raw, lineax's closure conversion creates the parameters inside ``jax.make_jaxpr``,
    where they leak; interposed, the Haiku adapter's ``closure_convert``/``make_jaxpr``
    create them first, once, and the solve equals lineax's on the explicit weights."""
    model = hk.transform(lineax_forward)
    with pytest.raises(jax.errors.UnexpectedTracerError):
        model.apply(model.init(RNG, X), None, X)
    with interposed(*EQUINOX_FAMILY), joh.context():
        params = model.init(RNG, X)
        out = model.apply(params, None, X)
    assert list(params) == ["cell"]
    w, b = params["cell"]["w"], params["cell"]["b"]
    operator = lineax.FunctionLinearOperator(lambda v: v - 0.5 * (v @ w + b), jnp.zeros(N))
    expected = lineax.linear_solve(operator, X, lineax.GMRES(rtol=1e-6, atol=1e-6)).value
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)


def test_optimistix_read_only_workaround_needs_no_jaxoverride():
    """Creating the parameters before the call makes a read-only model work, raw."""
    params = hk.transform(lambda x: optimistix_forward(x, create_first=True)).init(RNG, X)
    out = hk.transform(optimistix_forward).apply(params, None, X)
    expected = explicit_solve(params, "fixed_point")
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
