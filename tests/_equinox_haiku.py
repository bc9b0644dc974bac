"""The Equinox family (optimistix, lineax, diffrax), unmodified, inside ``hk.transform``.

Run in a fresh interpreter by ``tests/test_libraries_equinox_haiku.py``, because import order
matters: ``jo.interpose_on_import`` is called *before* equinox, optimistix, lineax and diffrax
are imported, so that the ``eqx.filter_jit`` they build at import holds a neutral ``jax.jit``.

``python tests/_equinox_haiku.py CASE [CASE ...]`` prints one JSON object: for each case
(``inside:CASE``: the layer built inside the callback, which only reports its modules),
what the test asserts on (parameter names, tracer leaks, largest differences against the
same library run on the explicit parameters with raw JAX, and the refusals of a state write
and an rng draw inside the callback).

Each case is one library call ``solve(linear, x)``, where ``linear`` is the model's only
layer: an ``hk.Linear`` inside Haiku, ``z @ w + b`` on the explicit parameters outside it.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections import Counter
from collections.abc import Callable
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import jaxoverride as jo
import jaxoverride_haiku as joh
from jaxoverride._compat import jaxprs_in_params


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


CASES: dict[str, tuple[Callable[[Linear, jax.Array], jax.Array], bool]] = {
    # name: (solve, whether the layer has a bias; lineax's operator must be linear)
    "fixed_point_iteration": (fixed_point_iteration, True),
    "fixed_point_newton": (fixed_point_newton, True),
    "root_find_newton": (root_find_newton, True),
    "least_squares_gauss_newton": (least_squares_gauss_newton, True),
    "linear_solve_gmres": (linear_solve_gmres, False),
    "neural_ode_tsit5": (neural_ode_tsit5, True),
}


def _layer(with_bias: bool) -> hk.Linear:
    return hk.Linear(N, with_bias=with_bias, w_init=hk.initializers.RandomNormal(0.3), name="cell")


def _writing(linear: Linear) -> Linear:
    def counted(z: jax.Array) -> jax.Array:
        hk.set_state("calls", hk.get_state("calls", [], jnp.int32, init=jnp.zeros) + 1)
        return linear(z)

    return counted


def _drawing(linear: Linear) -> Linear:
    def noisy(z: jax.Array) -> jax.Array:
        return linear(z) + 0.0 * jax.random.normal(hk.next_rng_key(), z.shape)

    return noisy


def _explicit(params: hk.Params, with_bias: bool) -> Linear:
    """``hk.Linear`` on the explicit parameters, op for op, so that the jaxprs compare."""

    def linear(z: jax.Array) -> jax.Array:
        out = jnp.dot(z, params["cell"]["w"])
        return out + jnp.broadcast_to(params["cell"]["b"], out.shape) if with_bias else out

    return linear


def _primitives(jaxpr: jax.extend.core.Jaxpr) -> list[str]:
    """Every primitive, in order, with the sub-jaxprs of each equation after it.

    A ``custom_jvp_call`` counts by its body only: inside Haiku the params are
    differentiated too, so JAX asks the rule of a call none of whose own arguments is
    (equinox's ``nondifferentiable``), and the Haiku rule then runs the body inline.
    """
    names = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name != "custom_jvp_call":
            names.append(eqn.primitive.name)
        for sub in jaxprs_in_params(eqn.params):
            names += _primitives(sub)
    return names


def _max_diff(a: Any, b: Any) -> float:
    diffs = jax.tree.map(lambda u, v: float(np.max(np.abs(np.asarray(u) - np.asarray(v)))), a, b)
    assert jax.tree.structure(a) == jax.tree.structure(b), (a, b)
    return max(jax.tree.leaves(diffs), default=0.0)


def _shapes(tree: Any) -> dict[str, dict[str, list[int]]]:
    return {m: {n: list(v.shape) for n, v in bundle.items()} for m, bundle in tree.items()}


def _tracers(tree: Any) -> int:
    return sum(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(tree))


def _refusal(run: Callable[[], Any]) -> dict[str, str | None]:
    try:
        run()
    except Exception as error:  # the test asserts on the type and message
        return {"type": type(error).__name__, "message": str(error)}
    return {"type": None, "message": None}


def run_case(name: str) -> dict[str, Any]:
    solve, with_bias = CASES[name]
    traces: list[int] = []

    def forward(x: jax.Array) -> jax.Array:
        traces.append(1)  # Python runs once per trace (and per eager call)
        return solve(_layer(with_bias), x)

    model = hk.transform(forward)
    direct = hk.transform(lambda x: _layer(with_bias)(x))
    result: dict[str, Any] = {}

    with joh.context():
        params = model.init(RNG, X)
        result["params"] = _shapes(params)
        result["direct_params"] = _shapes(direct.init(RNG, X))
        result["param_tracers"] = _tracers(params)

        def loss(p: hk.Params, x: jax.Array) -> jax.Array:
            return jnp.sum(model.apply(p, None, x) ** 2)

        out = model.apply(params, None, X)
        jitted_apply = jax.jit(model.apply)
        before = len(traces)
        jitted = jitted_apply(params, None, X)
        result["first_traces"] = len(traces) - before
        before = len(traces)
        jitted_apply(params, None, X + 1.0)  # new values, same shapes: a cache hit
        result["retraces"] = len(traces) - before
        grads = jax.grad(loss, argnums=(0, 1))(params, X)
        jitted_grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, X)
        traced = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(params, X).jaxpr

        writer = hk.transform_with_state(lambda x: solve(_writing(_layer(with_bias)), x))
        drawer = hk.transform(lambda x: solve(_drawing(_layer(with_bias)), x))
        state = {"~": {"calls": jnp.zeros([], jnp.int32)}}
        result["write_at_init"] = _refusal(lambda: writer.init(RNG, X))
        result["write_at_apply"] = _refusal(lambda: writer.apply(params, state, None, X))
        result["write_under_jit"] = _refusal(lambda: jax.jit(writer.apply)(params, state, None, X))
        result["draw_at_init"] = _refusal(lambda: drawer.init(RNG, X))
        result["draw_at_apply"] = _refusal(lambda: drawer.apply(params, RNG, X))
        # A refusal leaves everything as it was: the read-only model still runs.
        after_refusals = model.apply(params, None, X)

        def write_outside(x: jax.Array) -> jax.Array:
            # The fix the refusal names: the write before the solver call works.
            hk.set_state("calls", hk.get_state("calls", [], jnp.int32, init=jnp.zeros) + 1)
            return solve(_layer(with_bias), x)

        outside = hk.transform_with_state(write_outside)
        outside_params, outside_state = outside.init(RNG, X)
        outside_out, outside_state = outside.apply(outside_params, outside_state, None, X)
        result["write_outside_calls"] = int(outside_state["~"]["calls"])

    # install() instead of context(): active inside transforms only, no with block.
    joh.install()
    try:
        installed_params = model.init(RNG, X)
        installed = model.apply(params, None, X)
    finally:
        joh.uninstall()
    result["installed_params"] = _max_diff(installed_params, params)

    def reference_loss(p: hk.Params, x: jax.Array) -> jax.Array:
        return jnp.sum(solve(_explicit(p, with_bias), x) ** 2)

    expected = solve(_explicit(params, with_bias), X)
    expected_grads = jax.grad(reference_loss, argnums=(0, 1))(params, X)
    reference = jax.make_jaxpr(jax.grad(reference_loss, argnums=(0, 1)))(params, X).jaxpr
    # Differential: the gradient's program is the explicit one's, primitive for primitive
    # (only the order of the hoisted parameters may differ).
    ours, theirs = _primitives(traced), _primitives(reference)
    result["primitives"] = len(theirs)
    result["same_primitives"] = ours == theirs
    result["only_explicit"] = dict(Counter(theirs) - Counter(ours))
    result["only_ours"] = dict(Counter(ours) - Counter(theirs))
    result["apply"] = _max_diff(out, expected)
    result["jit_apply"] = _max_diff(jitted, expected)
    result["installed_apply"] = _max_diff(installed, expected)
    result["after_refusals"] = _max_diff(after_refusals, expected)
    result["write_outside"] = _max_diff(outside_out, expected)
    result["grad"] = _max_diff(grads, expected_grads)
    result["jit_grad"] = _max_diff(jitted_grads, expected_grads)
    result["grad_scale"] = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(expected_grads))
    result["output_tracers"] = _tracers((out, jitted, grads, jitted_grads, installed_params))
    return result


def run_inside(name: str) -> dict[str, Any]:
    """The layer built *inside* the callback: a new Haiku module per trace of it."""
    solve, with_bias = CASES[name]
    model = hk.transform(lambda x: solve(lambda z: _layer(with_bias)(z), x))
    with joh.context():
        params = model.init(RNG, X)
        out = model.apply(params, None, X)
    last = sorted(params)[-1]  # the module built by the library's last trace
    expected = solve(_explicit({"cell": params[last]}, with_bias), X)
    return {"modules": sorted(params), "apply_uses_last": _max_diff(out, expected)}


def main(names: list[str]) -> None:
    results: dict[str, Any] = {}
    for name in names:
        try:
            inside = name.startswith("inside:")
            results[name] = run_inside(name[7:]) if inside else run_case(name)
        except Exception:  # reported to the test, which fails with it
            results[name] = {"crashed": traceback.format_exc()}
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:] or list(CASES))
