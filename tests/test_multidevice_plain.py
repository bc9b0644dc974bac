"""jaxoverride_plain on 8 CPU devices: init-safe ``shard_map``, ``pmap`` and ``jit`` with
shardings, with collectives in the mapped body, against the same code run at apply."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxoverride as jo
import jaxoverride_plain as plain

MESH = Mesh(np.array(jax.devices()), ("data",))
X = jnp.arange(16.0, dtype=jnp.float32).reshape(8, 2) / 16.0


class Store:
    """A lazy parameter store: creates ``w`` on first use at init, from shapes only."""

    def __init__(self) -> None:
        self.params: dict[str, jax.Array] = {}
        self.created_from: list[tuple[int, ...]] = []

    def dense(self, x: jax.Array) -> jax.Array:
        if plain.is_initializing() and "w" not in self.params:
            self.created_from.append(x.shape)
            self.params["w"] = jnp.full((x.shape[-1], 2), 0.5) * 1.0
        return jnp.tanh(x @ self.params["w"])


def _run(mapped, store: Store) -> jax.Array:
    with plain.context():
        with jax.checking_leaks(), plain.init_context():
            at_init = mapped(X)
        assert isinstance(store.params["w"], jax.Array)
        assert not isinstance(store.params["w"], jax.core.Tracer)
        at_apply = mapped(X)
    np.testing.assert_allclose(at_init, at_apply, rtol=1e-6)
    return at_apply


@pytest.mark.parametrize("in_specs", [P("data"), (P("data"),)], ids=["single", "tuple"])
def test_shard_map_creates_on_one_block_with_collectives(in_specs):
    store = Store()
    mapped = jo.shard_map(
        lambda x: lax.pmean(store.dense(x), "data") + lax.axis_index("data"),
        mesh=MESH,
        in_specs=in_specs,
        out_specs=P("data"),
    )
    out = _run(mapped, store)
    assert store.created_from == [(1, 2)]  # the block of one device, not the whole batch
    mean = jnp.tanh(X @ store.params["w"]).mean(0)
    np.testing.assert_allclose(out, mean + jnp.arange(8.0)[:, None], rtol=1e-6)


def test_shard_map_without_collectives_creates_directly():
    store = Store()
    mapped = jo.shard_map(store.dense, mesh=MESH, in_specs=P("data"), out_specs=P("data"))
    out = _run(mapped, store)
    assert store.created_from == [(1, 2)]
    np.testing.assert_allclose(out, jnp.tanh(X @ store.params["w"]), rtol=1e-6)


def test_shard_map_with_the_mesh_in_context():
    store = Store()
    with jax.set_mesh(MESH):
        mapped = jo.shard_map(
            lambda x: lax.psum(store.dense(x), "data"), in_specs=P("data"), out_specs=P()
        )
        out = _run(mapped, store)
    assert store.created_from == [(1, 2)]
    np.testing.assert_allclose(out[0], jnp.tanh(X @ store.params["w"]).sum(0), rtol=1e-5)


def test_inferred_specs_read_the_arguments_sharding():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    x = jax.device_put(X, NamedSharding(mesh, P("data")))
    (block,) = plain.shard_block_arguments((x,), jax.shard_map.__kwdefaults__["in_specs"], mesh)
    np.testing.assert_allclose(block, X[:1])


def test_pmap_with_a_collective_creates_on_one_slice():
    store = Store()
    mapped = jo.pmap(lambda x: lax.psum(store.dense(x), "i"), axis_name="i")
    out = _run(mapped, store)
    assert store.created_from == [(2,)]
    expected = jnp.tanh(X @ store.params["w"]).sum(0)
    np.testing.assert_allclose(out, jnp.broadcast_to(expected, (8, 2)), rtol=1e-5)


def test_jit_with_shardings_creates_outside_the_trace():
    store = Store()
    sharding = NamedSharding(MESH, P("data"))
    mapped = jo.jit(store.dense, in_shardings=sharding, out_shardings=sharding)
    out = _run(mapped, store)
    assert store.created_from == [(8, 2)]
    assert out.sharding.is_equivalent_to(sharding, 2)


def test_an_unrelated_name_error_is_not_swallowed():
    def body(x):
        if plain.is_initializing():
            raise NameError("unbound axis name: other")
        return x

    mapped = jo.shard_map(body, mesh=MESH, in_specs=P("data"), out_specs=P("data"))
    with plain.context(), plain.init_context(), pytest.raises(NameError, match="other"):
        mapped(X)


def test_shard_block_arguments_splits_named_dimensions():
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    blocks = plain.shard_block_arguments(
        (jnp.zeros((8, 6)), {"k": jnp.zeros((4, 3))}), (P(("a", "b")), P(None, "b")), mesh
    )
    assert jax.tree.map(jnp.shape, blocks) == ((1, 6), {"k": (4, 1)})
