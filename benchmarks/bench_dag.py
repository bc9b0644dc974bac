"""jaxoverride_dag: per-call cost of ``jo.jit`` under ``jaxoverride_dag.context()``.

Side by side in one run with ``jax.jit`` and ``eqx.filter_jit`` (cache hits, results
blocked on), on (i) one array, (ii) a dict of 200 arrays, (iii) an Equinox MLP of depth
20, and (iv) one 64 MB numpy array referenced 8 times. ``jax.jit`` cannot take the MLP's
activation functions, so its baseline for (iii) is the usual partition: the MLP's arrays
as the argument, the rest closed over. Single device throughout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import jaxoverride as jo
import jaxoverride_dag as dag
from benchmarks._harness import Row, at_least_faster, at_most, block, interleaved, main, ratio_rows

SUITE = "dag"
OURS = "jo.jit[dag]"


def _case(
    case: str,
    fn: Callable[..., Any],
    make_args: Callable[[], tuple[Any, ...]],
    jax_fn: Callable[..., Any],
    jax_args: tuple[Any, ...],
    *,
    number: int,
    rounds: int,
    unshared: bool,
    note: str = "",
) -> list[Row]:
    jax_jit = jax.jit(jax_fn)
    eqx_jit = eqx.filter_jit(fn)
    ours = jo.jit(fn)
    args = make_args()
    with dag.context():
        candidates = {
            "jax.jit": lambda: block(jax_jit(*jax_args)),
            "eqx.filter_jit": lambda: block(eqx_jit(*args)),
            OURS: lambda: block(ours(*args)),
        }
        samples = interleaved(candidates, number=number, rounds=rounds)
    vs_jax = at_most(1.05) if unshared else at_least_faster(5)
    rows = ratio_rows(
        SUITE, case, {k: samples[k] for k in ("jax.jit", OURS)}, "jax.jit", {OURS: vs_jax}, note
    )
    rows += ratio_rows(
        SUITE,
        case,
        {k: samples[k] for k in ("eqx.filter_jit", OURS)},
        "eqx.filter_jit",
        {OURS: at_most(1.0)} if unshared else None,
        note,
    )
    return rows


def run(quick: bool) -> list[Row]:
    rounds = 5 if quick else 25
    scale = 0.2 if quick else 1.0
    rows: list[Row] = []

    x = jnp.arange(8.0)
    rows += _case(
        "(i) one array",
        lambda x: x * 2.0,
        lambda: (x,),
        lambda x: x * 2.0,
        (x,),
        number=int(2000 * scale),
        rounds=rounds,
        unshared=True,
    )

    tree = {f"w{i:03d}": jnp.full((4,), float(i)) for i in range(200)}
    rows += _case(
        "(ii) dict of 200 arrays",
        lambda d: d["w000"] + d["w199"],
        lambda: (tree,),
        lambda d: d["w000"] + d["w199"],
        (tree,),
        number=int(300 * scale),
        rounds=rounds,
        unshared=True,
    )

    mlp = eqx.nn.MLP(16, 16, 32, 20, key=jax.random.PRNGKey(0))
    params, static = eqx.partition(mlp, eqx.is_array)
    inputs = jnp.ones(16)
    rows += _case(
        "(iii) Equinox MLP, depth 20",
        lambda m, v: m(v),
        lambda: (mlp, inputs),
        lambda p, v: eqx.combine(p, static)(v),
        (params, inputs),
        number=int(300 * scale),
        rounds=rounds,
        unshared=True,
        note="jax.jit takes the MLP's arrays; its activations are closed over",
    )

    big = np.ones((4096, 4096), np.float32)  # 64 MB
    shared = [big] * 8
    rows += _case(
        "(iv) one 64 MB numpy array x8",
        lambda xs: sum(a[0, 0] for a in xs),
        lambda: (shared,),
        lambda xs: sum(a[0, 0] for a in xs),
        (shared,),
        number=1,
        rounds=5 if quick else 15,
        unshared=False,
        note="jax.jit transfers the array 8 times, ours once",
    )
    return rows


if __name__ == "__main__":
    main(run)
