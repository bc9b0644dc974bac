"""jaxoverride_dag: the jit cache is keyed on the sharing pattern and static data, never ids."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxoverride as jo
import jaxoverride_dag as dag
from _dag_nodes import counting


@jax.tree_util.register_pytree_node_class
class Pair:
    def __init__(self, a, b):
        self.a, self.b = a, b

    def tree_flatten(self):
        return (self.a, self.b), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


def test_new_instances_with_the_same_pattern_do_not_retrace():
    body, calls = counting(lambda p: (p.a, p.b))
    with dag.context():
        f = jo.jit(body)
        for _ in range(3):
            w = jnp.ones(3)
            a, b = f(Pair(w, w))
            assert a is b
        for _ in range(3):
            a, b = f(Pair(jnp.ones(3), jnp.ones(3)))
            assert a is not b
    assert len(calls) == 2  # one trace per pattern, none per instance


def test_shared_versus_unshared_retraces_and_both_stay_cached():
    body, calls = counting(lambda x, y: x + y)
    w = jnp.ones(2)
    with dag.context():
        f = jo.jit(body)
        f(w, w)
        f(w, jnp.ones(2))
        f(jnp.zeros(2), jnp.zeros(2))  # shared again: cached
        f(jnp.zeros(2), jnp.ones(2))  # unshared again: cached
    assert len(calls) == 2


def test_shared_node_pattern_is_part_of_the_key():
    body, calls = counting(lambda p, q: p.a)
    w1, w2 = jnp.ones(2), jnp.zeros(2)
    with dag.context():
        f = jo.jit(body)
        node = Pair(w1, w2)
        f(node, node)
        f(Pair(w1, w2), Pair(w1, w2))  # same leaves shared across two nodes: another pattern
        node2 = Pair(jnp.ones(2), jnp.zeros(2))
        f(node2, node2)  # the first pattern again
    assert len(calls) == 2


def test_static_leaves_key_the_cache_by_value():
    body, calls = counting(lambda p: p["x"] * len(p["name"]))
    with dag.context():
        f = jo.jit(body)
        f({"x": jnp.ones(2), "name": "ab"})
        f({"x": jnp.ones(2), "name": "".join(["a", "b"])})  # equal, not identical
        f({"x": jnp.ones(2), "name": "abc"})
    assert len(calls) == 2


def test_hot_path_matches_structure_changes_correctly():
    """Calls alternate structures, sharing and leaf kinds; each gets the right result."""
    body, calls = counting(lambda x: x)
    w = jnp.arange(2.0)
    with dag.context():
        f = jo.jit(body)
        assert f(w) is not w
        assert f({"a": w})["a"] is not w
        out = f([w, w])
        assert out[0] is out[1]
        assert f(jnp.tanh) is jnp.tanh
        out = f([w, jnp.ones(2)])
        assert out[0] is not out[1]
        assert f(None) is None
        np.testing.assert_array_equal(f(w), w)
    assert len(calls) == 6


def test_shared_array_is_passed_once():
    big = np.ones((256, 256), np.float32)
    tree = [big] * 8
    body = lambda xs: sum(x[0, 0] for x in xs)
    with dag.context():
        ours = jo.jit(body).lower(tree).compile()
    plain = jax.jit(body).lower(tree).compile()
    n_ours = len(jax.tree_util.tree_leaves(ours.args_info))
    n_plain = len(jax.tree_util.tree_leaves(plain.args_info))
    assert (n_ours, n_plain) == (1, 8)


def test_unshared_tree_gives_the_same_jaxpr_as_jax_jit():
    tree = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
    body = lambda p, x: jnp.tanh(x @ p["w"] + p["b"])
    x = jnp.ones((4, 2))
    with dag.context():
        ours = jo.jit(body).trace(tree, x).jaxpr
    plain = jax.jit(body).trace(tree, x).jaxpr
    assert str(ours.jaxpr) == str(plain.jaxpr)


def _float32_array_at(misalignment: int, shape: tuple[int, int]) -> np.ndarray:
    """An ``np.arange`` of ``shape`` whose data starts ``misalignment`` bytes past 64."""
    nbytes = 4 * shape[0] * shape[1]
    buffer = np.empty(nbytes + 128, np.uint8)
    start = (-buffer.ctypes.data) % 64 + misalignment
    out = buffer[start : start + nbytes].view(np.float32).reshape(shape)
    out[...] = np.arange(out.size, dtype=np.float32).reshape(shape)
    return out


def test_large_unaligned_shared_numpy_array_is_copied_privately():
    # The adapter makes its own (synchronous) copy of a large unaligned array, so the
    # caller may change the array straight after the call.
    big = _float32_array_at(16, (512, 1024))  # 2 MiB, numpy's usual 16-byte alignment
    with dag.context():
        f = jo.jit(lambda xs: xs[0] + xs[1])
        out = f([big, big])
        big[0, 0] = -1.0
        np.testing.assert_array_equal(out, 2 * np.arange(512 * 1024).reshape(512, 1024))
        again = f([big, big])
    assert float(again[0, 0]) == -2.0


def test_large_aligned_shared_numpy_array_is_handed_to_jax_as_is():
    # An aligned array is JAX's to adopt, as under jax.jit: JAX reads it asynchronously
    # (zero-copy on CPU), so as with jax.jit the caller waits for the result before
    # changing it. What the adapter adds is that the shared array is one argument.
    big = _float32_array_at(0, (512, 1024))
    body = lambda xs: xs[0] + xs[1]
    with dag.context():
        f = jo.jit(body)
        out = f([big, big]).block_until_ready()
        n_args = len(jax.tree_util.tree_leaves(f.lower([big, big]).compile().args_info))
    np.testing.assert_array_equal(out, jax.jit(body)([big, big]))
    big[0, 0] = -1.0
    with dag.context():
        assert float(f([big, big])[0, 0]) == -2.0
    assert n_args == 1


def test_leaking_no_tracers():
    w = jnp.ones(3)
    with jax.checking_leaks(), dag.context():
        f = jo.jit(lambda p: {"y": p["a"] * 2, "fn": p["fn"]})
        f({"a": w, "b": w, "fn": jnp.sin})
        f({"a": w, "b": jnp.ones(3), "fn": jnp.sin})
        batched = jnp.ones((2, 3))
        jo.vmap(lambda p: p, in_axes=({"a": 0, "b": 0},))({"a": batched, "b": batched})


def test_unshared_calls_take_the_hot_path_without_encoding(monkeypatch):
    """Once a structure is known, unshared calls never walk the tree in Python again."""
    import equinox as eqx

    from jaxoverride_dag import _jit

    encodes: list[int] = []
    real_encode = _jit.encode

    def counting_encode(*args, **kwargs):
        encodes.append(1)
        return real_encode(*args, **kwargs)

    monkeypatch.setattr(_jit, "encode", counting_encode)
    mlp = eqx.nn.MLP(2, 2, 4, 2, key=jax.random.PRNGKey(0))

    def fresh_dict():
        return {"w": jnp.ones(3), "b": jnp.zeros(3), "tag": "static"}

    with dag.context():
        f = jo.jit(lambda p, x, scale=1.0: (p["w"] * x + p["b"]) * scale)
        g = jo.jit(lambda m, x: m(x))
        h = jo.jit(lambda *xs: sum(xs))
        f(fresh_dict(), 2.0, scale=3.0)
        f(fresh_dict(), 2.0)
        g(mlp, jnp.ones(2))
        h(jnp.ones(2), jnp.ones(2))
        warm = len(encodes)
        for _ in range(3):
            f(fresh_dict(), jnp.float32(5.0), scale=3.0)
            f(fresh_dict(), 2.0)  # alternating structures: found per structure
            g(jax.tree_util.tree_map(lambda v: v, mlp), jnp.zeros(2))
            h(jnp.ones(2), jnp.zeros(2))
    assert len(encodes) == warm + 1  # only the new float32 scalar dtype traced once


@jax.tree_util.register_pytree_node_class
class Doubled:
    """Flattens its one stored array twice: a tie made by the flatten itself."""

    def __init__(self, w):
        self.w = w

    def tree_flatten(self):
        return (self.w, self.w), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0])


def test_hot_path_sees_sharing_however_the_leaves_are_held():
    """Sharing is found with and without static leaves, and with or without outside refs."""
    body, calls = counting(lambda p: p)
    with dag.context():
        f = jo.jit(body)
        for static in ({}, {"tag": "s"}):
            f({"a": jnp.ones(2), "b": jnp.ones(2), **static})  # makes the hot entry
            w = jnp.ones(2)
            out = f({"a": w, "b": w, **static})
            assert out["a"] is out["b"]
            out = f({"a": jnp.ones(2), "b": jnp.ones(2), **static})
            assert out["a"] is not out["b"]
            shared = {"a": jnp.ones(2)}
            shared["b"] = shared["a"]
            del w
            out = f(shared)
            assert out["a"] is out["b"]
        out = f(Doubled(jnp.ones(2)))
        out = f(Doubled(jnp.ones(2)))
        assert out.w.shape == (2,)
    assert len(calls) == 5
