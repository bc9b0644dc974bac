"""The Equinox family under Flax NNX: a DEQ trained through unmodified optimistix.

* ``jo.jit(jo.grad(loss))`` of ``examples/deq_optimistix_nnx.py``'s ``nnx.Module`` (the
  fixed point found by ``optimistix.fixed_point`` with ``FixedPointIteration``, implicit
  gradient) under ``jaxoverride_nnx.track``, against ``jax.jit(jax.grad(explicit_loss))``,
  the same optimistix solve on an explicit parameter dict (target <= 1.3x, compiled
  cache-hit calls).

The packages are interposed on import (``jo.interpose_on_import``, done by the example
module), so this suite must be the first to import equinox in its process: ``benchmarks.run``
runs each suite in its own process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax

import jaxoverride as jo
from benchmarks._harness import Row, at_most, interleaved, main, ratio_rows

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import deq_optimistix_nnx as deq  # interposes equinox before importing it

SUITE = "equinox_nnx"


def _deq(quick: bool) -> list[Row]:
    from flax import nnx

    import jaxoverride_nnx

    model = deq.DEQ(nnx.Rngs(0))
    x, y = deq.data()
    params = deq.parameters(model)
    explicit = jax.jit(jax.grad(deq.explicit_loss))
    with jaxoverride_nnx.track(model):
        grad = jo.jit(lambda x, y: jo.grad(deq.loss)(model, x, y))
        samples = interleaved(
            {
                "nnx track + optimistix": lambda: grad(x, y),
                "explicit params, raw JAX": lambda: explicit(params, x, y),
            },
            number=10 if quick else 50,
            rounds=5 if quick else 25,
        )
    return ratio_rows(
        SUITE,
        "DEQ jo.jit(jo.grad), optimistix.fixed_point",
        samples,
        "explicit params, raw JAX",
        {"nnx track + optimistix": at_most(1.3)},
    )


def run(quick: bool) -> list[Row]:
    """Every measurement of the Equinox-family suite."""
    return _deq(quick)


if __name__ == "__main__":
    main(run)
