"""Data-parallel training of a Flax NNX deep-equilibrium model on 8 CPU devices.

The model is ``deq_nnx.DEQ``: its layer is the fixed point found by the unchanged
``fpsolve`` library (``jaxoverride.jit``, ``while_loop``/``scan`` and ``jacfwd`` inside),
reading and writing the NNX module through closures. The training step closes over the
model and the ``nnx.Optimizer`` and runs under ``jaxoverride.jit`` with ``NamedSharding``
in/out shardings: the batch is split over a ``Mesh`` of 8 devices, and
``jaxoverride_nnx.track`` threads the (replicated) parameters and optimizer state
through the step. The losses and the final parameters must equal a single-device run's.

Run it as ``python examples/data_parallel_nnx.py``; it asks for 8 host devices itself.
"""

from __future__ import annotations

import os

# Before JAX is imported: 8 CPU devices (ignored if XLA_FLAGS is already set).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jaxoverride as jo
import jaxoverride_nnx
from deq_nnx import DEQ, data


def train(gradient: str, steps: int, shardings: dict[str, Any]) -> tuple[list[float], DEQ]:
    """Trains a fresh model; ``shardings`` go to ``jo.jit`` (none: one device)."""
    model = DEQ(nnx.Rngs(0), gradient)
    optimizer = nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.Param)

    def train_step(x: jax.Array, y: jax.Array) -> jax.Array:
        def loss_fn(model: DEQ) -> jax.Array:
            return jnp.mean((model(x) - y) ** 2)

        loss, grads = jo.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    step = jo.jit(train_step, **shardings)
    x, y = data()
    with jaxoverride_nnx.track(model, optimizer):
        losses = [float(step(x, y)) for _ in range(steps)]
    return losses, model


def run(steps: int = 8, verbose: bool = True) -> dict[str, tuple[list[float], DEQ]]:
    """Both gradients, on one device and on 8; returns the losses and models by run name."""
    mesh = Mesh(np.array(jax.devices()), ("data",))  # Auto axes: GSPMD partitions the step
    batch, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    sharded = {"in_shardings": (batch, batch), "out_shardings": replicated}
    runs = {}
    for gradient in ("implicit", "unrolled"):
        for where, shardings in (("1 device", {}), (f"{len(mesh.devices)} devices", sharded)):
            runs[f"{gradient}, {where}"] = train(gradient, steps, shardings)
            if verbose:
                losses = runs[f"{gradient}, {where}"][0]
                print(f"{gradient:9s} {where:10s} loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return runs


def max_parameter_difference(a: DEQ, b: DEQ) -> float:
    """The largest absolute difference between the two models' parameters."""
    leaves_a, leaves_b = (jax.tree.leaves(nnx.state(m, nnx.Param)) for m in (a, b))
    return max(float(jnp.max(jnp.abs(u - v))) for u, v in zip(leaves_a, leaves_b, strict=True))


def main() -> None:
    runs = run()
    for gradient in ("implicit", "unrolled"):
        (one, model_one), (many, model_many) = (
            runs[name] for name in runs if name.startswith(gradient)
        )
        np.testing.assert_allclose(many, one, rtol=1e-4)
        difference = max_parameter_difference(model_one, model_many)
        assert difference < 1e-4, difference
        assert many[-1] < 0.5 * many[0], many
        kernel = model_many.hidden.kernel[...]
        assert len(kernel.sharding.device_set) == 8, "the parameters live on all 8 devices"
        print(f"{gradient}: 8 devices match 1 device (max parameter difference {difference:.1e})")


if __name__ == "__main__":
    main()
