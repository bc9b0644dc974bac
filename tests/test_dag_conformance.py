"""jaxoverride_dag where it has nothing to do: control flow behaves exactly as JAX's.

Found by running JAX's own ``tests/lax_control_flow_test.py`` under the DAG context:
array sharing that differs across an iteration or between branches is de-shared as JAX
does it, bad input gets JAX's exception and message, and JAX's caches (one trace per body
function, one compile per eager loop) keep working. Each test is differential: the same
call on raw JAX is the reference.
"""

from __future__ import annotations

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax._src import test_util as jax_test_util

import jaxoverride as jo
import jaxoverride_dag as dag
from jaxoverride import lax as jlax


def assert_same(ours, theirs):
    assert jax.tree_util.tree_structure(ours) == jax.tree_util.tree_structure(theirs)
    for a, b in zip(
        jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs), strict=True
    ):
        assert jnp.asarray(a).dtype == jnp.asarray(b).dtype
        np.testing.assert_array_equal(a, b)


# --- 1. array sharing that differs is de-shared, as in JAX ---------------------------------

z0 = jnp.arange(3.0)


def desharing_programs():
    """Valid JAX programs whose array sharing changes; each takes ``lax`` (raw or neutral)."""
    return {
        "cond": lambda lax, p: lax.cond(p, lambda x: (x, x), lambda x: (x, 2 * x), z0),
        "cond-operands": lambda lax, p: lax.cond(p, lambda a, b: a + b, lambda a, b: a, z0, z0),
        "switch": lambda lax, p: lax.switch(
            p.astype(int), [lambda x: (x, x), lambda x: (x, x + 1), lambda x: (x + 2, x)], z0
        ),
        "while_loop": lambda lax, p: lax.while_loop(
            lambda c: c[0][0] < 3, lambda c: (c[0] + 1, c[1] * 2), (z0, z0)
        ),
        "fori_loop": lambda lax, p: lax.fori_loop(0, 3, lambda i, c: (c[0] + i, c[1]), (z0, z0)),
        "scan": lambda lax, p: lax.scan(lambda c, x: ((c[0] + x, c[1]), c[0]), (z0, z0), z0),
        "scan-retie-later": lambda lax, p: lax.scan(
            lambda c, x: ((c[1], c[1] + x, c[0]), None), (z0, z0, z0), z0
        ),
        "map": lambda lax, p: lax.map(lambda t: (t[0], t[0] * t[1]), (z0, z0)),
    }


@pytest.mark.parametrize("name", sorted(desharing_programs()))
@pytest.mark.parametrize("how", ["eager", "jit", "vmap"])
def test_programs_whose_array_sharing_changes_run_as_in_jax(name, how):
    program = desharing_programs()[name]
    if how == "jit":
        program = jax.jit(program, static_argnums=0)
    if how == "vmap":  # a batched predicate: JAX runs both branches
        batched = program
        program = lambda lax, p: jax.vmap(lambda q: batched(lax, q))(jnp.stack([p, ~p]))
    for p in (jnp.array(True), jnp.array(False)):
        want = program(jax.lax, p)
        with jax.checking_leaks(), dag.context():
            got = program(jlax, p)
        assert_same(got, want)


def test_desharing_keeps_the_ties_the_body_keeps_and_node_ties_in_full():
    box = {"w": z0}  # one node at two positions, kept tied by the body (in place)

    def body(c):
        c["tied"][0]["w"] = c["tied"][0]["w"] + 1
        return {
            "tied": c["tied"],
            "kept": (c["kept"][0] * 2, c["kept"][0] * 2),
            "split": (c["split"][0] + 1, c["split"][1]),
        }

    init = {"tied": (box, box), "kept": (z0, z0), "split": (z0, z0)}
    with jax.checking_leaks(), dag.context():
        out = jlax.fori_loop(0, 2, lambda i, c: body(c), init)
    assert out["tied"][0] is out["tied"][1]  # the node tie holds
    assert out["kept"][0] is not out["kept"][1]  # arrays: the body made two (equal) arrays
    assert out["split"][0] is not out["split"][1]
    np.testing.assert_array_equal(out["tied"][0]["w"], z0 + 2)
    np.testing.assert_array_equal(out["split"][1], z0)


def test_a_body_that_shares_more_than_the_carry_passes_the_array_once_per_position():
    seen = []

    def body(c, _):
        seen.append(c[0] is c[1])
        new = c[0] + c[1]
        return (new, new), None  # ties two positions the initial carry kept apart

    with jax.checking_leaks(), dag.context():
        out, _ = jlax.scan(body, (z0, z0 + 1), length=2)
    want, _ = jax.lax.scan(body, (z0, z0 + 1), length=2)
    assert_same(out, want)
    assert seen == [False, False]  # traced once, not retried: the carry keeps its layout


def test_gradients_and_nested_loops_through_desharing_match_jax():
    def loss(lax, w):
        def inner(c):
            return lax.fori_loop(0, 2, lambda i, d: (d[0] * 1.5, d[1] + d[0]), c)

        a, b = lax.while_loop(lambda c: c[0][0] < 10.0, lambda c: inner(c), (w, w))
        y = lax.cond(a[0] > 0, lambda x: (x, x), lambda x: (x, 2 * x), b)
        return jnp.sum(y[0] * y[1])

    w = jnp.array([1.0, 2.0])
    fori_loss = lambda lax, w: jnp.sum(
        lax.fori_loop(0, 3, lambda i, c: (c[0] * c[1], c[1] + 1.0), (w, w))[0]
    )
    want = (jax.jit(lambda w: loss(jax.lax, w))(w), jax.grad(lambda w: fori_loss(jax.lax, w))(w))
    with jax.checking_leaks(), dag.context():
        got = (jo.jit(lambda w: loss(jlax, w))(w), jo.grad(lambda w: fori_loss(jlax, w))(w))
    assert_same(got, want)


def test_ties_the_body_keeps_stay_one_array_with_no_retrace():
    seen = []

    def body(c, _):
        seen.append(c[0] is c[1])
        new = c[0] + 1
        return (new, new, c[2] * 2), None  # keeps the tie of positions 0 and 1

    with jax.checking_leaks(), dag.context():
        out, _ = jlax.scan(body, (z0, z0, z0 + 1), length=3)
    assert out[0] is out[1] and out[0] is not out[2]
    assert seen == [True]  # one trace: nothing to de-share
    assert_same(out, jax.lax.scan(body, (z0, z0, z0 + 1), length=3)[0])


sharing_patterns = st.lists(st.integers(0, 2), min_size=1, max_size=5)


@settings(max_examples=15, deadline=None)
@given(init_pattern=sharing_patterns, moves=st.lists(st.integers(-1, 4), min_size=5, max_size=5))
def test_random_carries_with_sharing_match_jax(init_pattern, moves):
    """Random initial ties; each position of the new carry is a new array or a copy of another."""
    bases = [jnp.full(2, float(i)) for i in range(3)]
    init = tuple(bases[i] for i in init_pattern)
    n = len(init)

    def body(c, x):
        out = []
        for i in range(n):
            move = moves[i]
            out.append(
                c[i] * 2 + x
                if move < 0 or move >= n
                else out[move % len(out)]
                if out
                else c[move] + 1
            )
        return tuple(out), sum(out)

    xs = jnp.arange(3.0)
    want = jax.lax.scan(body, init, xs)
    with jax.checking_leaks(), dag.context():
        got = jlax.scan(body, init, xs)
        got_while = jlax.fori_loop(0, 3, lambda i, c: body(c, 1.0)[0], init)
    assert_same(got, want)
    assert_same(got_while, jax.lax.fori_loop(0, 3, lambda i, c: body(c, 1.0)[0], init))


@settings(max_examples=12, deadline=None)
@given(
    operand_pattern=sharing_patterns,
    outputs=st.lists(st.lists(st.integers(0, 2), min_size=3, max_size=3), min_size=2, max_size=3),
    index=st.integers(0, 2),
)
def test_random_branch_output_sharing_matches_jax(operand_pattern, outputs, index):
    """Each branch returns three positions, each one of three arrays it computed."""
    bases = [jnp.full(2, float(i)) for i in range(3)]
    operands = tuple(bases[i] for i in operand_pattern)

    def branch(picks, scale):
        def run(*xs):
            made = [sum(xs) * scale, xs[0] + scale, xs[-1] - scale]
            return tuple(made[p] for p in picks)

        return run

    branches = [branch(picks, float(k + 1)) for k, picks in enumerate(outputs)]
    index = index % len(branches)
    want = jax.lax.switch(index, branches, *operands)
    with jax.checking_leaks(), dag.context():
        got = jlax.switch(index, branches, *operands)
        got_jit = jax.jit(lambda i: jlax.switch(i, branches, *operands))(index)
    assert_same(got, want)
    assert_same(got_jit, want)


# --- 2. bad input: JAX's exception type and message -------------------------------------

not_callable = 42


def bad_programs():
    """Each raises in JAX; ``lax`` is raw or neutral."""
    ints = (jnp.array(0, "int32"),) * 2
    return {
        "fori-not-callable": lambda lax: lax.fori_loop(0, 1, not_callable, 0),
        "while-not-callable": lambda lax: lax.while_loop(not_callable, not_callable, 0),
        "switch-not-callable": lambda lax: lax.switch(0, [not_callable]),
        "cond-not-callable": lambda lax: lax.cond(0, not_callable, not_callable),
        "scan-not-callable": lambda lax: lax.scan(not_callable, 0, 1),
        "map-not-callable": lambda lax: lax.map(not_callable, jnp.ones(2)),
        # Only static data to scan over: JAX's invalid-type error, not "no values"
        "scan-xs-string": lambda lax: lax.scan(lambda c, x: (c, x), 0.0, xs="abc"),
        "map-xs-string": lambda lax: lax.map(lambda x: x, "abc"),
        "scan-not-a-pair": lambda lax: lax.scan(lambda c, x: np.float32(0.0), 0, jnp.arange(5.0)),
        "scan-carry-structure": lambda lax: lax.scan(
            lambda c, x: ((0, 0, 0), x), (1, (2, 3)), jnp.arange(5.0)
        ),
        "scan-carry-structure-shared": lambda lax: lax.scan(
            lambda x, _: ((x[0].astype("float32"),), None), ints, None, length=1
        ),
        "scan-carry-list-for-tuple": lambda lax: lax.scan(
            lambda x, _: ([x[0].astype("float32")] * 2, None), ints, None, length=1
        ),
        "scan-carry-dtype-shared": lambda lax: lax.scan(
            lambda x, _: ((x[0], x[1].astype("float32")), None), ints, None, length=1
        ),
        "while-carry-structure": lambda lax: lax.while_loop(
            lambda c: True, lambda c: (1.0, 1.0), 0.0
        ),
        "while-carry-dtype": lambda lax: lax.while_loop(
            lambda c: True, lambda c: (True, True), (np.bool_(True), np.float32(0.0))
        ),
        "while-cond-not-scalar": lambda lax: lax.while_loop(lambda c: (1.0, 1.0), lambda c: c, 0.0),
        "fori-metadata": lambda lax: lax.fori_loop(
            0, 1, lambda i, x: {"T": jnp.array([0.5])}, {"t": jnp.array([1.0])}
        ),
        "cond-branch-structure": lambda lax: lax.cond(True, lambda x: (x, x), lambda x: x, z0),
        "cond-branch-types": lambda lax: lax.cond(True, lambda x: x, lambda x: x.astype(int), z0),
        "cond-pred-shape": lambda lax: lax.cond(jnp.ones(2), lambda x: x, lambda x: x, z0),
        "cond-both-operand-kinds": lambda lax: lax.cond(
            True, lambda x: x, lambda x: x, z0, operand=z0
        ),
        "switch-empty": lambda lax: lax.switch(0, [], z0),
        "switch-branch-structure": lambda lax: lax.switch(1, [lambda x: x, lambda x: [x]], z0),
    }


@pytest.mark.parametrize("name", sorted(bad_programs()))
def test_bad_input_raises_jax_exception_and_message(name):
    program = bad_programs()[name]
    with pytest.raises(Exception) as raw:
        program(jax.lax)
    with jax.checking_leaks(), dag.context(), pytest.raises(type(raw.value)) as ours:
        program(jlax)
    assert type(ours.value) is type(raw.value)
    assert str(raw.value) in str(ours.value)


def test_scan_over_a_generator_raises_jaxs_error():
    # JAX names the generator in its message (an address that differs per call), and
    # raises TypeError (0.10) or ValueError (0.8): the same type as JAX, and its wording.
    def program(lax):
        return lax.scan(lambda c, x: (c, x), 0.0, xs=(i for i in range(3)))

    with pytest.raises((TypeError, ValueError)) as raw:
        program(jax.lax)
    with dag.context(), pytest.raises(type(raw.value)) as ours:
        program(jlax)
    assert type(ours.value) is type(raw.value)
    assert str(raw.value).split("<generator")[0] in str(ours.value)


def bad_transform_calls():
    """Bad input to the DAG's transforms; ``api`` is ``jax`` or ``jaxoverride``."""
    return {
        "jit-not-callable": lambda api: api.jit(not_callable),
        "vmap-not-callable": lambda api: api.vmap(not_callable),
        "grad-not-callable": lambda api: api.grad(not_callable),
        "jacfwd-not-callable": lambda api: api.jacfwd(not_callable),
        "eval_shape-not-callable": lambda api: api.eval_shape(not_callable, 1.0),
        "grad-not-scalar": lambda api: api.grad(lambda x: x)(jnp.ones(3)),
        "vmap-in_axes-length": lambda api: api.vmap(lambda a, b: a, in_axes=(0,))(z0, z0),
        "vmap-in_axes-type": lambda api: api.vmap(lambda a: a, in_axes={"a": 0})(z0),
        "value_and_grad-aux-not-a-pair": lambda api: api.value_and_grad(
            lambda x: x.sum(), has_aux=True
        )(z0),
        "grad-aux-three": lambda api: api.grad(lambda x: (x.sum(), 1, 2), has_aux=True)(z0),
        "jacrev-aux-three": lambda api: api.jacrev(lambda x: [x, x, x], has_aux=True)(z0),
        # JAX names the user's arguments (x, y['b']), not the adapter's flat leaves
        "vmap-sizes-nested": lambda api: api.vmap(named_arguments)(jnp.ones(3), {"b": jnp.ones(4)}),
    }


def named_arguments(x, y):
    return x + y["b"]


@pytest.mark.parametrize("name", sorted(bad_transform_calls()))
def test_bad_input_to_transforms_raises_jax_exception_and_message(name):
    call = bad_transform_calls()[name]
    with pytest.raises(Exception) as raw:
        call(jax)
    with dag.context(), pytest.raises(type(raw.value)) as ours:
        call(jo)
    assert type(ours.value) is type(raw.value)
    assert str(raw.value) in str(ours.value)


def test_size_errors_with_leaves_raw_vmap_cannot_map_keep_the_adapters_message():
    # A function among the arguments: the DAG carries it as static data, raw jax.vmap
    # cannot take it, so the adapter's own (still JAX's) message stands.
    with dag.context(), pytest.raises(ValueError, match="inconsistent sizes"):
        jo.vmap(lambda x, fn, y: fn(x) + y[:3])(jnp.ones(3), jnp.sin, jnp.ones(4))
    with dag.context(), pytest.raises(ValueError, match="user bug"):
        jo.vmap(lambda x: (_ for _ in ()).throw(ValueError("user bug")))(jnp.ones(3))


def test_errors_raised_by_user_code_are_not_replayed():
    calls = []

    def body(c):
        calls.append(1)
        raise ValueError("user bug")

    with dag.context(), pytest.raises(ValueError, match="user bug"):
        jlax.while_loop(lambda c: True, body, z0)
    assert calls == [1]


# --- 3. JAX's caches: one trace per body function, one compile per eager loop ------------


def counted(fun, calls):
    def wrapped(*args):
        calls.append(1)
        return fun(*args)

    return wrapped


CACHED = ["cond-repeated-branch", "fori_loop", "map", "scan", "while_loop"]


@pytest.mark.parametrize("name", CACHED)
def test_identical_second_calls_hit_jax_caches(name):
    raw = trace_and_compile_counts(jax.lax, name)
    with dag.context():  # leak checking is part of JAX's cache key: not here
        ours = trace_and_compile_counts(jlax, name)
    assert ours == raw


def programs_with_bodies(lax, calls):
    """Loops over new body objects that count their Python calls in ``calls``."""
    body = counted(lambda c: c + 1, calls)
    cond = counted(lambda c: c < 3, calls)
    step = counted(lambda i, c: c + i, calls)
    pair = counted(lambda c, x: (c + x, c), calls)
    sin = counted(jnp.sin, calls)
    return {
        "while_loop": lambda: lax.while_loop(cond, body, 0.0),
        "fori_loop": lambda: lax.fori_loop(0, 3, step, z0),
        "scan": lambda: lax.scan(pair, 0.0, z0),
        "cond-repeated-branch": lambda: (
            lax.cond(True, sin, sin, z0),
            lax.cond(False, sin, sin, z0),
        ),
        "map": lambda: lax.map(sin, z0),
    }


def trace_and_compile_counts(lax, name):
    """Two identical calls with the *same* body objects: (body calls, lowerings).

    A first run with other body objects compiles what does not depend on the bodies (a new
    override stack is a new trace context, in which JAX compiles eager operations once).
    """
    programs_with_bodies(lax, [])[name]()
    calls: list[int] = []
    run = programs_with_bodies(lax, calls)[name]
    with jax_test_util.count_jit_and_pmap_lowerings() as lowerings:
        run()
        run()
    return len(calls), lowerings()


def test_the_wrapper_cache_keeps_no_body_alive():
    def make():
        data = jnp.ones(4)
        return lambda c, x: (c + data[0], x), lambda x: x * data[1]

    body, branch = make()
    with dag.context():
        jlax.scan(body, 0.0, z0)
        jlax.cond(True, branch, branch, z0)
    refs = [weakref.ref(body), weakref.ref(branch)]
    del body, branch
    gc.collect()
    assert [ref() for ref in refs] == [None, None]


def test_cond_compiles_no_more_than_jax():
    def f(x):
        return x + 1

    def g(x):
        return x + 2

    def count(lax):
        lax.cond(0, lambda x: x + 3, lambda x: x + 4, 0)  # eager operations of this stack
        with jax_test_util.count_jit_and_pmap_lowerings() as lowerings:
            for x in range(10):
                lax.cond(x, f, g, x)
        return lowerings()

    raw = count(jax.lax)
    with dag.context():
        ours = count(jlax)
    assert ours == raw < 5  # JAX's test_cond_excessive_compilation allows 4
