"""``jaxoverride.solve_state`` in a Haiku DEQ through optimistix and diffrax, unmodified.

Run in a fresh interpreter by ``tests/test_solve_state_haiku.py``: the Equinox family is
interposed before its first import (``_equinox_common``). Both convert the map with
``make_jaxpr`` (``eqx.filter_closure_convert``), so nothing drawn inside comes out of the
jaxpr: the declaration still gives one mask per solve, and at its exit the stream has
advanced as if the map had been called once, so the draw after the solve gets a key of
its own. A case is ``optimistix`` or ``diffrax`` (the default adjoint), or
``diffrax-direct``: diffrax's ``DirectAdjoint`` (equinox's bounded while loop: scans of
checkpointed ``cond``s), whose map writes a running mean and a counter through neutral
loops, branches, checkpoints, jits and rules, nothing converted.

``optimistix-state`` and ``diffrax-state``: the map also normalises with an
``hk.BatchNorm`` and counts its evaluations (``hk.set_state``), its state written out of
the converted map's jaxpr at each evaluation (``kit.declared_make_jaxpr``); each reports
the masks drawn, the steps, and the largest differences from the fixed-mask twin
(``test_solve_state_haiku.stateful_model``, through the same library): the solution, the
state against one update at z*, eager against ``jax.jit(apply)``, and the gradient
under ``jo.jit(jo.grad)`` (or the error it raised).
"""

from __future__ import annotations

import sys
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import _equinox_common  # noqa: F401  (interposes the Equinox family, then imports it)
import jaxoverride as jo
import jaxoverride_haiku as joh
import test_solve_state_haiku as m
from _equinox_common import report
from _solve_state_solvers import diffrax_node, masks_seen, optimistix_fixed_point, record

X = jnp.linspace(-1.0, 1.0, 3)
RUNS = {"optimistix": optimistix_fixed_point, "diffrax": diffrax_node}


def _dropout(key: jax.Array, shape: tuple[int, ...], after: bool = False) -> jax.Array:
    data = jax.random.key_data(key)
    record(jnp.concatenate([data, data]) if after else data)  # the draw after: tagged
    return jax.random.bernoulli(key, 0.8, shape)


def _model(case: str, fixed: bool) -> hk.Transformed:
    run = RUNS[case]
    field = case == "diffrax"  # dy/dt = layer(y) - y; a fixed point map otherwise

    def forward(x: jax.Array) -> jax.Array:
        layer = hk.Linear(3, w_init=hk.initializers.RandomNormal(0.3))
        mask = _dropout(hk.next_rng_key(), x.shape) if fixed else None

        def f(z: jax.Array) -> jax.Array:
            keep = _dropout(hk.next_rng_key(), z.shape) if mask is None else mask
            out = jnp.tanh(layer(jnp.where(keep, z, 0.0)) + 0.3)
            return out - z if field else out

        if fixed:
            z, _ = run(f, x)
        else:
            with jo.solve_state():
                z, _ = run(f, x)
        _dropout(hk.next_rng_key(), x.shape, after=True)
        return z

    return hk.transform(forward)


def _keys(seen: list[bytes]) -> tuple[set[bytes], set[bytes]]:
    return {s for s in seen if len(s) == 8}, {s[:8] for s in seen if len(s) == 16}


def run(case: str) -> dict[str, Any]:
    model, twin = _model(case, False), _model(case, True)
    key = jax.random.key(1)
    with joh.context():
        params = model.init(jax.random.key(0), X)
        with masks_seen() as seen:
            z = model.apply(params, key, X)
        with masks_seen() as seen_grad:
            grad = jax.jit(jax.grad(lambda p: jnp.sum(model.apply(p, key, X) ** 2)))(params)
        with masks_seen() as seen_twin:
            z_twin = twin.apply(params, key, X)
        grad_twin = jax.grad(lambda p: jnp.sum(twin.apply(p, key, X) ** 2))(params)
    solve, after = _keys(seen)
    solve_grad, after_grad = _keys(seen_grad)
    largest = lambda a, b: max(
        float(jnp.abs(x - y).max())
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )
    return {
        "evaluations": len([s for s in seen if len(s) == 8]),
        "masks": len(solve),
        "masks_grad": len(solve_grad | solve),
        "after_reuses": bool(solve & after) or bool(solve_grad & after_grad),
        "twin_mask_is_the_solves": seen_twin[0] in solve,
        "z_vs_twin": largest(z, z_twin),
        "grad_vs_twin": largest(grad, grad_twin),
    }


def _stateful_field(x: jax.Array) -> jax.Array:
    """A neural ODE under ``DirectAdjoint`` whose field records each input it is
    evaluated at and writes a running mean of it and a count of its evaluations."""
    layer = hk.Linear(3, w_init=hk.initializers.RandomNormal(0.3))

    def f(z: jax.Array) -> jax.Array:
        record(z)
        mean = hk.get_state("mean", z.shape, init=jnp.zeros)
        hk.set_state("mean", 0.9 * mean + 0.1 * z)
        count = hk.get_state("count", [], jnp.int32, init=jnp.zeros)
        hk.set_state("count", count + 1)
        return jnp.tanh(layer(z) + 0.3) - z

    with jo.solve_state():
        z, _ = diffrax_node(f, x, "direct")
    return z


def run_direct() -> dict[str, Any]:
    """``diffrax-direct``: the state after apply, eager and under ``jax.jit(apply)``,
    against one update from the entry state at the last evaluation's input."""
    model = hk.transform_with_state(_stateful_field)
    out: dict[str, Any] = {}
    with joh.context():
        params, state = model.init(jax.random.key(0), X)
        for how, apply in (("eager", model.apply), ("jit", jax.jit(model.apply))):
            with masks_seen() as seen:
                _, after = apply(params, state, None, X)
            last = np.frombuffer(seen[-1], np.float32)
            expected = 0.9 * np.asarray(state["~"]["mean"]) + 0.1 * last
            out[f"{how}_evaluations"] = len(seen)
            out[f"{how}_count"] = int(after["~"]["count"])
            out[f"{how}_mean_vs_last"] = float(np.abs(after["~"]["mean"] - expected).max())
            out[f"{how}_mean_moved"] = float(np.abs(after["~"]["mean"]).max())
    return out


def run_state(case: str) -> dict[str, Any]:
    """``optimistix-state`` or ``diffrax-state`` (see above)."""
    library = case.removesuffix("-state")
    solve, field = RUNS[library], library == "diffrax"
    model = m.stateful_model(solve, field=field)
    twin = m.stateful_model(solve, fixed=True, field=field)
    key = jax.random.key(1)
    with joh.context():
        params, start = m.initialised(model)  # init under the declaration
        with masks_seen() as seen:
            (z, steps), after = model.apply(params, start, key, X)
        (z_jit, steps_jit), after_jit = jax.jit(model.apply)(params, start, key, X)
        with masks_seen() as seen_twin:
            (z_twin, steps_twin), after_twin = twin.apply(params, start, key, X)
    solve_keys, drawn_after = _keys(seen)
    result = {
        "evaluations": len([s for s in seen if len(s) == 8]),
        "masks": len(solve_keys),
        "after_reuses": bool(solve_keys & drawn_after),
        "twin_mask_is_the_solves": seen_twin[0] in solve_keys,
        "steps": int(steps),
        "steps_twin": int(steps_twin),
        "steps_jit": int(steps_jit),
        "z_vs_twin": m.largest(z, z_twin),
        "jit_vs_eager": m.largest(z_jit, z),
        "state_vs_twin": m.largest(after, after_twin),
        "state_jit_vs_eager": m.largest(after_jit, after),
        "statistics_moved": float(np.abs(after["bn/~/mean_ema"]["average"]).max()),
        "count_advanced": int(after["~"]["count"]) - int(start["~"]["count"]),
    }

    def loss(transformed: hk.TransformedWithState) -> Any:
        def value(p: Any) -> Any:
            (z, _), state = transformed.apply(p, start, key, X)
            return jnp.sum(z**2), state

        return value

    with joh.context():
        try:
            with masks_seen() as seen_grad:
                grads, after_grad = jo.jit(jo.grad(loss(model), has_aux=True))(params)
        except Exception as error:  # reported to the test, which asserts on it
            return {**result, "grad_error": f"{type(error).__name__}: {error}"}
        twin_grads, _ = jax.grad(loss(twin), has_aux=True)(params)
    solve_grad, after_grad_keys = _keys(seen_grad)
    return {
        **result,
        "masks_grad_entry": solve_grad == solve_keys,
        "after_reuses_grad": bool(solve_grad & after_grad_keys),
        "grad_vs_twin": m.largest(grads, twin_grads),
        "grad_scale": max(float(jnp.abs(g).max()) for g in jax.tree.leaves(twin_grads)),
        "state_grad_vs_eager": m.largest(after_grad, after),
    }


CASES = [*RUNS, "diffrax-direct", "optimistix-state", "diffrax-state"]


def _run(case: str) -> dict[str, Any]:
    if case == "diffrax-direct":
        return run_direct()
    return run_state(case) if case.endswith("-state") else run(case)


if __name__ == "__main__":
    report(sys.argv[1:] or CASES, _run)
