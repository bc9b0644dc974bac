"""Equinox-family solvers with an NNX module under ``jaxoverride_nnx.track``: one group per run.

Run as ``python tests/_equinox_nnx.py CASE...`` in a fresh interpreter: the packages are
interposed on import (``jo.interpose_on_import``) before their first import, which no
test process that imported them earlier can do. Prints one JSON object, ``{case: result}``,
that ``tests/test_libraries_equinox_nnx.py`` asserts on. Each case solves with a module
closed over by the callback and, as the reference, with the same library on explicit arrays.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

import jaxoverride as jo

FAMILY = ("equinox", "lineax", "optimistix", "diffrax")
already = [name for name in FAMILY if name in sys.modules]
assert not already, f"imported before interposing: {already}"
_handle = jo.interpose_on_import(*FAMILY)

import diffrax  # noqa: E402
import lineax  # noqa: E402
import optimistix as optx  # noqa: E402
from flax import nnx  # noqa: E402

import jaxoverride_nnx as jon  # noqa: E402

N = 4
X = jnp.linspace(-1.0, 1.0, N)
Z0 = jnp.zeros(N)
RTOL = ATOL = 1e-6


class Cell(nnx.Module):
    """``z -> tanh(z @ w + x)``, a contraction; ``counting`` writes a call counter."""

    def __init__(self, counting: bool = False):
        self.w = nnx.Param(jax.random.normal(jax.random.key(0), (N, N)) * 0.2)
        self.calls = nnx.Variable(jnp.array(0))
        self.counting = counting

    def __call__(self, z: jax.Array, x: jax.Array) -> jax.Array:
        if self.counting:
            self.calls[...] += 1
        return jnp.tanh(z @ self.w[...] + x)

    def linear(self, v: jax.Array) -> jax.Array:
        if self.counting:
            self.calls[...] += 1
        return v @ self.w[...]


Step = Callable[[jax.Array, jax.Array], jax.Array]
Linear = Callable[[jax.Array], jax.Array]


def fixed_point_iteration(f: Step, linear: Linear, x: jax.Array) -> jax.Array:
    solver = optx.FixedPointIteration(rtol=RTOL, atol=ATOL)
    return optx.fixed_point(lambda z, x: f(z, x), solver, Z0, args=x, max_steps=200).value


def fixed_point_chord(f: Step, linear: Linear, x: jax.Array) -> jax.Array:
    solver = optx.Chord(rtol=RTOL, atol=ATOL)
    return optx.fixed_point(lambda z, x: f(z, x), solver, Z0, args=x, max_steps=200).value


def root_find_newton(f: Step, linear: Linear, x: jax.Array) -> jax.Array:
    solver = optx.Newton(rtol=RTOL, atol=ATOL)
    return optx.root_find(lambda z, x: f(z, x) - z, solver, Z0, args=x, max_steps=200).value


def least_squares_gauss_newton(f: Step, linear: Linear, x: jax.Array) -> jax.Array:
    solver = optx.GaussNewton(rtol=RTOL, atol=ATOL)
    return optx.least_squares(lambda z, x: f(z, x) - z, solver, Z0, args=x, max_steps=200).value


def linear_solve_gmres(f: Step, linear: Linear, x: jax.Array) -> jax.Array:
    # rtol 1e-5: at 1e-7 GMRES stagnates in float32 in the backward pass, raw JAX too.
    structure = jax.ShapeDtypeStruct((N,), jnp.float32)
    operator = lineax.FunctionLinearOperator(lambda v: v - 0.5 * linear(v), structure)
    return lineax.linear_solve(operator, x, lineax.GMRES(rtol=1e-5, atol=1e-5)).value


def neural_ode_tsit5(f: Step, linear: Linear, x: jax.Array) -> jax.Array:
    term = diffrax.ODETerm(lambda t, y, x: f(y, x) - y)  # default adjoint: recursive checkpoint
    return diffrax.diffeqsolve(term, diffrax.Tsit5(), 0.0, 1.0, 0.25, x, args=x).ys[-1]


CASES = {
    fn.__name__: fn
    for fn in (
        fixed_point_iteration,
        fixed_point_chord,
        root_find_newton,
        least_squares_gauss_newton,
        linear_solve_gmres,
        neural_ode_tsit5,
    )
}


def _reference(solve: Callable[..., jax.Array], w: jax.Array, x: jax.Array) -> jax.Array:
    return solve(lambda z, x: jnp.tanh(z @ w + x), lambda v: v @ w, x)


def _error(a: Any, b: Any) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


def _outcome(run: Callable[[], Any]) -> Any:
    try:
        return run()
    except Exception as error:  # reported, and asserted on by the test
        return {"error": f"{type(error).__module__}.{type(error).__name__}", "message": str(error)}


def _leaked(model: Cell) -> list[str]:
    """The Variables whose value is a tracer (none may be, after a neutral call)."""
    states = nnx.state(model)
    return [
        str(path) for path, leaf in jax.tree.leaves_with_path(states) if isinstance(leaf, Tracer)
    ]


def run_case(name: str) -> dict[str, Any]:
    solve = CASES[name]
    model = Cell()
    result: dict[str, Any] = {}

    def loss(module: Cell, x: jax.Array) -> jax.Array:
        return jnp.sum(solve(module, module.linear, x) ** 2)

    def reference_loss(w: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.sum(_reference(solve, w, x) ** 2)

    traces = 0

    def traced(x: jax.Array) -> jax.Array:
        nonlocal traces
        traces += 1
        return solve(model, model.linear, x)

    def gradients(grad: Callable[..., Any]) -> dict[str, Any]:
        state, gx = grad(model, X)
        rw, rx = jax.grad(reference_loss, argnums=(0, 1))(model.w[...], X)
        return {
            "w": _error(state["w"][...], rw),
            "x": _error(gx, rx),
            "norm": float(jnp.linalg.norm(rw)),
            "leaked": [str(leaf) for leaf in jax.tree.leaves(state) if isinstance(leaf, Tracer)],
        }

    with jon.track(model):
        result["eager"] = _outcome(
            lambda: _error(solve(model, model.linear, X), _reference(solve, model.w[...], X))
        )
        jitted = jo.jit(traced)
        result["jit"] = _outcome(lambda: _error(jitted(X), _reference(solve, model.w[...], X)))

        def after_change() -> dict[str, float]:
            before = jitted(X)
            model.w[...] = model.w[...] * 1.2
            fresh = _reference(solve, model.w[...], X)
            return {"error": _error(jitted(X), fresh), "moved": _error(before, fresh)}

        result["jit_after_change"] = _outcome(after_change)
        result["jit_traces"] = traces
        result["grad"] = _outcome(lambda: gradients(jo.grad(loss, argnums=(0, 1))))
        result["jit_grad"] = _outcome(lambda: gradients(jo.jit(jo.grad(loss, argnums=(0, 1)))))
    result["leaked"] = _leaked(model)

    counting = Cell(counting=True)
    with jon.track(counting):
        result["write"] = _outcome(lambda: _error(solve(counting, counting.linear, X), 0.0))
        result["write_jit"] = _outcome(
            lambda: _error(jo.jit(lambda: solve(counting, counting.linear, X))(), 0.0)
        )
    result["write_calls"] = int(counting.calls[...])
    result["write_leaked"] = _leaked(counting)
    return result


if __name__ == "__main__":
    print(json.dumps({name: run_case(name) for name in sys.argv[1:]}))
