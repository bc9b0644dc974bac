"""Data-parallel training of a Haiku deep-equilibrium model on 8 CPU devices.

The model's layer is the fixed point ``z = tanh(W z + U x + b)``, found by the unchanged
``fpsolve`` library (``jaxoverride.jit`` + ``jaxoverride.lax.scan`` inside) with Haiku
modules in the map; ``jaxoverride_haiku.context()`` makes that work. The batch is split
over a ``Mesh`` of 8 devices, the parameters replicated, in two ways:

* ``jo.jit`` with ``NamedSharding`` in/out shardings (XLA partitions the step);
* ``jo.shard_map`` over the mesh: each device takes the gradient of its shard's loss,
  and ``lax.pmean`` averages the gradients.

Both must end where a single-device run of the same steps ends. Run it as
``python examples/data_parallel_haiku.py``; it asks for 8 host devices itself.
"""

from __future__ import annotations

import os

# Before JAX is imported: 8 CPU devices (ignored if XLA_FLAGS is already set).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jaxoverride as jo
import jaxoverride_haiku as joh
from fpsolve import fixed_point

WIDTH = 8
BATCH = 64  # 8 examples per device
SOLVER_STEPS = 12


class Equilibrium(hk.Module):
    """``z* = tanh(W z* + U x + b)``: the solver runs inside the module."""

    def __call__(self, x: jax.Array) -> jax.Array:
        # A small W keeps the map contractive, so the fixed point exists.
        recurrent = hk.Linear(WIDTH, w_init=hk.initializers.VarianceScaling(0.1), name="w")
        injection = hk.Linear(WIDTH, with_bias=False, name="u")
        solution = fixed_point(
            lambda z, x: jnp.tanh(recurrent(z) + injection(x)),
            # zeros_like(x): under shard_map the start varies over the mesh as x does,
            # so the solver's scan carry keeps one type.
            jnp.zeros_like(x, shape=(*x.shape[:-1], WIDTH)),
            x,
            method="unrolled",  # a scan: differentiable in reverse mode
            max_iter=SOLVER_STEPS,
        )
        return solution.value


def forward(x: jax.Array) -> jax.Array:
    return hk.Linear(1, name="readout")(Equilibrium()(x))[..., 0]


MODEL = hk.transform(forward)
OPTIMIZER = optax.adam(3e-2)


class Run(NamedTuple):
    losses: list[float]
    params: Any


def make_data(seed: int = 0) -> tuple[jax.Array, jax.Array]:
    """A smooth regression target on 4 inputs."""
    x = jax.random.normal(jax.random.PRNGKey(seed), (BATCH, 4))
    y = jnp.sin(x @ jnp.array([1.0, -0.5, 0.25, 2.0])) * 0.5
    return x, y


def loss_fn(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((MODEL.apply(params, None, x) - y) ** 2)


def sgd_step(params: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> tuple[Any, Any, Any]:
    """One optimiser step on the batch it is given (the whole batch, or one shard)."""
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def shard_step(params: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> tuple[Any, Any, Any]:
    """The per-device step: local gradients, averaged over the mesh with ``lax.pmean``."""
    # Each device differentiates its own shard's loss (params enter as per-device copies),
    # then the gradients are averaged explicitly, as in classic data parallelism.
    local = lax.pcast(params, "data", to="varying")
    loss, grads = jax.value_and_grad(loss_fn)(local, x, y)
    grads = lax.pmean(grads, "data")
    loss = lax.pmean(loss, "data")
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def train(step: Callable[..., Any], params: Any, x: Any, y: Any, steps: int) -> Run:
    opt_state = OPTIMIZER.init(params)
    losses = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, x, y)
        losses.append(float(loss))
    return Run(losses, params)


def max_difference(a: Any, b: Any) -> float:
    """The largest absolute difference between two parameter trees (on the host)."""
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return max(float(np.max(np.abs(np.asarray(p) - np.asarray(q)))) for p, q in pairs)


def run(steps: int = 40, verbose: bool = True) -> dict[str, Run]:
    """Trains the same model three ways from the same init; returns each run.

    Args:
      steps: optimiser steps per run.
      verbose: print the loss curves and the agreement.

    Returns:
      ``{"single device": Run, "jit + shardings": Run, "shard_map + pmean": Run}``.
    """
    devices = np.array(jax.devices()[:8])
    if devices.size != 8:
        raise RuntimeError(
            f"data_parallel_haiku needs 8 devices, found {devices.size}: set "
            "XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX is imported."
        )
    mesh = Mesh(devices, ("data",))
    replicated = NamedSharding(mesh, P())
    batch = NamedSharding(mesh, P("data"))
    x, y = make_data()
    with joh.context():  # the solver inside the model becomes Haiku-aware
        params = jax.jit(MODEL.init)(jax.random.PRNGKey(42), x)
        single = jo.jit(sgd_step)  # unsharded arrays: everything on device 0
        sharded_jit = jo.jit(
            sgd_step,
            in_shardings=(replicated, replicated, batch, batch),
            out_shardings=(replicated, replicated, replicated),
        )
        sharded_map = jo.jit(
            jo.shard_map(
                shard_step,
                mesh=mesh,
                in_specs=(P(), P(), P("data"), P("data")),
                out_specs=(P(), P(), P()),
            )
        )
        runs = {
            "single device": train(single, params, x, y, steps),
            "jit + shardings": train(
                sharded_jit, params, jax.device_put(x, batch), jax.device_put(y, batch), steps
            ),
            "shard_map + pmean": train(sharded_map, params, x, y, steps),
        }
    if verbose:
        every = max(1, steps // 5)
        for name, result in runs.items():
            curve = "  ".join(f"{loss:.4f}" for loss in result.losses[::every])
            print(f"{name:>18}: loss {curve}  ... {result.losses[-1]:.4f}")
        reference = runs["single device"].params
        for name, result in runs.items():
            gap = max_difference(result.params, reference)
            print(f"{name:>18}: max |params - single device| = {gap:.2e}")
    return runs


if __name__ == "__main__":
    run()
