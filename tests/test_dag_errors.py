"""jaxoverride_dag: clear errors that name the path, and nothing left half-done after one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxoverride as jo
import jaxoverride_dag as dag
from _dag_nodes import Node
from jaxoverride import _stack, lax as jlax


class Unhashable:
    """Equality without a hash: Python makes such objects unhashable."""

    def __eq__(self, other):
        return isinstance(other, Unhashable)

    __hash__ = None  # type: ignore[assignment]


def test_unhashable_static_leaf_names_its_path():
    with dag.context(), pytest.raises(TypeError) as info:
        jo.jit(lambda p, q: p["w"])({"w": jnp.ones(2)}, q={"cfg": [1, Unhashable()]})
    message = str(info.value)
    assert "kwargs['q']['cfg'][1]" in message
    assert "Unhashable" in message and "hashable" in message and "Fix" in message


# A pytree node with identity: losing a tie between two boxes is an error.
Box = Node


def test_scan_body_that_breaks_a_node_tie_names_the_path():
    box = Box(jnp.ones(2))

    def body(c, _):
        return {"a": Box(c["a"].value + 1), "b": Box(c["b"].value + 1)}, None  # two new boxes

    with dag.context(), pytest.raises(dag.SharingError) as info:
        jlax.scan(body, {"a": box, "b": box}, length=2)
    message = str(info.value)
    assert "lax.scan" in message and "carry['b']" in message and "carry['a']" in message


def test_while_and_fori_body_that_ties_two_nodes_names_the_path():
    def body(c):
        return [Box(c[0].value + 1)] * 2  # one node at both positions

    init = [Box(jnp.zeros(2)), Box(jnp.zeros(2))]
    with dag.context():
        with pytest.raises(dag.SharingError, match=r"carry\[1\]"):
            jlax.while_loop(lambda c: c[0].value[0] < 2, body, init)
        with pytest.raises(dag.SharingError, match=r"lax\.fori_loop"):
            jlax.fori_loop(0, 2, lambda i, c: body(c), init)


def test_loop_body_that_changes_static_data_is_an_error():
    with dag.context(), pytest.raises(dag.SharingError, match="static value"):
        jlax.fori_loop(
            0, 2, lambda i, c: {"x": c["x"] + 1, "mode": "b"}, {"x": jnp.zeros(2), "mode": "a"}
        )


def test_branches_that_tie_nodes_differently_are_an_error():
    w = jnp.ones(2)

    def tied(x):
        box = Box(x)
        return box, box

    with dag.context(), pytest.raises(dag.SharingError, match=r"output\[1\]"):
        jlax.cond(True, tied, lambda x: (Box(x), Box(x + 1)), w)


def test_conflicting_vmap_in_axes_on_a_shared_node_names_both_paths():
    # A shared node under two mapped axes would lose its identity: an error.
    node = {"w": jnp.ones((2, 2))}
    with dag.context(), pytest.raises(dag.SharingError) as info:
        jo.vmap(lambda a, b: a["w"] + b["w"], in_axes=(0, 1))(node, node)
    message = str(info.value)
    assert "args[0]['w']" in message and "args[1]['w']" in message and "(0 and 1)" in message


def test_a_shared_array_under_two_in_axes_is_mapped_once_per_axis_as_jax():
    # The pairwise pattern of issue 21: JAX never sees array sharing, so a shared array
    # given two in_axes is one array per axis, not an error.
    R = jnp.arange(6.0).reshape(3, 2)

    def d(a, b):
        return jnp.sum((a - b) ** 2)

    want = jax.vmap(jax.vmap(d, (None, 0)), (0, None))(R, R)
    seen = []

    def tied(p):
        seen.append(p["a"] is p["b"])
        return p["a"] + p["b"].T

    w = jnp.arange(4.0).reshape(2, 2)
    with dag.context():
        got = jo.vmap(jo.vmap(d, (None, 0)), (0, None))(R, R)
        again = jo.vmap(jo.vmap(d, (None, 0)), (0, None))(R, R)
        split = jo.vmap(tied, in_axes=({"a": 0, "b": 1},))({"a": w, "b": w})
        kept = jo.vmap(tied, in_axes=({"a": 0, "b": 0},))({"a": w, "b": w})
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(again, want)
    np.testing.assert_array_equal(split, jax.vmap(lambda a, b: a + b.T, in_axes=(0, 1))(w, w))
    np.testing.assert_array_equal(kept, w + w)
    assert seen == [False, True]  # split where the axes differ, kept where they agree


def test_bad_in_axes_are_reported_like_jax():
    with dag.context():
        with pytest.raises(ValueError, match="len\\(in_axes\\)=1, len\\(args\\)=2"):
            jo.vmap(lambda a, b: a, in_axes=(0,))(jnp.ones(2), jnp.ones(2))
        with pytest.raises(TypeError, match="in_axes must be an int, None, or a tuple"):
            jo.vmap(lambda a: a, in_axes={"a": 0})
        with pytest.raises(ValueError, match="tree prefix"):
            jo.vmap(lambda p: p, in_axes=({"x": 0},))({"y": jnp.ones(2)})


def test_tree_of_shardings_with_the_wrong_arity_is_refused_with_the_fix():
    with dag.context(), pytest.raises(ValueError, match="give 2 entries"):
        jo.jit(lambda a, b: a, in_shardings=(None,))(jnp.ones(2), jnp.ones(2))
    with dag.context(), pytest.raises(ValueError, match="pass them positionally"):
        jo.jit(lambda a, b: a, in_shardings=(None,))(jnp.ones(2), b=jnp.ones(2))


def test_errors_in_user_code_propagate_once_and_leave_no_state_behind():
    calls = []

    def f(x, fail):
        calls.append(1)
        if fail:
            raise TypeError("user error")
        return x * 2

    w = jnp.ones(2)
    with dag.context():
        g = jo.jit(f, static_argnums=1)
        assert float(g(w, False)[0]) == 2.0
        with pytest.raises(TypeError, match="user error"):
            g(w, True)
        assert len(calls) == 2  # traced once, not retried
        assert float(g(w, False)[0]) == 2.0  # and the cache is intact
        assert _stack.context_snapshot() is not _stack.ROOT
    assert _stack.context_snapshot() is _stack.ROOT


def test_error_on_the_hot_path_is_not_retraced():
    calls = []

    def f(x):
        calls.append(1)
        if x.shape == (3,):
            raise TypeError("bad shape")
        return x

    with dag.context():
        g = jo.jit(f)
        g(jnp.ones(2))
        with pytest.raises(TypeError, match="bad shape"):
            g(jnp.ones(3))
    assert len(calls) == 2


def test_static_leaf_in_an_array_position_takes_the_slow_path():
    with dag.context():
        g = jo.jit(lambda p: p)
        g({"a": jnp.ones(2)})
        out = g({"a": jax.nn.relu})
    assert out["a"] is jax.nn.relu
