"""jaxoverride_dag: a cache hit of a call of one dict of arrays takes the key-lookup path,
and everything that path cannot prove (a shared value, another structure, a value that
is not an array) still gets the full semantics: sharing kept, a retrace, JAX's error."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxoverride as jo
import jaxoverride_dag as dag
from _dag_nodes import counting

_COMPILES: list[str] = []


def _listener(event: str, duration: float, **kwargs: object) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES.append(event)


jax.monitoring.register_event_duration_secs_listener(_listener)


def compiles() -> int:
    """The number of XLA compilations so far."""
    return len(_COMPILES)


def params(n: int = 4) -> dict[str, jax.Array]:
    return {f"w{i}": jnp.full((2,), float(i)) for i in range(n)}


def test_new_dicts_of_the_same_keys_hit_the_cache_without_retracing():
    body, traces = counting(lambda d: {k: v * 2 for k, v in d.items()})
    inputs = [params() for _ in range(4)]
    with jax.checking_leaks(), dag.context():
        f = jo.jit(body)
        f(params())
        before = compiles()
        outs = [f(d) for d in inputs]
        assert compiles() == before  # the cache hits compile nothing
    assert len(traces) == 1
    for d, out in zip(inputs, outs, strict=True):
        assert set(out) == set(d)
        for key, value in d.items():
            assert jnp.array_equal(out[key], value * 2)


def test_a_value_shared_between_keys_stays_shared_and_retraces_once():
    body, traces = counting(lambda d: d)
    with dag.context():
        f = jo.jit(body)
        f(params())
        for _ in range(3):
            d = params()
            d["w3"] = d["w1"]  # now shared: the key-lookup path must not take it
            out = f(d)
            assert out["w3"] is out["w1"]
            assert out["w2"] is not out["w1"]
        out = f(params())  # unshared again: its entry is still cached
        assert out["w3"] is not out["w1"]
    assert len(traces) == 2


def test_a_value_shared_with_a_variable_the_caller_holds_is_still_found():
    with dag.context():
        f = jo.jit(lambda d: d)
        f(params())
        w = jnp.ones(2)
        d = {"w0": w, "w1": w, "w2": jnp.zeros(2), "w3": jnp.zeros(2)}
        out = f(d)
        assert out["w0"] is out["w1"]
        assert out["w2"] is not out["w3"]


@pytest.mark.parametrize(
    "change",
    [
        lambda d: (d.pop("w2"), d.update(other=jnp.ones(2))),  # same size, another key
        lambda d: d.update(w2={"inner": jnp.ones(2)}),  # a value that is a node
        lambda d: d.update(w2=(jnp.ones(2),)),  # a node of one leaf
        lambda d: d.update(w2=None),  # a node of no leaves
        lambda d: d.update(w2="static"),  # static data
        lambda d: d.update(w2=3.0),  # a Python scalar
    ],
    ids=["other-key", "dict-value", "tuple-value", "none-value", "static-value", "scalar"],
)
def test_another_structure_under_the_same_size_retraces_with_its_own_plan(change):
    def body(d):
        return {k: (v if isinstance(v, str) else jax.tree.map(lambda a: a + 1, v))
                for k, v in d.items()}  # fmt: skip

    with jax.checking_leaks(), dag.context():
        f = jo.jit(body)
        f(params())
        d = params()
        change(d)
        out = f(d)
        assert set(out) == set(d)
        expected = jax.tree.map(lambda a: a + 1, {k: v for k, v in d.items() if k != "w2"})
        for key, value in expected.items():
            assert jnp.array_equal(out[key], value)
        f(params())  # and the first structure again
        out = f(d)  # then this one, from its cached entry
        assert set(out) == set(d)


def test_a_dict_subclass_is_not_taken_for_a_dict():
    class Named(dict):
        pass

    jax.tree_util.register_pytree_node(
        Named, lambda d: (tuple(d.values())[::-1], tuple(d)[::-1]),
        lambda keys, values: Named(zip(keys, values, strict=True)),
    )  # fmt: skip
    with dag.context():
        f = jo.jit(lambda d: d["a"] - d["b"])
        plain = {"a": jnp.ones(2), "b": jnp.zeros(2)}
        assert jnp.array_equal(f(plain), jnp.ones(2))
        named = Named(a=jnp.ones(2), b=jnp.zeros(2))
        assert jnp.array_equal(f(named), jnp.ones(2))


def test_jax_errors_on_the_key_lookup_path_are_jax_errors():
    with dag.context():
        f = jo.jit(lambda d: d["w0"] @ d["w1"])
        g = jax.jit(lambda d: d["w0"] @ d["w1"])
        d = {"w0": jnp.ones((2, 3)), "w1": jnp.ones((3, 2))}
        assert f(d).shape == (2, 2)
        bad = {"w0": jnp.ones((2, 3)), "w1": jnp.ones((2, 3))}
        with pytest.raises(TypeError) as ours:
            f(bad)
        with pytest.raises(TypeError) as theirs:
            g(bad)
        assert str(ours.value).splitlines()[0] == str(theirs.value).splitlines()[0]


@pytest.mark.parametrize(
    "share",
    [
        lambda x, y, z: (x, {"a": x, "b": z}),  # an argument that is also nested
        lambda x, y, z: (x, {"a": y, "b": y}),  # two nested positions
        lambda x, y, z: (x, {"a": y, "b": z}, x),  # two arguments
        lambda x, y, z: (x, {"a": y, "b": z}, y),  # a last argument, also nested
    ],
    ids=["argument-and-nested", "nested-twice", "arguments-twice", "last-argument-nested"],
)
def test_sharing_between_arguments_and_nested_leaves_is_found(share):
    distinct_inside: list[int] = []

    def leaves(*args):
        found = jax.tree_util.tree_leaves(args)
        distinct_inside.append(len({id(leaf) for leaf in found}))
        return [leaf + 1 for leaf in found]

    def fresh():
        return jnp.ones(2)

    shared = share(fresh(), fresh(), fresh())
    unshared = jax.tree_util.tree_map(lambda _: fresh(), shared)  # outside: JAX's own
    n = len(jax.tree_util.tree_leaves(unshared))
    assert len({id(leaf) for leaf in jax.tree_util.tree_leaves(shared)}) == n - 1
    with dag.context():
        f = jo.jit(leaves)
        f(*unshared)
        assert len(f(*unshared)) == n
        assert len(f(*shared)) == n
    # One trace per pattern: the shared call was not taken for the unshared one.
    assert distinct_inside == [n, n - 1]


def test_the_one_array_path_follows_the_last_entry():
    body, traces = counting(lambda x: jax.tree.map(lambda a: a * 2, x))
    with jax.checking_leaks(), dag.context():
        f = jo.jit(body)
        x = jnp.ones(2)
        assert jnp.array_equal(f(x), 2 * x)
        assert jnp.array_equal(f(x), 2 * x)  # the one-array path
        out = f({"a": x, "b": x})  # shared: an entry with no hot path
        assert jnp.array_equal(out["a"], 2 * x) and jnp.array_equal(out["b"], 2 * x)
        assert jnp.array_equal(f(jnp.zeros(3)), jnp.zeros(3))  # one array again: JAX retraces
        assert f(3.0) == 6.0  # a Python scalar takes the same path
        assert jnp.array_equal(f((x,))[0], 2 * x)  # a node of one array: another plan
        assert jnp.array_equal(f(x), 2 * x)
    assert len(traces) == 5  # one array (2 shapes), the shared dict, a scalar, a tuple


@pytest.mark.parametrize("holders", [0, 1, 2, 3])
@pytest.mark.parametrize(
    "share",
    [
        lambda x, y, z: (x, {"act": jnp.tanh, "a": y, "b": y}),  # two nested positions
        lambda x, y, z: (x, {"act": jnp.tanh, "a": x, "b": z}),  # an argument, also nested
    ],
    ids=["nested-twice", "argument-and-nested"],
)
def test_sharing_is_found_past_static_leaves_whoever_else_holds_the_arrays(share, holders):
    # A static leaf (the function) and an array argument: the hot path counts references
    # over three containers, and tolerates one holder more than the tree's before it
    # builds the set of ids. However many hold them, a shared array is still found.
    distinct_inside: list[int] = []

    def leaves(*args):
        found = [leaf for leaf in jax.tree_util.tree_leaves(args) if not callable(leaf)]
        distinct_inside.append(len({id(leaf) for leaf in found}))
        return [leaf + 1 for leaf in found]

    def fresh():
        return jnp.ones(2)

    def call(tree):
        kept = [jax.tree_util.tree_leaves(tree) for _ in range(holders)]
        out = f(*tree)
        del kept
        return out

    with dag.context():
        f = jo.jit(leaves)
        unshared = share(fresh(), fresh(), fresh())
        unshared[1]["a"] = fresh() if unshared[1]["a"] is unshared[0] else unshared[1]["a"]
        unshared[1]["b"] = fresh()
        n = len(call(unshared))
        assert len(call(share(fresh(), fresh(), fresh()))) == n  # shared: another plan
        assert len(call(unshared)) == n
        assert len(call(share(fresh(), fresh(), fresh()))) == n
    assert distinct_inside == [n, n - 1]


def test_the_one_array_frame_passes_every_other_call_on_whole():
    # The hot path takes the first argument apart from the rest: a call by keyword, with
    # no argument, or with several must reach the function exactly as it was made, in
    # the DAG's stack and in another.
    def body(first=None, *rest, **named):
        return {"first": first, "rest": rest, "named": named}

    x, y = jnp.ones(2), jnp.zeros(2)
    with jax.checking_leaks(), dag.context():
        f = jo.jit(body)
        assert f(x)["first"] is not x and jnp.array_equal(f(x)["first"], x)
        by_keyword = f(first=x)
        assert jnp.array_equal(by_keyword["first"], x) and by_keyword["named"] == {}
        assert f()["first"] is None and f()["rest"] == ()
        several = f(x, y, z=x)
        assert jnp.array_equal(several["rest"][0], y) and set(several["named"]) == {"z"}
        with jo.override_context({"lax.map": jax.lax.map}):  # another stack: dispatched
            other = f(x, y, z=x)
            assert jnp.array_equal(other["rest"][0], y) and set(other["named"]) == {"z"}
            assert f()["first"] is None
        assert jnp.array_equal(f(x)["first"], x)
