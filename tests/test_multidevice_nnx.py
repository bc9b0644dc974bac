"""jaxoverride_nnx on 8 CPU devices: jit with shardings, pmap and shard_map under track."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxoverride as jo
import jaxoverride_nnx

N = 8  # devices: the ``mesh`` fixture of conftest.py


def counted_linear():
    layer = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    layer.calls = nnx.Variable(jnp.array(0))
    return layer


def batch():
    return jnp.linspace(-1.0, 1.0, N * 2).reshape(N, 2) ** 3


def _forms(mesh):
    data, rep = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    return [
        ({"in_shardings": data}, data),
        ({"in_shardings": (data, rep)}, data),
        ({"in_shardings": (data, None), "out_shardings": rep}, rep),
        ({"out_shardings": {"y": data, "s": rep}}, data),
    ]


@pytest.mark.parametrize("form", range(4))
def test_jit_shardings_apply_to_user_arguments_not_to_state(mesh, form):
    options, expected_sharding = _forms(mesh)[form]
    layer = counted_linear()
    kernel, bias = layer.kernel[...], layer.bias[...]
    x, y = batch(), jnp.ones((N, 2))
    traces = []

    def f(x, y):
        traces.append(1)
        layer.calls[...] += 1
        out = layer(x) + y
        return {"y": out, "s": out.sum()} if "out_shardings" in options else out

    with jax.checking_leaks(), jaxoverride_nnx.track(layer):
        jitted = jo.jit(f, **options)
        first = jitted(x, y)
        # The first call moved the state onto the mesh: the second retraces once for
        # the new placement (as jax.jit does for any argument), the third hits.
        jitted(x, y)
        traced = len(traces)
        second = jitted(x, y)
    out = first["y"] if isinstance(first, dict) else first
    np.testing.assert_allclose(out, x @ kernel + bias + y, rtol=1e-6)
    np.testing.assert_allclose(second["y"] if isinstance(second, dict) else second, out)
    assert out.sharding.is_equivalent_to(expected_sharding, 2)
    assert int(layer.calls[...]) == 3 and len(traces) == traced <= 2
    # The threaded state kept its own placement: the kernel was not sharded along "data".
    assert layer.kernel[...].sharding.is_fully_replicated
    assert layer.calls[...].sharding.is_fully_replicated


def test_data_parallel_train_step_matches_single_device(mesh):
    data, rep = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    x, targets = batch(), jnp.sin(batch())

    def run(**options):
        model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

        def train_step(x, targets):
            def loss(model):
                return jnp.mean((model(x) - targets) ** 2)

            value, grads = jo.value_and_grad(loss)(model)
            optimizer.update(model, grads)
            return value

        step = jo.jit(train_step, **options)
        with jaxoverride_nnx.track(model, optimizer):
            losses = [step(x, targets) for _ in range(3)]
        return losses, model.kernel[...], int(optimizer.step[...])

    sharded = run(in_shardings=(data, data), out_shardings=rep)
    single = run()
    np.testing.assert_allclose(sharded[0], single[0], rtol=1e-5)
    np.testing.assert_allclose(sharded[1], single[1], rtol=1e-5)
    assert sharded[2] == single[2] == 3
    assert sharded[0][-1] < sharded[0][0]


def _reference_norm():
    return nnx.BatchNorm(2, use_running_average=False, rngs=nnx.Rngs(0))


def test_pmap_batchnorm_stats_are_written_once_replicated():
    norm = nnx.BatchNorm(2, use_running_average=False, axis_name="i", rngs=nnx.Rngs(0))
    reference = _reference_norm()
    xs = batch()
    with jax.checking_leaks(), jaxoverride_nnx.track(norm):
        out = jo.pmap(lambda v: norm(v[None])[0], axis_name="i")(xs)
    expected = reference(xs)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(norm.mean[...], reference.mean[...], rtol=1e-6)
    np.testing.assert_allclose(norm.var[...], reference.var[...], rtol=1e-6)
    assert norm.mean[...].shape == (2,)  # one value, not one per device


def test_shard_map_batchnorm_under_jit_and_eagerly(mesh):
    norm = nnx.BatchNorm(2, use_running_average=False, axis_name="data", rngs=nnx.Rngs(0))
    reference = _reference_norm()
    xs = batch()
    sharded = jo.shard_map(norm, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    with jax.checking_leaks(), jaxoverride_nnx.track(norm):
        eager = sharded(xs)
        jitted = jo.jit(lambda v: sharded(v))(xs)
    np.testing.assert_allclose(eager, reference(xs), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jitted, reference(xs), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(norm.mean[...], reference.mean[...], rtol=1e-6)
    assert jitted.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 2)
    assert norm.mean[...].sharding.is_fully_replicated


def test_modules_passed_as_broadcast_arguments(mesh):
    layer = counted_linear()
    x = batch()

    def f(model, v):
        model.calls[...] += 1
        return model(v)

    with jaxoverride_nnx.context():
        by_pmap = jo.pmap(f, in_axes=(None, 0))(layer, x)
        by_shard_map = jo.shard_map(f, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"))(
            layer, x
        )
    expected = x @ layer.kernel[...] + layer.bias[...]
    np.testing.assert_allclose(by_pmap, expected, rtol=1e-6)
    np.testing.assert_allclose(by_shard_map, expected, rtol=1e-6)
    assert int(layer.calls[...]) == 2


def _per_device_update(counter):
    def bad(v):
        counter[...] += v.sum()
        return v

    return bad


@pytest.mark.parametrize("api", ["pmap", "shard_map"])
def test_state_that_differs_across_devices_is_refused_by_name(mesh, api):
    model = counted_linear()
    model.total = nnx.Variable(jnp.zeros(()))
    bad = _per_device_update(model.total)
    with jaxoverride_nnx.track(model):
        if api == "pmap":
            mapped = jo.pmap(bad, axis_name="data")
        else:
            mapped = jo.shard_map(bad, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
        with pytest.raises(jaxoverride_nnx.StructureChangeError) as info:
            mapped(batch())
    message = str(info.value)
    assert "`Linear.total`" in message and "'data'" in message and "pmean" in message
    assert float(model.total[...]) == 0.0  # nothing was written


def test_pmean_reduced_state_is_accepted_by_both(mesh):
    total = nnx.Variable(jnp.zeros(()))

    def good(v):
        total[...] += jax.lax.pmean(v.sum(), "data")
        return v

    xs = batch() + 1.0
    with jaxoverride_nnx.track(total):
        jo.pmap(good, axis_name="data")(xs)
        jo.shard_map(good, mesh=mesh, in_specs=P("data"), out_specs=P("data"))(xs)
    mean_per_device = float(jnp.mean(xs.sum(axis=1)))
    np.testing.assert_allclose(total[...], 2 * mean_per_device, rtol=1e-5)


def test_bad_specs_for_modules_and_inferred_specs_are_clear_errors(mesh):
    layer = counted_linear()
    with jaxoverride_nnx.track(layer):
        with pytest.raises(ValueError, match=r"in_specs=.*NNX module.*P\(\)"):
            jo.shard_map(lambda m, v: m(v), mesh=mesh, in_specs=P("data"), out_specs=P())(
                layer, batch()
            )
        with pytest.raises(ValueError, match=r"got in_axes.*NNX module.*in_axes=None"):
            jo.pmap(lambda m, v: m(v), in_axes=0)(layer, batch())
        with pytest.raises(ValueError, match="needs explicit in_specs"):
            jo.shard_map(lambda v: layer(v), mesh=mesh, out_specs=P("data"))(batch())
