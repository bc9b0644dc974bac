"""``jaxoverride.solve_state`` in a Linen DEQ through optimistix and diffrax, unmodified.

Run in a fresh interpreter by ``tests/test_solve_state_linen.py``: equinox, optimistix,
lineax and diffrax are interposed before their first import (``_equinox_common``), so the
``eqx.filter_jit`` they build at import holds a neutral ``jax.jit``.

``python tests/_solve_state_linen_script.py CASE [CASE ...]`` prints one JSON object: per
case, the masks drawn, the steps and the largest differences from the fixed-mask twin
(the same library on the explicit variables and the recorded mask), eager against
``jax.jit``, the gradient under ``jax.jit(jax.grad)`` against the twin's, with BatchNorm
the running statistics against one update at the twin's z*; without the declaration,
the refusal.
A case is ``<library>[_<variant>]``: ``optimistix`` (fixed point iteration) or
``diffrax_default`` / ``diffrax_direct`` (a neural ODE with that adjoint); ``_norm`` keeps
the BatchNorm in the map (the others have dropout only), ``_undeclared`` runs without
the declaration.
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp

import _equinox_common  # noqa: F401  (interposes the Equinox family, then imports it)
import _solve_state_linen as m
import jaxoverride_linen as jol
from _equinox_common import report
from _solve_state_solvers import diffrax_node, masks_seen, optimistix_fixed_point

KEY = jax.random.key(3)
RUNS = {
    "optimistix": optimistix_fixed_point,
    "diffrax_default": lambda f, y: diffrax_node(f, y, "default"),
    "diffrax_direct": lambda f, y: diffrax_node(f, y, "direct"),
}


def _refusal(run: Any) -> dict[str, Any]:
    try:
        run()
    except Exception as error:  # reported to the test, which asserts on it
        return {"type": type(error).__name__, "message": str(error)}
    return {"type": None}


def run(case: str) -> dict[str, Any]:
    library = next(name for name in RUNS if case.startswith(name))
    solve, norm = RUNS[library], case.endswith("_norm")
    variables = m.init(norm=norm)
    mutable = ("batch_stats",) if norm else ()
    declare = None if case.endswith("_undeclared") else {}
    model = m.DEQ(solve, declare=declare, norm=norm)
    apply = lambda v, key: m.apply(model, v, key, mutable)
    with jol.context():
        if declare is None:
            with masks_seen() as seen:
                refusal = _refusal(lambda: apply(variables, KEY))
            return {"refusal": refusal, "masks": len(set(seen))}
        with masks_seen() as seen:
            (z, steps), updates = apply(variables, KEY)
        (z_jit, steps_jit), updates_jit = jax.jit(apply)(variables, KEY)

        def loss(params: Any) -> Any:
            (z, _), updates = apply({**variables, "params": params}, KEY)
            return jnp.sum(z**2), updates

        with masks_seen() as seen_grad:
            grad, updates_grad = jax.jit(jax.grad(loss, has_aux=True))(variables["params"])
    keep = m.mask_of(seen[0])
    twin = lambda params: solve(m.twin_map(params, variables, keep), jnp.zeros_like(m.X))
    z_twin, steps_twin = twin(variables["params"])
    twin_grad = jax.grad(lambda p: jnp.sum(twin(p)[0] ** 2))(variables["params"])
    result = {
        "masks": len(set(seen)),
        "evaluations": len(seen),
        "masks_grad": len(set(seen_grad) | set(seen)),
        "steps": int(steps),
        "steps_twin": int(steps_twin),
        "steps_jit": int(steps_jit),
        "z_vs_twin": m.largest(z, z_twin),
        "jit_vs_eager": m.largest((z_jit, updates_jit), (z, updates)),
        "grad_vs_twin": m.largest(grad, twin_grad),
        "grad_updates_vs_eager": m.largest(updates_grad, updates),
    }
    if norm:
        expected = m.twin_statistics(variables, z_twin, keep)
        result["statistics_vs_twin"] = m.largest(updates["batch_stats"]["block"], expected)
        result["statistics_moved"] = float(
            jnp.abs(updates["batch_stats"]["block"]["bn"]["mean"]).max()
        )
    return result


CASES = [
    "optimistix",
    "optimistix_norm",
    "optimistix_undeclared",
    "diffrax_default",
    "diffrax_default_norm",
    "diffrax_direct",
    "diffrax_direct_norm",
    "diffrax_direct_undeclared",
]

if __name__ == "__main__":
    report(sys.argv[1:] or CASES, run)
