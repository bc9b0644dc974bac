"""The data-parallel NNX example: 8 devices end where 1 device ends, and the loss falls."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import data_parallel_nnx as example


def test_data_parallel_nnx_matches_one_device():
    runs = example.run(steps=4, verbose=False)
    for gradient in ("implicit", "unrolled"):
        one, one_model = runs[f"{gradient}, 1 device"]
        many, many_model = runs[f"{gradient}, 8 devices"]
        np.testing.assert_allclose(many, one, rtol=1e-4, err_msg=gradient)
        assert many[-1] < many[0], gradient
        assert example.max_parameter_difference(one_model, many_model) < 1e-4
        kernel = many_model.hidden.kernel[...]
        assert len(kernel.sharding.device_set) == 8 and kernel.sharding.is_fully_replicated
        assert len(one_model.hidden.kernel[...].sharding.device_set) == 1
