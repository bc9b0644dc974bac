"""jaxoverride_dag: the reference cases of the issue, and identity through every transform."""

from __future__ import annotations

import dataclasses
import enum
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxoverride as jo
import jaxoverride_dag as dag
from _dag_nodes import Node
from jaxoverride import lax as jlax

# A mutable custom pytree node, like a stateful module.
Module = Node


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Child:
    shared: object


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Parent:
    left: Child
    right: Child


@jax.tree_util.register_pytree_node_class
class Config:
    """A node with no leaves at all: its identity is all there is to keep."""

    def tree_flatten(self):
        return (), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls()


class Color(enum.Enum):
    RED = 1
    BLUE = 2


def identity_structure(tree) -> list:
    """For each position in preorder, the first position holding the same node or array.

    Written independently of the adapter: a plain recursive walk over one-level flattens.
    """
    first: dict[int, int] = {}
    out: list = []

    def walk(x):
        position = len(out)
        children = jax.tree_util.tree_flatten(x, is_leaf=lambda y: y is not x)[0]
        is_node = not (len(children) == 1 and children[0] is x)
        trackable = isinstance(x, jax.Array | np.ndarray) or (
            is_node and x is not None and not (isinstance(x, tuple) and not x)
        )
        if trackable and id(x) in first:
            out.append(("same as", first[id(x)]))
            return
        if trackable:
            first[id(x)] = position
        if is_node:
            out.append(("node", type(x).__name__))
        elif isinstance(x, jax.Array | np.ndarray | jax.ShapeDtypeStruct):
            out.append(("array",))
        else:
            out.append(("leaf", type(x).__name__))
        if is_node:
            for child in children:
                walk(child)

    walk(tree)
    return out


def all_objects(tree) -> set[int]:
    """Ids of every node and array in ``tree`` (the objects that must be fresh)."""
    ids: set[int] = set()

    def walk(x):
        children = jax.tree_util.tree_flatten(x, is_leaf=lambda y: y is not x)[0]
        is_node = not (len(children) == 1 and children[0] is x)
        if is_node and x is not None and not (isinstance(x, tuple) and not x):
            ids.add(id(x))
        if isinstance(x, jax.Array | np.ndarray):
            ids.add(id(x))
        if is_node:
            for child in children:
                walk(child)

    walk(tree)
    return ids


def test_shared_module_mutated_inside_jit_is_one_object_outside():
    m = Module(value=1)

    def f(m1, m2):
        assert m1 is m2
        m1.value = 100
        return m1, m2

    with dag.context():
        m1, m2 = jo.jit(f)(m, m)
    assert m1 is m2
    assert m2.value == 100
    assert m1 is not m and m.value == 1  # functional: the caller's object is untouched


def test_parent_with_shared_child_round_trip():
    shared = jnp.arange(3.0)
    parent = Parent(left=Child(shared), right=Child(shared))
    with dag.context():
        p = jo.jit(lambda p: p)(parent)
    assert p.left.shared is p.right.shared
    assert p.left is not p.right
    assert p is not parent and p.left is not parent.left and p.left.shared is not shared
    np.testing.assert_array_equal(p.left.shared, shared)


def test_two_round_trips_give_independent_families():
    shared = jnp.arange(3.0)
    parent = Parent(left=Child(shared), right=Child(shared))
    with dag.context():
        f = jo.jit(lambda p: p)
        p, q = f(parent), f(parent)
    assert identity_structure(p) == identity_structure(q) == identity_structure(parent)
    assert not all_objects(p) & all_objects(q)
    assert not all_objects(p) & all_objects(parent)


def test_shared_node_inside_is_fresh_and_shared():
    shared = jnp.arange(3.0)
    parent = Parent(left=Child(shared), right=Child(shared))
    seen = {}

    def f(p):
        seen["fresh"] = not all_objects(p) & all_objects(parent)
        seen["shared"] = p.left.shared is p.right.shared
        p.left.shared = p.left.shared + 1  # visible through the other alias? no: rebinding
        return p

    with dag.context():
        out = jo.jit(f)(parent)
    assert seen == {"fresh": True, "shared": True}
    np.testing.assert_array_equal(out.left.shared, shared + 1)
    np.testing.assert_array_equal(out.right.shared, shared)


def test_in_place_mutation_of_shared_node_is_seen_through_every_alias():
    child = Child(jnp.arange(3.0))
    parent = Parent(left=child, right=child)

    def f(p):
        p.left.shared = p.left.shared * 10  # the node is shared: right sees it too
        return p.right.shared

    with dag.context():
        out = jo.jit(f)(parent)
    np.testing.assert_array_equal(out, jnp.arange(3.0) * 10)
    np.testing.assert_array_equal(child.shared, jnp.arange(3.0))


def test_returning_one_object_twice_gives_one_object_twice():
    x = jnp.arange(3.0)
    with dag.context():
        a, b, c = jo.jit(lambda x: (x * 2, x * 2, (y := x * 3, y)[0]))(x)
        d = jo.jit(lambda x: [x] * 3)(x)
    assert a is not b  # two computations are two objects
    assert d[0] is d[1] is d[2]
    np.testing.assert_array_equal(c, x * 3)


@pytest.mark.parametrize("container", [dict, list, "leafless"])
def test_shared_dict_list_and_leafless_nodes_keep_identity(container):
    if container is dict:
        node = {"w": jnp.ones(2)}
    elif container is list:
        node = [jnp.ones(2), "tag"]
    else:
        node = Config()
    with dag.context():
        a, b, c = jo.jit(lambda a, b, c: (a, b, c))(node, node, Config())
    assert a is b and a is not node and c is not a


def test_empty_mutable_containers_keep_identity():
    empty: dict = {}
    with dag.context():
        a, b = jo.jit(lambda a, b: (a, b))(empty, empty)
        c, d = jo.jit(lambda a, b: (a, b))({}, {})
    assert a is b and a is not empty
    assert c is not d


def test_non_array_leaves_are_static_in_inputs_and_outputs():
    calls = []

    def f(p):
        calls.append(1)
        return {"y": p["fn"](p["x"]), "fn": p["fn"], "name": p["name"], "color": p["color"]}

    p = {"x": jnp.ones(2), "fn": jnp.tanh, "name": "layer", "color": Color.RED}
    with dag.context():
        g = jo.jit(f)
        out = g(p)
        g({**p, "x": jnp.zeros(2)})
        g({**p, "color": Color.BLUE})
    assert out["fn"] is jnp.tanh and out["name"] == "layer" and out["color"] is Color.RED
    np.testing.assert_allclose(out["y"], np.tanh(1.0) * np.ones(2), rtol=1e-6)
    assert len(calls) == 2  # a new static value retraces; new array values do not


def test_python_scalars_are_traced_values_as_in_jax_jit():
    calls = []

    def f(a, b):
        calls.append(1)
        return a * b

    with dag.context():
        g = jo.jit(f)
        assert float(g(2.0, 3.0)) == 6.0
        assert float(g(4.0, 5.0)) == 20.0
    assert len(calls) == 1


def test_equinox_mlp_through_jit_grad_vmap():
    mlp = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.PRNGKey(0))
    xs = jnp.ones((4, 3))
    reference = jax.vmap(mlp)(xs)
    params, static = eqx.partition(mlp, eqx.is_array)
    ref_grad = jax.grad(lambda p: jnp.sum(eqx.combine(p, static)(xs[0])))(params)
    with dag.context():
        out = jo.jit(lambda m, xs: jo.vmap(m)(xs))(mlp, xs)
        grads = jo.jit(jo.grad(lambda m, x: jnp.sum(m(x))))(mlp, xs[0])
        same = jo.jit(lambda m: m)(mlp)
    np.testing.assert_allclose(out, reference, rtol=1e-6)
    assert grads.activation is None and grads.final_activation is None
    for got, want in zip(
        jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grad), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert same.activation is mlp.activation and same.layers[0].weight is not mlp.layers[0].weight


def test_every_transform_preserves_identity():
    child = Child(jnp.arange(3.0))
    tree = Parent(left=child, right=child)
    batched = Parent(left=Child(jnp.ones((2, 3))), right=None)
    batched.right = batched.left

    def structure_of(out):
        return identity_structure(out)

    want = identity_structure(tree)
    with dag.context():
        results = {
            "jit": jo.jit(lambda t: t)(tree),
            "vmap": jo.vmap(lambda t: t)(batched),
            "checkpoint": jo.checkpoint(lambda t: t)(tree),
            "eval_shape": jo.eval_shape(lambda t: t, tree),
            "scan": jlax.scan(lambda c, _: (c, None), tree, length=2)[0],
            "while_loop": jlax.while_loop(lambda c: False, lambda c: c, tree),
            "fori_loop": jlax.fori_loop(0, 2, lambda i, c: c, tree),
            "cond": jlax.cond(True, lambda t: t, lambda t: t, tree),
            "switch": jlax.switch(0, [lambda t: t, lambda t: t], tree),
            "map": jlax.map(lambda t: t, batched),
            "grad": jo.grad(lambda t: jnp.sum(t.left.shared))(tree),
            "jacfwd": jo.jacfwd(lambda t: jnp.sum(t.left.shared))(tree),
            "jacrev": jo.jacrev(lambda t: jnp.sum(t.left.shared))(tree),
        }
    for name, out in results.items():
        assert structure_of(out) == want, name
        assert not all_objects(out) & all_objects(tree), name


def test_grad_sums_over_uses_of_a_shared_node():
    child = Child(jnp.arange(3.0))
    tree = Parent(left=child, right=child)
    with dag.context():
        g = jo.grad(lambda t: jnp.sum(t.left.shared * 2.0) + jnp.sum(t.right.shared**2))(tree)
    assert g.left is g.right
    np.testing.assert_allclose(g.left.shared, 2.0 + 2 * jnp.arange(3.0))


def test_context_as_decorator_and_as_mapping():
    w = jnp.ones(2)

    @dag.context()
    def tied():
        a, b = jo.jit(lambda a, b: (a, b))(w, w)
        return a is b

    assert tied()
    with jo.override_context(dag.context()):
        a, b = jo.jit(lambda a, b: (a, b))(w, w)
    assert a is b
    assert "lax.scan" in dag.context() and dag.context() is dag.context()


def test_outside_the_context_neutral_functions_are_plain_jax():
    w = jnp.ones(2)
    f = jo.jit(lambda a, b: (a, b))
    with dag.context():
        a, b = f(w, w)
    c, d = f(w, w)
    assert a is b and c is not d


def test_nested_library_code_is_identity_preserving_too():
    """A library's jitted helper inside a user's jit still sees the shared node."""
    seen = []

    @jo.jit
    def library_step(state):
        seen.append(state["a"] is state["b"])
        return jlax.fori_loop(0, 2, lambda i, s: dag.tree_map(lambda v: v + 1.0, s), state)

    w = jnp.zeros(2)
    with dag.context():
        out = jo.jit(lambda s: library_step(s))({"a": w, "b": w})
    assert seen == [True]
    assert out["a"] is out["b"]
    np.testing.assert_array_equal(out["a"], jnp.full(2, 2.0))


def test_static_argnums_and_donation():
    calls = []

    @functools.partial(jo.jit, static_argnums=1, donate_argnums=0)
    def f(p, scale):
        calls.append(scale)
        return {"a": p["a"] * scale, "b": p["b"] * scale}

    w = jnp.ones(2)
    with dag.context():
        f({"a": w, "b": w}, 2.0)
        out = f({"a": jnp.ones(2), "b": jnp.ones(2)}, 2.0)
        f({"a": jnp.ones(2), "b": jnp.ones(2)}, 3.0)
    assert calls == [2.0, 2.0, 3.0]  # the shared call, the unshared one, a new static
    np.testing.assert_array_equal(out["a"], 2 * np.ones(2))


def test_lower_trace_and_eval_shape_attributes():
    w = jnp.ones(3)
    with dag.context():
        f = jo.jit(lambda p: {"y": p["a"] + p["b"], "fn": p["fn"]})
        lowered = f.lower({"a": w, "b": w, "fn": jnp.sin})
        shapes = f.eval_shape({"a": w, "b": w, "fn": jnp.sin})
    assert lowered.as_text().count("tensor<3xf32>") >= 1
    assert shapes["y"].shape == (3,) and shapes["fn"] is jnp.sin


def test_composes_with_another_adapter_below():
    """Over jaxoverride_plain, the DAG overrides delegate to plain's init-safe loops."""
    import jaxoverride_plain as plain

    params: dict = {}

    def body(state, _):
        if plain.is_initializing():
            params.setdefault("w", jnp.float32(2.0))
        state["a"].shared = state["a"].shared * params["w"]
        return state, None

    child = Child(jnp.ones(2))
    with plain.context(), dag.context():
        with plain.init_context():
            out, _ = jlax.scan(body, {"a": child, "b": child}, length=2)
    assert out["a"] is out["b"] and "w" in params
    np.testing.assert_array_equal(out["b"].shared, [4.0, 4.0])


def _identity_inside(run):
    """Runs ``run(record)`` in the context; returns the leaves the function saw."""
    seen: list[object] = []
    with dag.context():
        run(seen.append)
    return seen


@pytest.mark.parametrize(
    "case",
    ["grad-other-args", "vmap-unmapped", "scan-under-disable_jit", "jit-under-disable_jit"],
)
def test_untraced_arrays_inside_are_not_the_callers_objects(case):
    """Even arrays that JAX passes through untraced reach the function as fresh objects,
    with the caller's sharing kept; numpy arrays arrive as views."""
    w = jnp.ones(3)
    other = jnp.arange(3.0)
    host = np.arange(3.0)

    def run(record):
        if case == "grad-other-args":

            def loss(w, a, b, c):
                record(a), record(b), record(c)
                return jnp.sum(w * a)

            jo.grad(loss)(w, other, other, host)
        elif case == "vmap-unmapped":

            def row(x, a, b, c):
                record(a), record(b), record(c)
                return x * a

            jo.vmap(row, in_axes=(0, None, None, None))(jnp.ones((2, 3)), other, other, host)
        else:
            with jax.disable_jit():
                if case == "scan-under-disable_jit":

                    def body(carry, _):
                        a, b, c = carry
                        record(a), record(b), record(c)
                        return carry, None

                    jlax.scan(body, (other, other, host), length=1)
                else:
                    jo.jit(lambda a, b, c: [record(a), record(b), record(c)] and a)(
                        other, other, host
                    )

    a, b, c = _identity_inside(run)[:3]
    assert a is b  # sharing kept
    assert a is not other and c is not host  # but never the caller's objects
    np.testing.assert_array_equal(a, other)
    np.testing.assert_array_equal(c, host)
    if isinstance(c, np.ndarray):
        assert np.shares_memory(c, host)  # a view, not a copy
