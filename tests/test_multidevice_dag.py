"""jaxoverride_dag on 8 CPU devices: jit with trees of shardings, and shard_map."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxoverride as jo
import jaxoverride_dag as dag

N = 8  # devices: the ``mesh`` fixture of conftest.py


def tied():
    w = jnp.arange(float(N))
    return {"enc": w, "dec": w, "act": jnp.tanh, "name": "tied"}


def step(p, x):
    y = p["act"](p["enc"] * x) * p["dec"]
    return {"y": y, "enc": p["enc"], "dec": p["dec"], "act": p["act"], "name": p["name"]}


def reference(w, x):
    return jnp.tanh(w * x) * w


def test_jit_tree_of_in_and_out_shardings_matches_raw_jax(mesh):
    data, rep = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    p, x = tied(), jnp.linspace(0.0, 1.0, N)
    in_sh = ({"enc": data, "dec": None, "act": None, "name": None}, rep)
    out_sh = {"y": rep, "enc": data, "dec": None, "act": None, "name": None}
    with jax.checking_leaks(), dag.context():
        out = jo.jit(step, in_shardings=in_sh, out_shardings=out_sh)(p, x)
    assert out["enc"] is out["dec"]  # sharing survives
    assert out["act"] is jnp.tanh and out["name"] == "tied"  # static leaves ride through
    assert out["y"].sharding.is_equivalent_to(rep, 1)
    assert out["enc"].sharding.is_equivalent_to(data, 1)
    expected = jax.jit(reference, in_shardings=(data, rep), out_shardings=rep)(p["enc"], x)
    np.testing.assert_allclose(out["y"], expected, rtol=1e-6)


def test_jit_single_sharding_and_static_args(mesh):
    data = NamedSharding(mesh, P("data"))

    traces = []

    def scaled(p, n, x):
        traces.append(n)
        return {"y": p["enc"] * n + x, "w": p["dec"]}

    with dag.context():
        f = jo.jit(scaled, static_argnums=1, in_shardings=(data, data), out_shardings=data)
        out = f(tied(), 3, jnp.ones(N))
        again = f(tied(), 3, jnp.ones(N))  # a new tree with the same pattern: cache hit
    np.testing.assert_allclose(out["y"], jnp.arange(float(N)) * 3 + 1)
    assert out["y"].sharding.is_equivalent_to(data, 1)
    assert traces == [3]
    np.testing.assert_allclose(again["w"], out["w"])


def test_jit_conflicting_shardings_for_a_shared_leaf_name_both_positions(mesh):
    data, rep = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    in_sh = ({"enc": data, "dec": rep, "act": None, "name": None}, rep)
    with dag.context(), pytest.raises(dag.SharingError) as info:
        jo.jit(step, in_shardings=in_sh)(tied(), jnp.ones(N))
    message = str(info.value)
    assert "args[0]['enc']" in message and "args[0]['dec']" in message
    assert "in_shardings" in message and "x.copy()" in message


def test_shard_map_keeps_sharing_and_static_leaves(mesh):
    def local(p, x):
        total = jax.lax.psum(jnp.sum(p["enc"] * x), "data")
        return {"total": total, "enc": p["enc"], "dec": p["dec"], "act": p["act"]}

    specs = ({"enc": P("data"), "dec": P("data"), "act": None, "name": None}, P("data"))
    out_specs = {"total": P(), "enc": P("data"), "dec": None, "act": None}
    p, x = tied(), jnp.linspace(0.0, 1.0, N)
    with jax.checking_leaks(), dag.context():
        out = jo.shard_map(local, mesh=mesh, in_specs=specs, out_specs=out_specs)(p, x)
        jitted = jo.jit(jo.shard_map(local, mesh=mesh, in_specs=specs, out_specs=out_specs))(p, x)
    expected = jax.shard_map(
        lambda w, x: jax.lax.psum(jnp.sum(w * x), "data"),
        mesh=mesh,
        in_specs=(P("data"), P("data")),
        out_specs=P(),
    )(p["enc"], x)
    for result in (out, jitted):
        np.testing.assert_allclose(result["total"], expected, rtol=1e-6)
        assert result["enc"] is result["dec"] and result["act"] is jnp.tanh
        assert result["enc"] is not p["enc"]
        assert result["enc"].sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 1)


def test_shard_map_gradient_of_tied_weights_is_summed(mesh):
    def loss(p, x):
        def local(p, x):
            return jax.lax.psum(jnp.sum(p["act"](p["enc"] * x) * p["dec"]), "data")

        specs = ({"enc": P("data"), "dec": P("data"), "act": None, "name": None}, P("data"))
        return jo.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P())(p, x)

    p, x = tied(), jnp.linspace(0.0, 1.0, N)
    with dag.context():
        grads = jo.grad(loss)(p, x)
    expected = jax.grad(lambda w: jnp.sum(reference(w, x)))(p["enc"])
    assert grads["enc"] is grads["dec"]
    np.testing.assert_allclose(grads["enc"], expected, rtol=1e-5)


def test_shard_map_conflicting_specs_for_a_shared_leaf(mesh):
    specs = ({"enc": P("data"), "dec": P(), "act": None, "name": None}, P("data"))
    with dag.context(), pytest.raises(dag.SharingError, match="in_specs gives them different"):
        jo.shard_map(lambda p, x: x, mesh=mesh, in_specs=specs, out_specs=P("data"))(
            tied(), jnp.ones(N)
        )
