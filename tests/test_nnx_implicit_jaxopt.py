"""jaxopt 0.8.5 with its default ``implicit_diff=True``, interposed, under ``track``.

``implicit_diff=True`` wraps ``run`` in ``jax.custom_vjp`` (jaxopt's ``custom_root``);
interposed, that is ``jo.custom_vjp``, which the NNX adapter lifts. The fixed-point
function may write tracked state in the forward pass (eager and under ``jo.jit``), and
gradients with respect to the parameters passed to ``run`` equal backpropagation through
the unrolled iteration. jaxopt's backward pass calls the fixed-point function again: a
write there is refused, with every Variable left as it was. (A closed-over module under
``jo.grad`` is refused too: ``tests/test_libraries_nnx.py``.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jaxopt
import numpy as np
import pytest
from flax import nnx

import jaxoverride as jo
import jaxoverride_nnx as jon
from _libraries import interposed

N = 4
X = jnp.linspace(-1.0, 1.0, N)
W = jax.random.normal(jax.random.key(0), (N, N)) * 0.2
SOLVERS = {"fixed_point": jaxopt.FixedPointIteration, "anderson": jaxopt.AndersonAcceleration}


class Cell(nnx.Module):
    """``z -> tanh(z @ w + x)`` with ``w`` passed to ``run``; counts its calls if asked."""

    def __init__(self, counting: bool):
        self.calls = nnx.Variable(jnp.array(0))
        self.counting = counting

    def __call__(self, z: jax.Array, w: jax.Array) -> jax.Array:
        if self.counting:
            self.calls[...] += 1
        return jnp.tanh(z @ w + X)


def solve(fun, w, solver="fixed_point", implicit_diff=True):
    options = {"maxiter": 100, "tol": 1e-6, "implicit_diff": implicit_diff}
    return SOLVERS[solver](fixed_point_fun=fun, **options).run(jnp.zeros(N), w).params


def loss(fun, solver, implicit_diff=True):
    return lambda w: jnp.sum(solve(fun, w, solver, implicit_diff) ** 2)


@pytest.mark.parametrize("solver", list(SOLVERS))
def test_forward_writes_state_inside_the_fixed_point_function_eager_and_jitted(solver):
    model = Cell(counting=True)
    reference = solve(lambda z, w: jnp.tanh(z @ w + X), W, solver)
    with interposed("jaxopt"), jon.track(model), jax.checking_leaks():
        z = solve(model, W, solver)
        counted = int(model.calls[...])
        jitted = jo.jit(lambda w: solve(model, w, solver))(W)
    np.testing.assert_allclose(z, reference, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(jitted, z, rtol=1e-6, atol=1e-6)
    assert counted > 2, "the state written inside the solve came out"
    assert int(model.calls[...]) == 2 * counted, "the jitted solve counted as the eager one"


@pytest.mark.parametrize("jit", [False, True], ids=["grad", "jit-value_and_grad"])
@pytest.mark.parametrize("solver", list(SOLVERS))
def test_gradient_wrt_the_parameters_passed_to_run_equals_the_unrolled_one(solver, jit):
    model = Cell(counting=False)
    explicit = lambda z, w: jnp.tanh(z @ w + X)
    unrolled = jax.jit(jax.grad(loss(explicit, solver, implicit_diff=False)))(W)
    with interposed("jaxopt"), jon.track(model), jax.checking_leaks():
        if jit:
            value, got = jo.jit(jo.value_and_grad(loss(model, solver)))(W)
            np.testing.assert_allclose(value, loss(explicit, solver)(W), rtol=1e-5)
        else:
            got = jo.grad(loss(model, solver))(W)
    np.testing.assert_allclose(got, unrolled, rtol=1e-4, atol=1e-5)
    assert float(jnp.abs(got).sum()) > 0


def test_a_write_in_the_backward_pass_is_refused_and_nothing_changes():
    model = Cell(counting=True)
    with interposed("jaxopt"), jon.track(model), jax.checking_leaks():
        implicit = jo.grad(loss(model, "fixed_point"))
        for grad in (implicit, jo.jit(implicit)):
            refused = r"bwd.*`Cell.calls`.*implicit_diff=False"
            with pytest.raises(jon.PureFunctionWriteError, match=refused):
                grad(W)
            assert int(model.calls[...]) == 0
        # The fix the error names: the non-implicit mode differentiates the loop itself.
        jo.grad(loss(model, "fixed_point", implicit_diff=False))(W)
    assert int(model.calls[...]) > 2
