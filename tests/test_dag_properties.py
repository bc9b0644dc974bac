"""jaxoverride_dag, property tests: random pytrees with random sharing, through transforms.

Trees mix tuples, lists, dicts, a mutable custom pytree class and a registered dataclass,
nested up to depth 4, with arrays and a few static leaves; nodes and arrays are shared at
random. After ``jit``, ``vmap``, ``grad``, ``scan`` and ``jit(vmap(...))`` the output's
identity structure must equal the input's, and its values must equal an unshared
reference computation by plain JAX.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import jaxoverride as jo
import jaxoverride_dag as dag
from jaxoverride import lax as jlax

BATCH = 2


@jax.tree_util.register_pytree_node_class
class Box:
    def __init__(self, *items):
        self.items = list(items)

    def tree_flatten(self):
        return tuple(self.items), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Pair:
    first: object
    second: object


def _children(x):
    children = jax.tree_util.tree_flatten(x, is_leaf=lambda y: y is not x)[0]
    return None if len(children) == 1 and children[0] is x else children


def identity_structure(tree) -> list:
    """Preorder: node type / array / static value, or the first position of the same object."""
    first: dict[int, int] = {}
    out: list = []

    def walk(x):
        position = len(out)
        children = _children(x)
        tracked = isinstance(x, jax.Array) or (
            children is not None and x is not None and not (isinstance(x, tuple) and not x)
        )
        if tracked and id(x) in first:
            out.append(("same as", first[id(x)]))
            return
        if tracked:
            first[id(x)] = position
        if children is None:
            out.append(("array",) if isinstance(x, jax.Array) else ("static", x))
        else:
            out.append(("node", type(x).__name__))
            for child in children:
                walk(child)

    walk(tree)
    return out


def expanded_arrays(tree) -> list:
    return [x for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.Array)]


@st.composite
def shared_trees(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    nodes: list = []
    arrays: list = []

    def new_array():
        array = jnp.asarray(rng.uniform(-1, 1, size=(BATCH, 3)), jnp.float32)
        arrays.append(array)
        return array

    def build(depth):
        kinds = ["array", "array", "static"]
        if arrays:
            kinds.append("shared array")
        if nodes:
            kinds.append("shared node")
        if depth < 4:
            kinds += ["tuple", "list", "dict", "box", "pair", "empty"]
        kind = draw(st.sampled_from(kinds))
        if kind == "array":
            return new_array()
        if kind == "static":
            return draw(st.sampled_from(["tag", "other", None]))
        if kind == "shared array":
            return draw(st.sampled_from(arrays))
        if kind == "shared node":
            return draw(st.sampled_from(nodes))
        if kind == "empty":
            node = draw(st.sampled_from([{}, [], Box()]))
            node = type(node)()  # a fresh empty container
        else:
            width = draw(st.integers(1, 3))
            items = [build(depth + 1) for _ in range(width)]
            if kind == "tuple":
                node = tuple(items)
            elif kind == "list":
                node = items
            elif kind == "dict":
                node = {f"k{i}": item for i, item in enumerate(items)}
            elif kind == "box":
                node = Box(*items)
            else:
                node = Pair(items[0], items[-1])
        nodes.append(node)
        return node

    tree = [build(1) for _ in range(draw(st.integers(1, 3)))]
    if not expanded_arrays(tree):
        tree.append(new_array())
    return tree


def affine(x):
    return x * 0.5 + 1.0


def check_same_identity_and_values(out, tree, steps: int = 1):
    assert identity_structure(out) == identity_structure(tree)
    got = expanded_arrays(out)
    want = expanded_arrays(tree)
    for _ in range(steps):
        want = jax.jit(lambda leaves: [affine(x) for x in leaves])(want)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6)


PROPERTY = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Built once: the wrappers' caches then serve every example of the same pattern.
_JIT = jo.jit(lambda t: dag.tree_map(affine, t))
_VMAP = jo.vmap(lambda t: dag.tree_map(affine, t))
_JIT_VMAP = jo.jit(jo.vmap(lambda t: dag.tree_map(affine, t)))
_GRAD = jo.grad(lambda t: sum(jnp.sum(jnp.sin(x)) for x in expanded_arrays(t)))


@pytest.mark.parametrize(
    "transformed", [_JIT, _VMAP, _JIT_VMAP], ids=["jit", "vmap", "nested_jit_vmap"]
)
@PROPERTY
@given(tree=shared_trees())
def test_transform_preserves_identity_and_values(transformed, tree):
    with dag.context():
        out = transformed(tree)
    check_same_identity_and_values(out, tree)


@PROPERTY
@given(shared_trees())
def test_scan_carry_preserves_identity_and_values(tree):
    with dag.context():
        out, _ = jlax.scan(lambda c, _: (dag.tree_map(affine, c), None), tree, length=3)
    check_same_identity_and_values(out, tree, steps=3)


@PROPERTY
@given(shared_trees())
def test_grad_preserves_identity_and_sums_tied_gradients(tree):
    with dag.context():
        grads = _GRAD(tree)
    # The gradient mirrors the tree: static leaves become None, arrays get gradients.
    want_structure = [
        ("node", "NoneType") if entry[0] == "static" else entry
        for entry in identity_structure(tree)
    ]
    assert identity_structure(grads) == want_structure
    uses: dict[int, int] = {}
    for x in expanded_arrays(tree):
        uses[id(x)] = uses.get(id(x), 0) + 1
    for g, x in zip(expanded_arrays(grads), expanded_arrays(tree), strict=True):
        np.testing.assert_allclose(g, uses[id(x)] * jnp.cos(x), rtol=1e-5)
