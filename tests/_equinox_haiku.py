"""The Equinox family (optimistix, lineax, diffrax), unmodified, inside ``hk.transform``.

Run in a fresh interpreter by ``tests/test_libraries_equinox_haiku.py``, because import order
matters: ``jo.interpose_on_import`` is called *before* equinox, optimistix, lineax and diffrax
are imported (by ``tests/_equinox_common.py``, with the cases), so that the ``eqx.filter_jit``
they build at import holds a neutral ``jax.jit``.

``python tests/_equinox_haiku.py CASE [CASE ...]`` prints one JSON object: for each case
(``inside:CASE``: the layer built inside the callback, which only reports its modules),
what the test asserts on (parameter names, tracer leaks, largest differences against the
same library run on the explicit parameters with raw JAX, and the refusals of a state write
and an rng draw inside the callback).

Each case is one library call ``solve(linear, x)``, where ``linear`` is the model's only
layer: an ``hk.Linear`` inside Haiku, ``z @ w + b`` on the explicit parameters outside it.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp

import jaxoverride_haiku as joh
from _equinox_common import (  # importing it interposes the libraries, then imports them
    CASES,
    RNG,
    Linear,
    N,
    X,
    differences_from_explicit,
    max_diff,
    refusal,
    report,
    tracers,
)
from jaxoverride._compat import jaxprs_in_params


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


def _shapes(tree: Any) -> dict[str, dict[str, list[int]]]:
    return {m: {n: list(v.shape) for n, v in bundle.items()} for m, bundle in tree.items()}


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
        result["param_tracers"] = tracers(params)

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
        result["write_at_init"] = refusal(lambda: writer.init(RNG, X))
        result["write_at_apply"] = refusal(lambda: writer.apply(params, state, None, X))
        result["write_under_jit"] = refusal(lambda: jax.jit(writer.apply)(params, state, None, X))
        result["draw_at_init"] = refusal(lambda: drawer.init(RNG, X))
        result["draw_at_apply"] = refusal(lambda: drawer.apply(params, RNG, X))
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
    result["installed_params"] = max_diff(installed_params, params)

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
    outputs = (out, jitted, installed, after_refusals, outside_out)
    result |= differences_from_explicit(expected, expected_grads, outputs, (grads, jitted_grads))
    result["output_tracers"] = tracers((out, jitted, grads, jitted_grads, installed_params))
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
    return {"modules": sorted(params), "apply_uses_last": max_diff(out, expected)}


def run(name: str) -> dict[str, Any]:
    """``run_case(name)``, or ``run_inside(CASE)`` for the name ``inside:CASE``."""
    return run_inside(name[7:]) if name.startswith("inside:") else run_case(name)


if __name__ == "__main__":
    report(sys.argv[1:] or list(CASES), run)
