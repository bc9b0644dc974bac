"""What the fresh-interpreter Equinox-family scripts share: the libraries, imported
interposed, the library calls under test, and how results are measured and reported.

Importing this module interposes equinox, optimistix, lineax and diffrax *before* their first
import (``jo.interpose_on_import``), so that the ``eqx.filter_jit`` they build at import holds
a neutral ``jax.jit``: a script (``tests/_equinox_haiku.py``, ``tests/_equinox_linen.py``)
imports it before anything that imports those libraries, in a fresh interpreter.

Each case is one library call ``solve(linear, x)``, where ``linear`` is the model's only
layer: the framework's linear layer inside it, ``z @ w + b`` on the explicit parameters
outside it.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxoverride as jo


def _import_neutral() -> tuple[Any, Any, Any]:
    """Imports the libraries interposed from their first line on: import order is the point."""
    jo.interpose_on_import("equinox", "optimistix", "lineax", "diffrax")
    import diffrax
    import lineax
    import optimistix

    return optimistix, lineax, diffrax


optx, lx, diffrax = _import_neutral()

N = 4
X = jnp.linspace(-1.0, 1.0, N)
RNG = jax.random.PRNGKey(0)
TOL = 1e-6
Linear = Callable[[jax.Array], jax.Array]
Solve = Callable[[Linear, jax.Array], jax.Array]


def _fixed_point_map(linear: Linear, x: jax.Array) -> Callable[..., jax.Array]:
    return lambda z, args: jnp.tanh(linear(z) + x)


def fixed_point_iteration(linear: Linear, x: jax.Array) -> jax.Array:
    solver = optx.FixedPointIteration(rtol=TOL, atol=TOL)
    return optx.fixed_point(_fixed_point_map(linear, x), solver, jnp.zeros(N), max_steps=100).value


def fixed_point_newton(linear: Linear, x: jax.Array) -> jax.Array:
    solver = optx.Newton(rtol=TOL, atol=TOL)
    return optx.fixed_point(_fixed_point_map(linear, x), solver, jnp.zeros(N), max_steps=50).value


def root_find_newton(linear: Linear, x: jax.Array) -> jax.Array:
    fun = lambda z, args: z + 0.5 * jnp.tanh(linear(z)) - x
    return optx.root_find(fun, optx.Newton(rtol=TOL, atol=TOL), jnp.zeros(N), max_steps=50).value


def least_squares_gauss_newton(linear: Linear, x: jax.Array) -> jax.Array:
    residuals = lambda z, args: jnp.concatenate([z + 0.5 * jnp.tanh(linear(z)) - x, 0.1 * z])
    solver = optx.GaussNewton(rtol=TOL, atol=TOL)
    return optx.least_squares(residuals, solver, jnp.zeros(N), max_steps=50).value


def linear_solve_gmres(linear: Linear, x: jax.Array) -> jax.Array:
    # GMRES at a tighter rtol stagnates in float32 in the backward pass, on raw JAX too.
    structure = jax.ShapeDtypeStruct((N,), jnp.float32)
    operator = lx.FunctionLinearOperator(lambda v: v - 0.5 * linear(v), structure)
    return lx.linear_solve(operator, x, lx.GMRES(rtol=1e-5, atol=1e-5)).value


def neural_ode_tsit5(linear: Linear, x: jax.Array) -> jax.Array:
    term = diffrax.ODETerm(lambda t, y, args: jnp.tanh(linear(y) + x) - y)
    return diffrax.diffeqsolve(term, diffrax.Tsit5(), 0.0, 1.0, 0.1, jnp.zeros(N)).ys[-1]


SOLVES = (
    fixed_point_iteration,
    fixed_point_newton,
    root_find_newton,
    least_squares_gauss_newton,
    linear_solve_gmres,
    neural_ode_tsit5,
)
CASES: dict[str, tuple[Solve, bool]] = {
    # name: (solve, whether the layer has a bias: lineax's operator must be linear)
    solve.__name__: (solve, solve is not linear_solve_gmres)
    for solve in SOLVES
}


def max_diff(a: Any, b: Any) -> float:
    """The largest absolute difference between two trees of one structure."""
    assert jax.tree.structure(a) == jax.tree.structure(b), (a, b)
    diffs = jax.tree.map(lambda u, v: float(np.max(np.abs(np.asarray(u) - np.asarray(v)))), a, b)
    return max(jax.tree.leaves(diffs), default=0.0)


OUTPUTS = ("apply", "jit_apply", "installed_apply", "after_refusals", "write_outside")
GRADIENTS = ("grad", "jit_grad")


def differences_from_explicit(
    expected: Any, expected_grads: Any, outputs: Sequence[Any], grads: Sequence[Any]
) -> dict[str, float]:
    """What the tests compare with the library run on the explicit parameters.

    The largest difference of each of ``outputs`` (named as ``OUTPUTS``) from ``expected``,
    of each of ``grads`` (named as ``GRADIENTS``) from ``expected_grads``, and
    ``grad_scale``: the largest explicit gradient, the scale they are measured on.
    """
    named = zip((*OUTPUTS, *GRADIENTS), (*outputs, *grads), strict=True)
    found = {
        name: max_diff(value, expected if name in OUTPUTS else expected_grads)
        for name, value in named
    }
    found["grad_scale"] = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(expected_grads))
    return found


def tracers(tree: Any) -> int:
    """How many leaves of ``tree`` are tracers: values that leaked out of a trace."""
    return sum(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(tree))


def refusal(run: Callable[[], Any]) -> dict[str, str | None]:
    """The type and message of what ``run()`` raised (both ``None`` if it returned)."""
    try:
        run()
    except Exception as error:  # the test asserts on the type and message
        return {"type": type(error).__name__, "message": str(error)}
    return {"type": None, "message": None}


def report(names: list[str], run: Callable[[str], dict[str, Any]]) -> None:
    """Prints one JSON object, ``{name: run(name)}``; a crash is reported, not raised."""
    results: dict[str, Any] = {}
    for name in names:
        try:
            results[name] = run(name)
        except Exception:  # reported to the test, which fails with it
            results[name] = {"crashed": traceback.format_exc()}
    print(json.dumps(results))
