"""``jaxoverride.solve_state`` in an NNX DEQ through optimistix and diffrax, unmodified.

Run in a fresh interpreter by ``tests/test_solve_state_nnx.py``: equinox, optimistix,
lineax and diffrax are interposed before their first import (``_equinox_common``). Both
convert the map by ``make_jaxpr`` (equinox's ``filter_closure_convert``: optimistix's
``ImplicitAdjoint``, diffrax's default adjoint), so the BatchNorm's statistics and the
counter come out of the jaxpr (``kit.write_out``).

``python tests/_solve_state_nnx_script.py CASE [CASE ...]`` prints one JSON object: per
case, the masks drawn, the steps, and the largest differences from the fixed-mask twin
(the same library on the explicit parameters and the entry mask): the solution, the
running statistics against one EMA update at z*, eager against ``jo.jit``, and the
gradient under ``jo.jit(jo.grad)`` against the twin's (or the error it raised). A case
is ``optimistix`` (fixed point iteration), ``diffrax`` (a neural ODE with the default
adjoint) or ``diffrax_direct`` (the same with ``DirectAdjoint``, which evaluates the field
itself inside its loops and ``eval_shape``).
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import _equinox_common  # noqa: F401  (interposes the Equinox family, then imports it)
import jaxoverride as jo
import jaxoverride_nnx as jon
import test_solve_state_nnx as m
from _equinox_common import report
from _solve_state_solvers import (
    diffrax_node,
    masks_seen,
    optimistix_fixed_point,
)

RUNS = {
    "optimistix": optimistix_fixed_point,
    "diffrax": lambda f, y: diffrax_node(f, y, "default"),
    "diffrax_direct": lambda f, y: diffrax_node(f, y, "direct"),
}


def _largest(a: Any, b: Any) -> float:
    diffs = jax.tree.map(lambda u, v: float(np.max(np.abs(np.asarray(u) - np.asarray(v)))), a, b)
    return max(jax.tree.leaves(diffs), default=0.0)


def run(case: str) -> dict[str, Any]:
    solve = RUNS[case]
    model = m.Deq(solve)
    start = m.state_of(model)
    mask = m.entry_mask(model)
    with jon.track(model), masks_seen() as seen:
        z, steps = m.apply(model, "eager")
    after = m.state_of(model)

    jitted = m.Deq(solve)
    with jon.track(jitted):
        z_jit, steps_jit = m.apply(jitted, "jit")

    params = m.params_of(model)
    z0 = jnp.zeros_like(m.X)
    z_twin, steps_twin = solve(m.twin_map(params, mask), z0)
    mean, var = m.one_update(start["mean"], start["var"], z_twin)
    entry = mask.astype(np.float32).tobytes()
    result = {
        "evaluations": len(seen),
        "masks": len(set(seen)),
        "masks_entry": set(seen) == {entry},
        "steps": int(steps),
        "steps_twin": int(steps_twin),
        "steps_jit": int(steps_jit),
        "z_vs_twin": _largest(z, z_twin),
        "jit_vs_eager": _largest(z_jit, z),
        "statistics_vs_twin": _largest((after["mean"], after["var"]), (mean, var)),
        "statistics_moved": float(np.abs(after["mean"]).max()),
        "state_jit_vs_eager": _largest(m.state_of(jitted), after),
        "count_advanced": int(after["count"]) - int(start["count"]),
        "calls_advanced": int(after["calls"]) - int(start["calls"]),
    }
    graded = m.Deq(solve)
    loss = lambda deq: jnp.sum(deq()[0] ** 2)
    try:
        with jon.track(graded), masks_seen() as seen_grad:
            grads = jo.jit(jo.grad(loss))(graded)
    except Exception as error:  # reported to the test, which asserts on it
        return {**result, "grad_error": f"{type(error).__name__}: {error}"}
    twin_grad = jax.grad(lambda p: jnp.sum(solve(m.twin_map(p, mask), z0)[0] ** 2))(params)
    got_grad = {
        "kernel": grads["lin"]["kernel"][...],
        "bias": grads["lin"]["bias"][...],
        "scale": grads["bn"]["scale"][...],
        "shift": grads["bn"]["bias"][...],
    }
    return {
        **result,
        "masks_grad_entry": set(seen_grad) == {entry},
        "state_grad_vs_eager": _largest(m.state_of(graded), after),
        "grad_vs_twin": _largest(got_grad, twin_grad),
        "grad_scale": max(float(jnp.abs(g).max()) for g in jax.tree.leaves(twin_grad)),
    }


if __name__ == "__main__":
    report(sys.argv[1:] or list(RUNS), run)
