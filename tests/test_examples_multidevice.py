"""The data-parallel Haiku example: three ways of training agree, and the loss falls."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import data_parallel_haiku as example


@pytest.mark.skipif(
    not hasattr(jax.lax, "pcast"),
    reason=f"the example calls jax.lax.pcast, which JAX {jax.__version__} lacks "
    "(JAX 0.8 spells it lax.pvary)",
)
def test_data_parallel_training_matches_a_single_device():
    runs = example.run(steps=6, verbose=False)
    single = runs["single device"]
    assert single.losses[-1] < 0.8 * single.losses[0]  # it learns
    for name in ("jit + shardings", "shard_map + pmean"):
        np.testing.assert_allclose(runs[name].losses, single.losses, rtol=1e-4, err_msg=name)
        assert example.max_difference(runs[name].params, single.params) < 1e-5, name
        # Parameters stay replicated over the 8 devices.
        leaf = jax.tree.leaves(runs[name].params)[0]
        assert len(leaf.sharding.device_set) == 8 and leaf.sharding.is_fully_replicated
