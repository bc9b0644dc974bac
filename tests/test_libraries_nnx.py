"""Unmodified installed solver libraries with Flax NNX modules in their callbacks.

The callbacks close over an NNX module that counts its calls in an ``nnx.Variable``. Raw,
every library below fails with NNX's ``TraceContextError``; jaxopt and optax work after
``jo.interpose`` inside ``jaxoverride_nnx.track(model)``, with outputs, call counts and
gradients with respect to the ``nnx.Param`` equal to references on explicit arrays. The
equinox-based libraries (optimistix, diffrax, lineax) refuse a state-writing callback with
``PureFunctionWriteError``; their read-only cases are in ``test_libraries_equinox_nnx.py``.
"""

from __future__ import annotations

import diffrax
import jax
import jax.numpy as jnp
import jaxopt
import lineax
import numpy as np
import optax
import optimistix as optx
import pytest
from flax import nnx
from flax.errors import TraceContextError

import jaxoverride as jo
import jaxoverride_nnx as jon
from _libraries import EQUINOX_FAMILY, eager_calls, interposed

N = 4
X = jnp.linspace(-1.0, 1.0, N)
SOLVERS = {"fixed_point": jaxopt.FixedPointIteration, "anderson": jaxopt.AndersonAcceleration}


class Cell(nnx.Module):
    """A contraction ``z -> tanh(z @ w + x)`` that counts its calls."""

    def __init__(self, counting: bool = True):
        self.w = nnx.Param(jax.random.normal(jax.random.key(0), (N, N)) * 0.2)
        self.calls = nnx.Variable(jnp.array(0))
        self.counting = counting

    def __call__(self, z: jax.Array) -> jax.Array:
        if self.counting:
            self.calls[...] += 1
        return jnp.tanh(z @ self.w[...] + X)


def jaxopt_solve(fun, solver: str, implicit_diff: bool = False) -> jax.Array:
    fixed_point = SOLVERS[solver](
        fixed_point_fun=fun, maxiter=50, tol=1e-5, implicit_diff=implicit_diff
    )
    return fixed_point.run(jnp.zeros(N)).params


def explicit(w: jax.Array):
    return lambda z: jnp.tanh(z @ w + X)


@pytest.mark.parametrize("solver", list(SOLVERS))
def test_jaxopt_raw_fails_with_nnx(solver):
    model = Cell()
    with pytest.raises(TraceContextError, match="Cannot mutate Variable"):
        jaxopt_solve(model, solver)


@pytest.mark.parametrize("solver", list(SOLVERS))
def test_jaxopt_works_with_nnx(solver):
    """Solution, call count and gradient wrt the nnx.Param equal the explicit references."""
    model = Cell()
    w = model.w[...]
    with interposed("jaxopt"), jon.track(model), jax.checking_leaks():
        z = jaxopt_solve(model, solver)
        solved = int(model.calls[...])
        jitted = jo.jit(lambda: jaxopt_solve(model, solver))()

    np.testing.assert_allclose(z, jaxopt_solve(explicit(w), solver), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(jitted, z, rtol=1e-6, atol=1e-6)
    assert int(model.calls[...]) == 2 * solved  # the jitted solve counted as the eager one
    if solver == "fixed_point":  # (eager Anderson under disable_jit is too slow to repeat)
        assert solved == eager_calls(lambda f: jaxopt_solve(f, solver), explicit(w)) > 2


def test_jaxopt_gradient_wrt_nnx_param():
    """``implicit_diff=False``: reverse mode through jaxopt's scan, module as the argument."""
    model = Cell()
    w = model.w[...]
    with interposed("jaxopt"), jon.track(model), jax.checking_leaks():
        grads = jo.grad(lambda m: jnp.sum(jaxopt_solve(m, "fixed_point") ** 2))(model)
    expected = jax.grad(lambda w: jnp.sum(jaxopt_solve(explicit(w), "fixed_point") ** 2))(w)
    assert isinstance(grads, nnx.State)
    np.testing.assert_allclose(grads["w"][...], expected, rtol=1e-5, atol=1e-6)
    assert int(model.calls[...]) == eager_calls(
        lambda f: jaxopt_solve(f, "fixed_point"), explicit(w)
    )


def test_jaxopt_raw_serves_stale_weights_and_interposed_does_not():
    """A solver object built once jits its ``update`` once (``jax.jit(self.update)``): raw,
    a read-only model's weights are baked in as constants and an update goes unseen."""
    model = Cell(counting=False)
    fixed_point = jaxopt.FixedPointIteration(fixed_point_fun=model, maxiter=50, tol=1e-5)
    before = fixed_point.run(jnp.zeros(N)).params
    model.w[...] = 2 * model.w[...]
    fresh = jaxopt_solve(explicit(model.w[...]), "fixed_point")
    stale = fixed_point.run(jnp.zeros(N)).params
    np.testing.assert_array_equal(stale, before)
    assert not np.allclose(stale, fresh, atol=1e-3)

    with interposed("jaxopt"), jon.track(model):
        fixed_point = jaxopt.FixedPointIteration(fixed_point_fun=model, maxiter=50, tol=1e-5)
        first = fixed_point.run(jnp.zeros(N)).params
        model.w[...] = model.w[...] / 2
        second = fixed_point.run(jnp.zeros(N)).params
    np.testing.assert_allclose(first, fresh, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(second, before, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("solver", ["fixed_point"])
def test_jaxopt_implicit_diff_gradient_is_refused_for_a_closed_over_module(solver):
    """``implicit_diff=True`` (the default) wraps ``run`` in ``jax.custom_vjp``, which
    differentiates only ``run``'s explicit arguments: the module is closed over, so its
    gradient would be silently zero. Interposed, the rule is the neutral one, and the NNX
    adapter refuses the read of a Variable being differentiated. The forward pass works."""
    model = Cell()
    with interposed("jaxopt"), jon.track(model):
        z = jaxopt_solve(model, solver, implicit_diff=True)
        np.testing.assert_allclose(z, jaxopt_solve(explicit(model.w[...]), solver), atol=1e-6)
        before = int(model.calls[...])
        with pytest.raises(jon.ClosedOverDifferentiationError, match=r"Cell\.w.*closure_convert"):
            jo.grad(lambda m: jnp.sum(jaxopt_solve(m, solver, implicit_diff=True) ** 2))(model)
    assert int(model.calls[...]) == before  # the failure left the module as it was


def test_optax_power_iteration_with_nnx():
    layer = nnx.Linear(N, N, use_bias=False, rngs=nnx.Rngs(0))
    layer.calls = nnx.Variable(jnp.array(0))

    def operator(v: jax.Array) -> jax.Array:
        layer.calls[...] += 1
        return layer(v)

    with pytest.raises(TraceContextError):
        optax.power_iteration(operator, v0=X, num_iters=30)
    layer.calls[...] = 0  # the raw call counted its first, eager, application
    with interposed("optax"), jon.track(layer), jax.checking_leaks():
        value, vector = optax.power_iteration(operator, v0=X, num_iters=30, error_tolerance=0.0)
    w = layer.kernel[...]
    expected_value, expected_vector = optax.power_iteration(
        w.T, v0=X, num_iters=30, error_tolerance=0.0
    )
    np.testing.assert_allclose(value, expected_value, rtol=1e-5)
    np.testing.assert_allclose(vector, expected_vector, rtol=1e-4, atol=1e-5)
    # error_tolerance=0.0: exactly num_iters steps, so the count is exact: 1 + 30.
    assert int(layer.calls[...]) == eager_calls(
        lambda f: optax.power_iteration(f, v0=X, num_iters=30, error_tolerance=0.0),
        lambda v: v @ w,
    )


def optimistix_solve(model: Cell) -> jax.Array:
    solver = optx.FixedPointIteration(rtol=1e-6, atol=1e-6)
    return optx.fixed_point(lambda z, _: model(z), solver, jnp.zeros(N), max_steps=50).value


def diffrax_solve(model: Cell) -> jax.Array:
    term = diffrax.ODETerm(lambda t, y, _: model(y) - y)
    return diffrax.diffeqsolve(term, diffrax.Tsit5(), 0.0, 1.0, 0.25, X).ys[-1]


def lineax_solve(model: Cell) -> jax.Array:
    operator = lineax.FunctionLinearOperator(lambda v: v - 0.5 * model(v), jnp.zeros(N))
    return lineax.linear_solve(operator, X, lineax.GMRES(rtol=1e-6, atol=1e-6)).value


# A state-writing callback cannot work in these libraries: each closure-converts it with
# ``jax.make_jaxpr`` (``eqx.filter_closure_convert``) into a jaxpr with fixed outputs. The
# NNX override of ``make_jaxpr`` refuses the write with ``PureFunctionWriteError``, even
# when the packages were interposed after import (``tests/test_libraries_equinox_nnx.py``
# runs them interposed on import, read-only models included). Interposed only after import,
# optimistix's and diffrax's import-time ``filter_jit`` is raw: the first-call check refuses
# the tracked module it would capture before the closure conversion runs.
EQUINOX_CASES = {
    "optimistix": (optimistix_solve, jo.errors.MissingAdapterError),
    "diffrax": (diffrax_solve, jo.errors.MissingAdapterError),
    "lineax": (lineax_solve, jon.PureFunctionWriteError),
}


@pytest.mark.parametrize("library", list(EQUINOX_CASES))
def test_equinox_libraries_refuse_state_writes_interposed(library):
    solve, error = EQUINOX_CASES[library]
    model = Cell()
    with pytest.raises(TraceContextError, match="Cannot mutate Variable"):
        solve(model)
    with interposed(*EQUINOX_FAMILY), jon.track(model):
        with pytest.raises(error):
            solve(model)
    assert int(model.calls[...]) == 0


@pytest.mark.parametrize("library", list(EQUINOX_CASES))
def test_equinox_libraries_read_only_need_no_jaxoverride(library):
    """A read-only module works raw: the callback is a new closure per call, hence static
    data that ``filter_jit`` retraces for, so the weights are never stale."""
    solve, _ = EQUINOX_CASES[library]
    model = Cell(counting=False)
    first = solve(model)
    model.w[...] = 2 * model.w[...]
    second = solve(model)
    reference = Cell(counting=False)
    reference.w[...] = model.w[...]
    assert not np.allclose(first, second, atol=1e-4)
    np.testing.assert_allclose(second, solve(reference), rtol=1e-6, atol=1e-6)
