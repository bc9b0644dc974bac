"""jaxoverride_dag: loops and branches keep the sharing of carries, operands and outputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxoverride as jo
import jaxoverride_dag as dag
from _dag_nodes import Node
from jaxoverride import lax as jlax

# A mutable node: bodies update it in place, so every alias sees the update.
Cell = Node


def shared_state():
    cell = Cell(jnp.zeros(2))
    return {"a": cell, "b": cell, "act": jnp.tanh}


def bump(state, amount=1.0):
    state["a"].value = state["a"].value + amount  # in place: "b" is the same cell
    return state


def test_scan_carry_keeps_sharing_and_statics_and_xs_sharing():
    xs_leaf = jnp.arange(3.0)
    seen = []

    def body(state, x):
        seen.append((state["a"] is state["b"], x["p"] is x["q"]))
        return bump(state, x["p"]), {"y": state["a"].value, "same": state["a"].value}

    with dag.context():
        state, ys = jlax.scan(body, shared_state(), {"p": xs_leaf, "q": xs_leaf})
    assert seen == [(True, True)]
    assert state["a"] is state["b"] and state["act"] is jnp.tanh
    assert ys["y"] is ys["same"]
    np.testing.assert_array_equal(state["a"].value, [3.0, 3.0])
    np.testing.assert_array_equal(ys["y"][:, 0], [0.0, 1.0, 3.0])  # after each bump


def test_while_and_fori_loops_keep_sharing():
    with dag.context():
        w = jlax.while_loop(lambda s: s["a"].value[0] < 3, bump, shared_state())
        f = jlax.fori_loop(0, 4, lambda i, s: bump(s), shared_state())
        in_jit = jo.jit(lambda s: jlax.fori_loop(0, 2, lambda i, s: bump(s), s))(shared_state())
    for out, want in ((w, 3.0), (f, 4.0), (in_jit, 2.0)):
        assert out["a"] is out["b"]
        np.testing.assert_array_equal(out["b"].value, [want, want])


def test_cond_and_switch_keep_operand_and_output_sharing():
    seen = []

    def branch(scale):
        def run(s):
            seen.append(s["a"] is s["b"])
            return bump(s, scale)

        return run

    with dag.context():
        c = jlax.cond(True, branch(1.0), branch(2.0), shared_state())
        s = jlax.switch(2, [branch(1.0), branch(2.0), branch(3.0)], shared_state())
        c_kw = jlax.cond(False, branch(1.0), branch(2.0), operand=shared_state())
    assert all(seen)
    for out, want in ((c, 1.0), (s, 3.0), (c_kw, 2.0)):
        assert out["a"] is out["b"] and out["act"] is jnp.tanh
        np.testing.assert_array_equal(out["a"].value, [want, want])


def test_map_keeps_sharing_in_inputs_and_outputs():
    xs = jnp.arange(6.0).reshape(3, 2)
    seen = []

    def twice(t):
        seen.append(t["p"] is t["q"])
        y = t["p"] * 2
        return y, y

    with dag.context():
        out = jlax.map(twice, {"p": xs, "q": xs})
        batched = jlax.map(lambda t: {"y": t["p"] + 1, "tag": "b"}, {"p": xs}, batch_size=2)
    assert seen == [True] and out[0] is out[1]
    np.testing.assert_array_equal(out[0], xs * 2)
    assert batched["tag"] == "b"
    np.testing.assert_array_equal(batched["y"], xs + 1)


def test_loop_values_match_jax_on_the_unshared_equivalent():
    def body(c, x):
        return {"a": c["a"] * 0.5 + x, "b": c["b"] * 0.5 + x}, c["a"].sum()

    init = {"a": jnp.ones(3), "b": jnp.ones(3)}
    xs = jnp.arange(4.0)
    with dag.context():
        ours = jlax.scan(body, init, xs)
    want = jax.lax.scan(body, init, xs)
    for got, exp in zip(
        jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(want), strict=True
    ):
        np.testing.assert_allclose(got, exp)


def test_nested_control_flow_inside_jit_and_grad():
    def loss(state):
        final = jlax.fori_loop(0, 3, lambda i, s: bump(s, 0.5), state)
        return jnp.sum(final["a"].value ** 2)

    with dag.context():
        g = jo.jit(jo.grad(loss))(shared_state())
    assert g["a"] is g["b"] and g["act"] is None
    np.testing.assert_allclose(g["a"].value, [3.0, 3.0])
