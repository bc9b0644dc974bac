"""jaxoverride_haiku on 8 CPU devices: ``pmap``, ``shard_map`` and ``jit`` with shardings
inside ``hk.transform``, against JAX on explicit params and state."""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxoverride as jo
import jaxoverride_haiku as joh

MESH = Mesh(np.array(jax.devices()), ("data",))
X = jnp.arange(16.0, dtype=jnp.float32).reshape(8, 2) / 16.0
KEY = jax.random.PRNGKey(0)


def test_eight_devices():
    assert jax.device_count() == 8


def _dense(params, x):
    return x @ params["linear"]["w"] + params["linear"]["b"]


def _counting_model(mapped):
    """A model whose body reads a Linear, pmeans its output and counts calls in state."""

    def body(x):
        count = hk.get_state("count", (), jnp.int32, jnp.zeros)
        hk.set_state("count", count + 1)
        return lax.pmean(jnp.tanh(hk.Linear(2)(x)), "data")

    return hk.transform_with_state(lambda x: mapped(body)(x))


SHARD_MAPPED = _counting_model(
    lambda body: jo.shard_map(body, mesh=MESH, in_specs=P("data"), out_specs=P())
)
PMAPPED = _counting_model(lambda body: jo.pmap(body, axis_name="data"))
UNMAPPED = hk.transform_with_state(lambda x: hk.Linear(2)(x))


@pytest.mark.parametrize("model", [SHARD_MAPPED, PMAPPED], ids=["shard_map", "pmap"])
def test_init_and_apply_match_jax_on_explicit_params(model):
    with jax.checking_leaks(), joh.context():
        params, state = model.init(KEY, X)
        at_init, _ = model.apply(params, state, None, X)
        out, new_state = model.apply(params, state, None, X)
        jitted, jitted_state = jax.jit(model.apply)(params, state, None, X)
    # Parameters are created as an unmapped call creates them: same names and shapes.
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, UNMAPPED.init(KEY, X[:1])[0])
    assert int(state["~"]["count"]) == 0
    assert int(new_state["~"]["count"]) == 1 == int(jitted_state["~"]["count"])
    reference = jnp.tanh(_dense(params, X)).mean(0, keepdims=True)
    if model is PMAPPED:  # pmap keeps the device axis: every device holds the mean
        reference = jnp.broadcast_to(reference[0], (8, 2))
    np.testing.assert_allclose(out, reference, rtol=1e-6)
    np.testing.assert_allclose(jitted, reference, rtol=1e-6)
    np.testing.assert_allclose(at_init, reference, rtol=1e-6)


def test_init_output_equals_apply_output():
    seen = []

    def forward(x):
        def body(x):
            return lax.psum(hk.Linear(2, w_init=jnp.ones)(x), "data")

        out = jo.shard_map(body, mesh=MESH, in_specs=P("data"), out_specs=P())(x)
        seen.append(out)
        return out

    model = hk.transform(forward)
    with jax.checking_leaks(), joh.context():
        params = model.init(KEY, X)
        out = model.apply(params, None, X)
    np.testing.assert_allclose(seen[0], out)
    np.testing.assert_allclose(out, jnp.sum(X @ jnp.ones((2, 2)), 0, keepdims=True), rtol=1e-6)


def test_gradients_through_shard_map_match_jax():
    def loss_reference(params, x):
        def body(p, x):
            return lax.pmean(jnp.sum(jnp.tanh(_dense(p, x)) ** 2), "data")

        return jax.shard_map(body, mesh=MESH, in_specs=(P(), P("data")), out_specs=P())(params, x)

    model = hk.transform(
        lambda x: jo.shard_map(
            lambda x: lax.pmean(jnp.sum(jnp.tanh(hk.Linear(2)(x)) ** 2), "data"),
            mesh=MESH,
            in_specs=P("data"),
            out_specs=P(),
        )(x)
    )
    with joh.context():
        with jax.checking_leaks():
            params = model.init(KEY, X)
        # Not under checking_leaks: JAX 0.10.2 reports a leak for jit(grad(shard_map))
        # of plain JAX code too (a tracer kept by its own weakref.finalize registry).
        grads = jax.jit(jax.grad(lambda p: model.apply(p, None, X)))(params)
        eager = jax.grad(lambda p: model.apply(p, None, X))(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), grads, eager)
    expected = jax.grad(loss_reference)(params, X)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), grads, expected)


def test_rng_key_is_the_same_on_every_device():
    def forward(x):
        def body(x):
            return x + jax.random.uniform(hk.next_rng_key(), x.shape[1:])

        return jo.shard_map(body, mesh=MESH, in_specs=P("data"), out_specs=P("data"))(x)

    model = hk.transform(forward)
    with joh.context():
        out = model.apply({}, jax.random.PRNGKey(3), X)
    noise = np.asarray(out - X)
    np.testing.assert_allclose(noise, np.broadcast_to(noise[0], noise.shape))
    expected = jax.random.uniform(hk.PRNGSequence(jax.random.PRNGKey(3)).__next__(), (2,))
    np.testing.assert_allclose(noise[0], expected, rtol=1e-6)


def test_state_varying_over_the_mesh_is_a_clear_error():
    def forward(x):
        def body(x):
            total = hk.get_state("total", (), jnp.float32, jnp.zeros)
            hk.set_state("total", total + x.sum())  # differs per device: not reduced
            return x

        return jo.shard_map(body, mesh=MESH, in_specs=P("data"), out_specs=P("data"))(x)

    model = hk.transform_with_state(forward)
    with joh.context():
        with pytest.raises(ValueError, match=r"~/total.*'data'.*pmean or jax.lax.psum"):
            model.apply({}, {"~": {"total": jnp.float32(0)}}, None, X)
        with pytest.raises(ValueError, match=r"~/total"):
            model.init(KEY, X)


def test_pmap_static_and_unmapped_arguments():
    def forward(x, scale):
        def body(x, scale, power):
            return lax.psum(hk.Linear(2)(x) * scale**power, "i")

        return jo.pmap(body, axis_name="i", in_axes=(0, None), static_broadcasted_argnums=2)(
            x, scale, 2
        )

    model = hk.transform(forward)
    with jax.checking_leaks(), joh.context():
        params = model.init(KEY, X, jnp.float32(3.0))
        out = model.apply(params, None, X, jnp.float32(3.0))
    expected = (_dense(params, X) * 9.0).sum(0)
    np.testing.assert_allclose(out, jnp.broadcast_to(expected, (8, 2)), rtol=1e-5)


SINGLE = NamedSharding(MESH, P("data"))
REPLICATED = NamedSharding(MESH, P())


@pytest.mark.parametrize(
    ("in_shardings", "out_shardings", "spec"),
    [
        (SINGLE, SINGLE, P("data")),  # one sharding for every argument and output
        ((SINGLE, REPLICATED), REPLICATED, P()),  # one per positional argument
        ([SINGLE, None], {"h": SINGLE, "s": REPLICATED}, P("data")),  # a list, a tree
    ],
    ids=["single", "tuple", "tree"],
)
def test_jit_with_shardings_inside_a_transform(in_shardings, out_shardings, spec):
    def forward(x, y):
        def step(x, y):
            h = hk.Linear(2)(x) + y
            return {"h": h, "s": h.sum()} if isinstance(out_shardings, dict) else h

        return jo.jit(step, in_shardings=in_shardings, out_shardings=out_shardings)(x, y)

    model = hk.transform(forward)
    y = jnp.ones((8, 2))
    with jax.checking_leaks(), joh.context():
        params = model.init(KEY, X, y)
        out = model.apply(params, None, X, y)
    h = out["h"] if isinstance(out, dict) else out
    np.testing.assert_allclose(h, _dense(params, X) + y, rtol=1e-6)
    assert h.sharding.is_equivalent_to(NamedSharding(MESH, spec), 2)
    assert params["linear"]["w"].shape == (2, 2)


def test_outside_a_transform_the_neutral_functions_are_jax():
    body = jo.shard_map(lambda x: lax.psum(x, "data"), mesh=MESH, in_specs=P("data"), out_specs=P())
    with joh.context():
        out = body(jnp.arange(8.0))
    np.testing.assert_allclose(out, [28.0])
