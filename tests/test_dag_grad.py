"""jaxoverride_dag: tied parameters get one summed gradient; groups as raw JAX has them."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxoverride as jo
import jaxoverride_dag as dag
from jaxoverride import lax as jlax

VOCAB, DIM, BATCH = 7, 4, 5


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Embedding:
    table: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TiedLM:
    embed: Embedding
    unembed: Embedding  # the very same Embedding object as ``embed``


def lm_loss(model: TiedLM, tokens, targets):
    h = model.embed.table[tokens]
    logits = h @ model.unembed.table.T
    picked = jnp.take_along_axis(logits, targets[:, None], axis=1)[:, 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=1) - picked)


def hand_written_gradient(table: np.ndarray, tokens: np.ndarray, targets: np.ndarray):
    """d loss / d table for the tied model, by hand: both uses, summed."""
    table = table.astype(np.float64)
    h = table[tokens]
    logits = h @ table.T
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    dlogits = p.copy()
    dlogits[np.arange(len(targets)), targets] -= 1.0
    dlogits /= len(targets)
    from_unembed = dlogits.T @ h
    dh = dlogits @ table
    from_embed = np.zeros_like(table)
    np.add.at(from_embed, tokens, dh)
    return from_embed + from_unembed


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    table = rng.normal(size=(VOCAB, DIM)).astype(np.float32)
    tokens = rng.integers(0, VOCAB, size=BATCH)
    targets = rng.integers(0, VOCAB, size=BATCH)
    return table, tokens, targets


def test_tied_embedding_gradient_matches_the_hand_written_one(data):
    table, tokens, targets = data
    embedding = Embedding(jnp.asarray(table))
    model = TiedLM(embed=embedding, unembed=embedding)
    with dag.context():
        grads = jo.jit(jo.grad(lm_loss))(model, tokens, targets)
        eager = jo.grad(lm_loss)(model, tokens, targets)
    assert grads.embed is grads.unembed and eager.embed is eager.unembed
    want = hand_written_gradient(table, tokens, targets)
    np.testing.assert_allclose(grads.embed.table, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(eager.embed.table, want, rtol=1e-5, atol=1e-6)


def test_tied_leaf_gradient_is_one_array_at_both_positions(data):
    table, tokens, targets = data
    w = jnp.asarray(table)

    def loss(p):
        return lm_loss(TiedLM(Embedding(p["in"]), Embedding(p["out"])), tokens, targets)

    with dag.context():
        grads = jo.grad(loss)({"in": w, "out": w})
    assert grads["in"] is grads["out"]
    np.testing.assert_allclose(
        grads["in"], hand_written_gradient(table, tokens, targets), rtol=1e-5, atol=1e-6
    )
    # Without the adapter the tie is invisible: JAX returns the two halves separately.
    untied = jax.grad(loss)({"in": w, "out": w})
    np.testing.assert_allclose(untied["in"] + untied["out"], grads["in"], rtol=1e-5, atol=1e-6)


def test_groups_differentiated_and_not_are_separate_as_in_jax():
    w = jnp.arange(1.0, 4.0)
    f = lambda a, b: jnp.sum(a * b)
    with dag.context():
        ours = jo.grad(f)(w, w)
        both = jo.grad(f, argnums=(0, 1))(w, w)
    np.testing.assert_array_equal(ours, jax.grad(f)(w, w))
    # Within the differentiated group, the tie holds: d/dw sum(w * w) = 2w, once.
    assert both[0] is both[1]
    np.testing.assert_array_equal(both[0], 2 * w)


def test_non_differentiable_leaves_get_none():
    p = {"w": jnp.ones(2), "steps": jnp.arange(2), "act": jax.nn.relu, "name": "layer"}

    def loss(p):
        return jnp.sum(p["act"](p["w"] * p["steps"]))

    with dag.context():
        g = jo.grad(loss)(p)
        g_int = jo.grad(loss, allow_int=True)(p)
    assert g["steps"] is None and g["act"] is None and g["name"] is None
    np.testing.assert_array_equal(g["w"], [0.0, 1.0])
    assert g_int["steps"].dtype == jax.dtypes.float0


def test_value_and_grad_with_shared_aux():
    w = jnp.arange(3.0)

    def loss(p):
        stats = {"mean": jnp.mean(p["a"]), "tag": "ok"}
        return jnp.sum(p["a"] ** 2), (stats, stats)

    with dag.context():
        (value, (s1, s2)), g = jo.value_and_grad(loss, has_aux=True)({"a": w, "b": w})
        g2, (t1, t2) = jo.grad(loss, has_aux=True)({"a": w, "b": w})
    assert s1 is s2 and s1["tag"] == "ok" and t1 is t2
    assert float(value) == 5.0
    assert g["a"] is g["b"] and g2["a"] is g2["b"]
    np.testing.assert_array_equal(g["a"], 2 * w)


def test_jacobians_and_hessian_match_jax_on_the_unshared_problem():
    w = jnp.array([0.5, -1.0, 2.0])

    def f(p):
        return {"y": jnp.sin(p["a"]) * p["b"], "s": jnp.sum(p["a"] * p["b"])}

    def f_tied(v):
        return f({"a": v, "b": v})

    with dag.context():
        fwd = jo.jacfwd(f)({"a": w, "b": w})
        rev = jo.jacrev(f)({"a": w, "b": w})
        hess = jo.hessian(lambda p: jnp.sum(jnp.sin(p["a"]) * p["b"]))({"a": w, "b": w})
    want = jax.jacfwd(f_tied)(w)
    for jac in (fwd, rev):
        assert jac["y"]["a"] is jac["y"]["b"]
        np.testing.assert_allclose(jac["y"]["a"], want["y"], rtol=1e-6)
        np.testing.assert_allclose(jac["s"]["a"], want["s"], rtol=1e-6)
    want_h = jax.hessian(lambda v: jnp.sum(jnp.sin(v) * v))(w)
    assert hess["a"]["a"] is hess["a"]["b"] and hess["a"] is hess["b"]
    np.testing.assert_allclose(hess["a"]["a"], want_h, rtol=1e-6)


def test_argnums_out_of_range_is_a_clear_error():
    with dag.context(), pytest.raises(TypeError, match="argnums=2"):
        jo.grad(lambda a: a, argnums=2)(1.0)


def _int_carry_through_rule(api, lax, custom_vjp):
    @custom_vjp
    def scale(x, n):
        return x * n, n

    def fwd(x, n):
        return (x * n, n), n

    def bwd(n, g):
        return (g[0] * n, np.zeros((), dtype=jax.dtypes.float0))

    scale.defvjp(fwd, bwd)

    def loss(x, n):
        (y, _), _ = lax.scan(lambda c, _: (scale(*c), None), (x, n), None, length=3)
        return y

    return api.grad(loss, argnums=(0, 1), allow_int=True)(1.0, 2)


def test_integer_carry_through_a_custom_vjp_in_scan_under_grad_allow_int():
    # grad(allow_int=True) hands an integer argument in as JAX's typed scalar (an int
    # subclass): a traced scalar, as in JAX, not static data.
    want = _int_carry_through_rule(jax, jax.lax, jax.custom_vjp)
    with dag.context():
        got = _int_carry_through_rule(jo, jlax, jo.custom_vjp)
    assert float(got[0]) == float(want[0]) == 8.0
    assert got[1].dtype == want[1].dtype == jax.dtypes.float0


def test_int_subclasses_are_traced_scalars_as_in_jax():
    import enum

    class Level(enum.IntEnum):
        LOW = 1
        HIGH = 2

    traces = []

    def f(x):
        traces.append(type(x))
        return x * 2

    with dag.context():
        jitted = jo.jit(f)
        assert int(jitted(Level.LOW)) == 2 and int(jitted(Level.HIGH)) == 4
    assert len(traces) == 1  # one trace for both values, as jax.jit
