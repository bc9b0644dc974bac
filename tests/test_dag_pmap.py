"""jaxoverride_dag: vmap and pmap (8 CPU devices) with shared models and non-array leaves."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxoverride as jo
import jaxoverride_dag as dag

N = 8


@pytest.fixture(autouse=True)
def _eight_devices():
    if jax.device_count() < N:
        pytest.skip(f"needs {N} devices; tests/conftest.py sets XLA_FLAGS for 8 CPU devices")


def tied_model():
    w = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
    return {"encoder": w, "decoder": w, "act": jnp.tanh, "name": "tied"}


def loss_fn(model, x, y):
    hidden = model["act"](x @ model["encoder"].T)
    return jnp.mean((hidden @ model["decoder"] - y) ** 2)


def test_pmap_returns_a_model_with_statics_and_out_axes_prefix():
    model = tied_model()
    xs = jnp.arange(N * 3.0).reshape(N, 3)

    def f(m, x):
        return m, {"out": x * 2, "tag": "shard"}

    with dag.context():
        m, aux = jo.pmap(
            f, axis_name="d", in_axes=(None, 0), out_axes=(None, {"out": 0, "tag": None})
        )(model, xs)
        stacked, _ = jo.pmap(f, in_axes=(None, 0), out_axes=0)(model, xs)
    assert m["encoder"] is m["decoder"] and m["act"] is jnp.tanh and m["name"] == "tied"
    np.testing.assert_array_equal(m["encoder"], model["encoder"])
    assert aux["tag"] == "shard"
    np.testing.assert_array_equal(aux["out"], xs * 2)
    assert stacked["encoder"] is stacked["decoder"] and stacked["encoder"].shape == (N, 2, 3)


def test_data_parallel_training_step_with_pmean_and_tied_weights():
    model = tied_model()
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(N, 4, 3)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(N, 4, 3)), jnp.float32)

    def step(m, x, y):
        loss, grads = jo.value_and_grad(loss_fn)(m, x, y)
        grads = jax.lax.pmean(grads["encoder"], "batch")
        new = dag.tree_map(lambda p: p, m)  # fresh model, same sharing
        new["encoder"] = new["decoder"] = m["encoder"] - 0.1 * grads
        return new, jax.lax.pmean(loss, "batch")

    with dag.context():
        new, loss = jo.pmap(step, axis_name="batch", in_axes=(None, 0, 0), out_axes=(None, None))(
            model, x, y
        )

    # The reference: one device, the whole batch, the tie written out by hand.
    def flat_loss(w):
        return loss_fn(
            {"encoder": w, "decoder": w, "act": jnp.tanh}, x.reshape(-1, 3), y.reshape(-1, 3)
        )

    want_loss, want_grad = jax.value_and_grad(flat_loss)(model["encoder"])
    assert new["encoder"] is new["decoder"] and new["act"] is jnp.tanh
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(
        new["encoder"], model["encoder"] - 0.1 * want_grad, rtol=1e-5, atol=1e-6
    )


def test_equinox_parallel_training_returns_the_model_from_pmap():
    """Equinox #115: pmap that returns the updated model, activations and all."""
    model = eqx.nn.MLP(3, 1, 8, 2, key=jax.random.PRNGKey(1))
    x = jnp.ones((N, 2, 3))
    y = jnp.zeros((N, 2, 1))

    def step(m, x, y):
        grads = jo.grad(lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))(m)
        grads = jax.lax.pmean(grads, "i")
        return jax.tree_util.tree_map(lambda p, g: p if g is None else p - 0.1 * g, m, grads)

    with dag.context():
        new = jo.pmap(step, axis_name="i", in_axes=(None, 0, 0), out_axes=None)(model, x, y)
    params, static = eqx.partition(model, eqx.is_array)
    grads = jax.grad(lambda p: jnp.mean((jax.vmap(eqx.combine(p, static))(x[0]) - y[0]) ** 2))(
        params
    )
    want = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
    assert new.activation is model.activation and new.final_activation is model.final_activation
    for got, exp in zip(
        jax.tree_util.tree_leaves(eqx.filter(new, eqx.is_array)),
        jax.tree_util.tree_leaves(want),
        strict=True,
    ):
        np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-6)


def test_pmap_shared_array_under_two_in_axes_is_mapped_once_per_axis():
    w = jnp.arange(N * N, dtype=jnp.float32).reshape(N, N)
    node = {"w": w}
    want = jax.pmap(lambda a, b: a + b, in_axes=(0, 1))(w, w)
    with dag.context():
        got = jo.pmap(lambda a, b: a + b, in_axes=(0, 1))(w, w)
        with pytest.raises(dag.SharingError, match=r"args\[0\]\['w'\] and args\[1\]\['w'\]"):
            jo.pmap(lambda a, b: a["w"] + b["w"], in_axes=(0, 1))(node, node)
    np.testing.assert_array_equal(got, want)


def test_vmap_out_axes_prefix_and_unmapped_static_outputs():
    xs = jnp.arange(6.0).reshape(3, 2)
    model = {"w": jnp.ones(2), "act": jnp.tanh}

    def f(m, x):
        y = m["act"](x * m["w"])
        return {"model": m, "y": y, "y2": y, "name": "out"}

    with dag.context():
        out = jo.vmap(
            f, in_axes=(None, 0), out_axes={"model": None, "y": 1, "y2": 1, "name": None}
        )(model, xs)
        default = jo.vmap(f, in_axes=(None, 0))(model, xs)
    assert out["y"] is out["y2"] and out["y"].shape == (2, 3)
    assert out["model"]["act"] is jnp.tanh and out["name"] == "out"
    assert out["model"]["w"].shape == (2,)
    np.testing.assert_allclose(out["y"], np.tanh(xs).T, rtol=1e-6)
    assert default["model"]["w"].shape == (3, 2)  # out_axes=0 broadcasts as jax.vmap does


def test_vmap_in_axes_over_shared_leaf_and_kwargs():
    xs = jnp.arange(6.0).reshape(3, 2)
    seen = []

    def f(p, scale):
        seen.append(p["a"] is p["b"])
        return p["a"] * scale

    with dag.context():
        out = jo.vmap(f)({"a": xs, "b": xs}, scale=jnp.arange(3.0))
        # One array under axes 0 and 1 is two arrays, of sizes 3 and 2: JAX's error.
        with pytest.raises(ValueError, match="inconsistent sizes"):
            jo.vmap(lambda a, b: a + b, in_axes=(0, 1))(xs, xs)
    assert seen == [True]
    np.testing.assert_array_equal(out, xs * jnp.arange(3.0)[:, None])


def test_pmap_of_a_partial_built_twice_runs_and_is_shared():
    # jax's lax_control_flow_test testIssue804: pmap of partial(lax.scan, body, 0.0).
    # A partial is shared through jo.reuse_jit by a weak reference to the state.
    import functools

    f = functools.partial(jax.lax.scan, lambda c, x: (c + jax.lax.psum(x, "i"), c), 0.0)
    xs = jnp.ones((jax.device_count(), 4))
    with dag.context():
        first = jo.pmap(f, axis_name="i")(xs)
        second = jo.pmap(f, axis_name="i")(xs)
    expected = jax.pmap(f, axis_name="i")(xs)
    jax.tree.map(np.testing.assert_array_equal, first, expected)
    jax.tree.map(np.testing.assert_array_equal, second, expected)
