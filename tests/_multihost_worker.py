"""One process of the two-process ``jax.distributed`` check in ``test_multihost.py``.

Run as ``python _multihost_worker.py PROCESS_ID PORT``. Each process owns 4 CPU devices
of a global 8-device mesh, and the two processes talk through JAX's gloo collectives on
localhost. Every check compares the neutral API (idle, and through a pass-through
override context) and the Haiku and NNX adapters with raw JAX on the same global arrays,
and prints one ``ok <name>`` line per check; any mismatch raises.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
PROCESS_ID, PORT = int(sys.argv[1]), sys.argv[2]
jax.distributed.initialize(
    coordinator_address=f"localhost:{PORT}", num_processes=2, process_id=PROCESS_ID
)

import haiku as hk  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jaxoverride as jo  # noqa: E402
import jaxoverride_haiku as joh  # noqa: E402
import jaxoverride_nnx as jon  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from fpsolve import fixed_point  # noqa: E402

assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4

# Auto axes: with explicit ones (make_mesh's default), JAX 0.10.2 itself fails to vmap a
# while_loop whose carry starts unbatched over a batch-sharded array.
MESH = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
BATCH = NamedSharding(MESH, P("data"))
REPLICATED = NamedSharding(MESH, P())
N = 4


def global_batch() -> jax.Array:
    """An (8, N) array sharded by rows; each process supplies its own 4 rows."""
    rows = np.arange(8 * N, dtype=np.float32).reshape(8, N) / (8 * N)
    local = rows[4 * PROCESS_ID : 4 * PROCESS_ID + 4]
    return jax.make_array_from_process_local_data(BATCH, local)


def gathered(x: jax.Array) -> np.ndarray:
    """The whole value of a (possibly sharded) global array, on this process."""
    replicated = jax.jit(lambda a: a, out_shardings=REPLICATED)(x)
    return np.asarray(replicated.addressable_data(0))


def same(name: str, actual: jax.Array, expected: jax.Array) -> None:
    np.testing.assert_allclose(gathered(actual), gathered(expected), rtol=1e-6, atol=1e-6)
    assert actual.sharding.is_equivalent_to(expected.sharding, actual.ndim), (
        f"{name}: sharding {actual.sharding} != {expected.sharding}"
    )
    print(f"ok {name}", flush=True)


def _passthrough(name: str):
    def impl(*args, **kwargs):
        return jo.next_impl(name)(*args, **kwargs)

    return impl


PASSTHROUGH = jo.override_context(
    {name: _passthrough(name) for name in ("jit", "shard_map", "pmap", "lax.while_loop")},
    name="pass-through",
)


def check_neutral_api(x: jax.Array) -> None:
    def total(a):
        return jax.lax.psum(a.sum(), "data")

    def step(a):
        return jnp.tanh(a) * 2.0

    for label, context in (("idle", contextlib.nullcontext()), ("context", PASSTHROUGH)):
        with context:
            jitted = jo.jit(step, in_shardings=BATCH, out_shardings=REPLICATED)(x)
            mapped = jo.jit(jo.shard_map(total, mesh=MESH, in_specs=P("data"), out_specs=P()))(x)
            local = jnp.arange(4.0 * N).reshape(4, N) + 16.0 * PROCESS_ID
            summed = jo.pmap(lambda a: jax.lax.psum(a, "i"), axis_name="i")(local)
        same(f"jit-shardings/{label}", jitted, jax.jit(step, out_shardings=REPLICATED)(x))
        reference = jax.jit(jax.shard_map(total, mesh=MESH, in_specs=P("data"), out_specs=P()))
        same(f"shard_map/{label}", mapped, reference(x))
        expected = jax.pmap(lambda a: jax.lax.psum(a, "i"), axis_name="i")(local)
        np.testing.assert_array_equal(np.asarray(summed), np.asarray(expected))
        print(f"ok pmap-across-processes/{label}", flush=True)


def check_haiku(x: jax.Array) -> None:
    def model(batch):
        layer = hk.Linear(N, name="layer")
        return jo.vmap(
            lambda row: fixed_point(lambda z, r: jnp.tanh(0.5 * layer(z) + r), jnp.zeros(N), row)
        )(batch).value

    transformed = hk.transform(model)
    with joh.context():
        params = transformed.init(jax.random.key(0), jnp.zeros((1, N)))
        apply = jo.jit(
            transformed.apply, in_shardings=(REPLICATED, None, BATCH), out_shardings=BATCH
        )
        solved = apply(params, None, x)

    def reference(params, batch):
        w, b = params["layer"]["w"], params["layer"]["b"]
        return jax.vmap(
            lambda row: fixed_point(lambda z, r: jnp.tanh(0.5 * (z @ w + b) + r), jnp.zeros(N), row)
        )(batch).value

    same("haiku-apply-sharded", solved, jax.jit(reference, out_shardings=BATCH)(params, x))


class Map(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.layer = nnx.Linear(N, N, rngs=rngs)

    def __call__(self, z: jax.Array, r: jax.Array) -> jax.Array:
        return jnp.tanh(0.5 * self.layer(z) + r)


def check_nnx(x: jax.Array) -> None:
    module = Map(nnx.Rngs(0))

    def solve(batch):
        return jo.vmap(lambda row: fixed_point(module, jnp.zeros(N), row).value)(batch)

    with jon.track(module):
        solved = jo.jit(solve, in_shardings=BATCH, out_shardings=BATCH)(x)
    graphdef, state = nnx.split(module)

    @jax.jit
    def reference(state, batch):
        pure = nnx.merge(graphdef, state)
        return jax.vmap(lambda row: fixed_point(pure, jnp.zeros(N), row, jit=False).value)(batch)

    same("nnx-track-sharded", solved, jax.jit(reference, out_shardings=BATCH)(state, x))


if __name__ == "__main__":
    batch = global_batch()
    check_neutral_api(batch)
    check_haiku(batch)
    check_nnx(batch)
    jax.distributed.shutdown()
    print("done", flush=True)
