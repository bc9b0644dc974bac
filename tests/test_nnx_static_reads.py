"""Reads that a cache bakes in: a ``jit``'s static arguments, and modules reached by any path.

``jo.jit(fixed_point, static_argnums=0)`` (the README's solver pattern) caches its trace by
the static function. A function that reads an NNX module there reads it as constants: a
second call with the same function after the weights changed returns the first result.
Without ``track``, or under ``track`` of another module, that read raises
``MissingAdapterError`` where JAX traces (so a cache hit pays nothing), whatever the
static argument is: a closure, the module, a bound method, a ``functools.partial`` or an
object holding the module. Under ``track`` of the module the result is fresh.

A tracked module that a traced function reaches by a path the adapter's first guess
misses (an object's attribute, as jaxopt's solver objects hold the fixed-point function)
holds a probe while the function is traced; a read of the probe (``variable.value``) is
the adapter's own, never a stale read, so it traces again with the module given.
"""

from __future__ import annotations

import contextlib
import functools
import textwrap
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jaxopt
import numpy as np
import pytest
from flax import nnx

import jaxoverride as jo
import jaxoverride_nnx
from _libraries import fresh_env, interposed, run_fresh
from jaxoverride import lax as jlax


def fixed_point(f: Callable[[jax.Array], jax.Array], z0: jax.Array) -> jax.Array:
    return jlax.while_loop(lambda z: jnp.linalg.norm(f(z) - z) > 1e-5, f, z0)


class Holder:
    """A plain object holding the module, as a solver object holds its function."""

    def __init__(self, module: nnx.Module):
        self.module = module

    def step(self, z: jax.Array) -> jax.Array:
        return jnp.tanh(self.module(z) + 1.0)


def _layer() -> nnx.Linear:
    layer = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    layer.kernel[...] = jnp.eye(2) * 0.3
    bias = layer.bias
    assert bias is not None
    bias[...] = jnp.full(2, 0.5)  # a fixed point away from zero for the module itself
    return layer


STATIC: dict[str, Callable[[nnx.Linear], Any]] = {
    "closure": lambda layer: lambda z: jnp.tanh(layer(z) + 1.0),
    "module": lambda layer: layer,
    "bound_method": lambda layer: layer.__call__,
    "partial": lambda layer: functools.partial(lambda m, z: jnp.tanh(m(z) + 1.0), layer),
    "object_attribute": lambda layer: Holder(layer).step,
}
SCOPES: dict[str, Callable[[nnx.Linear], Any]] = {
    "no_track": lambda layer: contextlib.nullcontext(),
    "track_other_module": lambda layer: jaxoverride_nnx.track(_layer()),
    "context_without_track": lambda layer: jaxoverride_nnx.context(),
}


@pytest.mark.parametrize("scope", list(SCOPES))
@pytest.mark.parametrize("static", list(STATIC))
def test_a_static_argument_that_reads_an_untracked_module_raises(static, scope):
    layer = _layer()
    solve = jo.jit(fixed_point, static_argnums=0)
    function = STATIC[static](layer)
    with jax.checking_leaks(), SCOPES[scope](layer):
        with pytest.raises(jo.errors.MissingAdapterError, match="track") as caught:
            solve(function, jnp.ones(2))
    assert "bake" in str(caught.value)
    np.testing.assert_array_equal(layer.kernel[...], jnp.eye(2) * 0.3)  # left as it was


@pytest.mark.parametrize("static", list(STATIC))
def test_a_static_argument_that_reads_the_tracked_module_is_fresh(static):
    layer = _layer()
    solve = jo.jit(fixed_point, static_argnums=0)
    function = STATIC[static](layer)
    with jax.checking_leaks(), jaxoverride_nnx.track(layer):
        before = solve(function, jnp.ones(2))
        layer.kernel[...] = jnp.eye(2) * 0.6
        after = solve(function, jnp.ones(2))
    expected = fixed_point(STATIC[static](layer), jnp.ones(2))  # eager, new weights
    np.testing.assert_allclose(after, expected, rtol=1e-5, atol=1e-6)
    assert not np.allclose(before, after, atol=1e-4)


def test_a_static_argument_that_reaches_no_module_runs_as_jax():
    """The README's own example: nothing reached, nothing refused, under any scope."""
    solve = jo.jit(fixed_point, static_argnums=0)
    expected = jax.jit(fixed_point, static_argnums=0)(jnp.cos, jnp.zeros(2))
    with jax.checking_leaks(), jaxoverride_nnx.track(_layer()):
        np.testing.assert_array_equal(solve(jnp.cos, jnp.zeros(2)), expected)
    np.testing.assert_array_equal(solve(jnp.cos, jnp.zeros(2)), expected)


OPTIMISTIX_PROGRAM = """
import jaxoverride as jo

jo.interpose_on_import("equinox", "lineax", "optimistix")

import contextlib

import jax.numpy as jnp
import optimistix as optx
from flax import nnx

import jaxoverride_nnx

layer = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
other = nnx.Linear(2, 2, rngs=nnx.Rngs(1))
function = lambda z, args: jnp.tanh(layer(z) + 1.0)  # the same function, passed twice
solver = optx.FixedPointIteration(1e-6, 1e-6)
scopes = {
    "no_track": contextlib.nullcontext,
    "track_other_module": lambda: jaxoverride_nnx.track(other),
    "track_the_module": lambda: jaxoverride_nnx.track(layer),
}
for name, scope in scopes.items():
    layer.kernel[...] = jnp.eye(2) * 0.3
    try:
        with scope():
            first = optx.fixed_point(function, solver, jnp.zeros(2)).value
            layer.kernel[...] = jnp.eye(2) * 0.6
            second = optx.fixed_point(function, solver, jnp.zeros(2)).value
        print(name, "stale" if jnp.allclose(first, second) else "fresh")
    except jo.errors.MissingAdapterError:
        print(name, "MissingAdapterError")
"""


@pytest.mark.slow  # a fresh interpreter: optimistix must be interposed before its import
def test_interposed_optimistix_given_the_same_function_twice_is_never_stale():
    env = fresh_env(jo, jaxoverride_nnx)
    out = run_fresh(["-c", textwrap.dedent(OPTIMISTIX_PROGRAM)], env, timeout=600)
    assert out.split("\n")[:3] == [
        "no_track MissingAdapterError",
        "track_other_module MissingAdapterError",
        "track_the_module fresh",
    ]


class Counted(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.eye(3) * 0.3)
        self.calls = nnx.Variable(jnp.array(0))


class Solver:
    """Holds the model as an attribute (``levels`` objects deep) and reads its weights
    without indexing (``variable.value``): the read that a probe answers."""

    def __init__(self, model: Counted, levels: int = 1):
        self.held: Any = model
        for _ in range(levels - 1):
            self.held = Holder(self.held)
        self.levels = levels

    def step(self, z: jax.Array) -> jax.Array:
        model = self.held
        for _ in range(self.levels - 1):
            model = model.module
        out = jnp.tanh(z @ model.w.value + 1.0)  # the first use of the module
        model.calls[...] += 1
        return out


# One level: the reference search finds the module. Six: it does not, and the module's
# Variables hold probes when the function first reads them.
@pytest.mark.parametrize("levels", [1, 6], ids=["attribute", "deeper_than_the_search"])
def test_a_module_reached_through_an_attribute_and_read_whole_is_threaded(levels):
    model = Counted()
    solver = Solver(model, levels)
    step = jo.jit(solver.step)
    with jax.checking_leaks(), jaxoverride_nnx.track(model):
        first = step(jnp.ones(3))
        model.w[...] = jnp.eye(3) * 0.6
        second = step(jnp.ones(3))
    np.testing.assert_allclose(first, jnp.tanh(jnp.ones(3) * 1.3), rtol=1e-6)
    np.testing.assert_allclose(second, jnp.tanh(jnp.ones(3) * 1.6), rtol=1e-6)  # fresh
    assert int(model.calls[...]) == 2


def test_jaxopt_fixed_point_iteration_jitted_reaching_the_module_through_its_solver():
    """jaxopt's ``FixedPointIteration(implicit_diff=False, jit=True)`` with its ``loop``
    and ``base`` interposed: it jits the solver's bound methods, whose object holds the
    fixed-point function, whose object holds the tracked module (which counts its calls)."""
    model = Counted()
    x0 = jnp.zeros(3)
    reference = jaxopt.FixedPointIteration(
        fixed_point_fun=lambda z: jnp.tanh(z @ (jnp.eye(3) * 0.3) + 1.0),
        implicit_diff=False,
        maxiter=50,
        tol=1e-6,
    )
    expected = reference.run(x0)
    with interposed("jaxopt._src.loop", "jaxopt._src.base"):
        solver = jaxopt.FixedPointIteration(
            fixed_point_fun=Solver(model).step, implicit_diff=False, jit=True, maxiter=50, tol=1e-6
        )
        with jax.checking_leaks(), jaxoverride_nnx.track(model):
            got = solver.run(x0)
    np.testing.assert_allclose(got.params, expected.params, rtol=1e-6, atol=1e-6)
    assert int(model.calls[...]) == int(expected.state.iter_num) > 2
