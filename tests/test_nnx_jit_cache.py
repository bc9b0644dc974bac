"""``jaxoverride.jit`` under ``track``: fresh weights, trace counts, weak references."""

from __future__ import annotations

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxoverride as jo
import jaxoverride_nnx
from _nnx_models import Counter

X = jnp.arange(3.0)


class Traces:
    """Counts how many times JAX traces a function (its Python body runs)."""

    def __init__(self) -> None:
        self.count = 0

    def wrap(self, model: nnx.Module):
        def f(x):
            self.count += 1
            return model(x)

        return f


def test_weights_changed_outside_are_never_stale():
    model, traces = Counter(), Traces()
    f = jo.jit(traces.wrap(model))
    with jaxoverride_nnx.track(model):
        first = f(X)
        model.w[...] = model.w[...] * 3.0  # changed eagerly, between calls
        second = f(X)
        nnx.update(model, nnx.State({"w": nnx.Param(jnp.full(3, 0.25, jnp.float32))}))
        third = f(X)
    assert traces.count == 1  # new values, same trace
    reference = Counter()
    expected = [reference(X)]
    reference.w[...] = reference.w[...] * 3.0
    expected.append(reference(X))
    reference.w[...] = jnp.full(3, 0.25)
    expected.append(reference(X))
    np.testing.assert_allclose(np.stack([first, second, third]), np.stack(expected), rtol=1e-6)
    assert int(model.count[...]) == 3


def test_raw_jax_jit_would_serve_stale_weights():
    """The problem ``track`` solves: raw jax.jit bakes a read-only closure's weights in.

    Under ``track`` that read is refused (``_stale_reads``); with the check off it shows.
    """

    class Scale(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.array(2.0))

        def __call__(self, x):
            return x * self.w[...]

    model = Scale()
    raw, ours = jax.jit(lambda x: model(x)), jo.jit(lambda x: model(x))
    with jaxoverride_nnx.track(model):
        with pytest.raises(jo.errors.MissingAdapterError, match=r"`Scale\.w`"):
            raw(1.0)
    previous = jo.set_adapter_check(False)
    try:
        with jaxoverride_nnx.track(model):
            assert float(raw(1.0)) == float(ours(1.0)) == 2.0
            model.w[...] = jnp.array(5.0)
            assert float(raw(1.0)) == 2.0  # stale
            assert float(ours(1.0)) == 5.0
    finally:
        jo.set_adapter_check(previous)


def test_cache_hit_does_not_retrace_and_new_scopes_reuse_the_trace():
    model, traces = Counter(), Traces()
    f = jo.jit(traces.wrap(model))
    for _ in range(3):
        with jaxoverride_nnx.track(model):
            for _ in range(4):
                f(X)
    assert traces.count == 1
    assert int(model.count[...]) == 12


def test_retraces_on_tracked_set_and_variable_shape_or_dtype():
    model, other, traces = Counter(), Counter(seed=3), Traces()
    f = jo.jit(traces.wrap(model))
    with jaxoverride_nnx.track(model):
        f(X)
        model.w[...] = model.w[...] + 1.0  # same shape and dtype: no retrace
        f(X)
        assert traces.count == 1
        model.w.set_value(jnp.ones(3, jnp.float16))  # dtype changed
        f(X)
        assert traces.count == 2
        model.w.set_value(jnp.ones((1, 3)))  # shape changed
        f(X)
        assert traces.count == 3
        model.w.set_value(jnp.ones(3))  # back: the first trace is reused
        f(X)
        assert traces.count == 3
    with jaxoverride_nnx.track(model, other):  # a different tracked set
        f(X)
    assert traces.count == 4


def test_structural_changes_outside_are_noticed_and_cached():
    """``model.eval()`` between calls changes static attributes: a new trace, and the
    old one again when they change back."""

    class Model(nnx.Module):
        def __init__(self):
            self.norm = nnx.BatchNorm(3, use_running_average=False, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.norm(x)

    model, traces = Model(), Traces()
    f = jo.jit(traces.wrap(model))
    x = jnp.arange(6.0).reshape(2, 3)
    with jaxoverride_nnx.track(model):
        f(x)
        mean = np.asarray(model.norm.mean[...])
        model.eval()
        f(x)
        np.testing.assert_array_equal(model.norm.mean[...], mean)  # eval: no update
        model.train()
        f(x)
        assert not np.array_equal(model.norm.mean[...], mean)
        model.norm.extra = nnx.Variable(jnp.zeros(()))  # a new Variable, added eagerly
        f(x)
        assert any(p == "Model.norm.extra" for p, _ in jaxoverride_nnx.tracked_variables())
    assert traces.count == 3  # train, eval, train again from cache, then the new Variable


def test_graph_is_walked_once_per_scope(monkeypatch):
    from jaxoverride_nnx import _tracked

    walks = []
    original = _tracked.walk

    def counting_walk(*args, **kwargs):
        walks.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(_tracked, "walk", counting_walk)
    model = Counter()
    f = jo.jit(lambda x: model(x))
    with jaxoverride_nnx.track(model):
        for _ in range(5):
            f(X)
            jo.lax.scan(lambda c, _: (model(c), None), X, length=2)
            jo.grad(lambda x: model(x).sum())(X)
    assert len(walks) == 1


def test_deleted_tracked_module_is_collected():
    holder = [Counter()]
    ref = weakref.ref(holder[0])
    f = jo.jit(lambda x: holder[0](x))  # long-lived, like a library's jitted solver
    with jaxoverride_nnx.track(holder[0]):
        f(X)
        f(X)
    holder.clear()
    gc.collect()
    assert ref() is None
    # The cache entry of the dead module is pruned when the next trace is built.
    built = f.__dict__["_jaxoverride_state"].builds
    holder.append(Counter())
    with jaxoverride_nnx.track(holder[0]):
        f(X)
        (call,) = {id(b): b for b in built.values()}.values()
        assert len(call.tracked_jit._cache) == 1


def test_module_deleted_inside_the_scope_is_collected():
    holder = [Counter()]
    ref = weakref.ref(holder[0])
    with jaxoverride_nnx.track(holder[0]):
        f = jo.jit(lambda x: holder[0](x))
        f(X)
        holder.clear()
        del f
        gc.collect()
        assert ref() is None


@pytest.mark.parametrize("where", ["jit", "scan_in_jit", "grad", "while_loop", "cond"])
def test_exceptions_restore_every_variable(where):
    model = Counter()
    before = [np.asarray(v) for v in jax.tree_util.tree_leaves(nnx.state(model))]
    traces = [v._trace_state for v in (model.w, model.count)]

    def failing(x):
        model(x)
        model(x)
        raise RuntimeError("boom")

    calls = {
        "jit": lambda: jo.jit(failing)(X),
        "scan_in_jit": lambda: jo.jit(
            lambda x: jo.lax.scan(lambda c, _: (failing(c), None), x, length=2)
        )(X),
        "grad": lambda: jo.grad(lambda x: failing(x).sum())(X),
        "while_loop": lambda: jo.lax.while_loop(lambda c: True, failing, X),
        "cond": lambda: jo.lax.cond(True, failing, lambda x: x, X),
    }
    with jax.checking_leaks(), jaxoverride_nnx.track(model):
        with pytest.raises(RuntimeError, match="boom"):
            calls[where]()
        after = [np.asarray(v) for v in jax.tree_util.tree_leaves(nnx.state(model))]
        assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
        assert [v._trace_state for v in (model.w, model.count)] == traces
        # Still usable afterwards.
        jo.jit(lambda x: model(x))(X)
    assert int(model.count[...]) == 1


@pytest.mark.parametrize("kind", ["scan", "fori_loop", "while_loop", "cond", "map"])
def test_eager_control_flow_reuses_traces_like_jax(kind):
    """Called again with the same body, a loop is not traced again: once in all, as raw
    JAX manages for scan, fori_loop, while_loop and cond (its map retraces every call)."""
    model = Counter()
    traces = {"ours": 0, "jax": 0}

    def make(which, apply):
        def step(c):
            traces[which] += 1
            return apply(c)

        return step

    def calls(lax, step):
        def scan_body(c, _):
            return step(c), None

        def fori_body(i, c):
            return step(c)

        return {
            "scan": lambda: lax.scan(scan_body, X, length=3),
            "fori_loop": lambda: lax.fori_loop(0, 3, fori_body, X),
            "while_loop": lambda: lax.while_loop(negative, step, X),
            "cond": lambda: lax.cond(True, step, lambda c: c, X),
            "map": lambda: lax.map(step, jnp.stack([X, X])),
        }[kind]

    def negative(c):
        return c.sum() < 0.0

    ours = make("ours", model)
    raw = make("jax", lambda c: jnp.sin(c * model.w[...]))
    # The loops' bodies must be the same objects on every call for any cache to work.
    bodies = {"ours": calls(jo.lax, ours), "jax": calls(jax.lax, raw)}
    with jaxoverride_nnx.track(model):
        for _ in range(3):
            bodies["ours"]()
            bodies["jax"]()
    assert traces["ours"] == 1
    assert traces["jax"] == (3 if kind == "map" else 1)


def test_an_identical_eager_while_loop_runs_no_python_again():
    """JAX's testCaching under ``track``: neither cond_fun (its first test included) nor
    body_fun runs again on an identical second call, and what both write still comes out
    as a Python ``while`` loop's would."""
    python_runs = []

    def loop_of(model):
        def cond(x):
            python_runs.append("cond")
            model.count[...] += 1  # the first test writes too
            return x.sum() < 6.0

        def body(x):
            python_runs.append("body")
            return model(x) + 1.0

        return cond, body

    model = Counter()
    cond, body = loop_of(model)
    with jaxoverride_nnx.track(model):
        first = jo.lax.while_loop(cond, body, X)
        runs = len(python_runs)
        second = jo.lax.while_loop(cond, body, X)
    assert runs > 0 and len(python_runs) == runs

    reference = Counter()
    cond, body = loop_of(reference)
    expected = []
    for _ in range(2):
        x = X
        while cond(x):
            x = body(x)
        expected.append(x)
    np.testing.assert_allclose(first, expected[0], rtol=1e-6)
    np.testing.assert_allclose(second, expected[1], rtol=1e-6)
    assert int(model.count[...]) == int(reference.count[...])


def test_cached_loop_bodies_do_not_keep_modules_alive():
    holder = [Counter()]
    ref = weakref.ref(holder[0])

    def body(c, _):
        return holder[0](c), None

    with jaxoverride_nnx.track(holder[0]):
        jo.lax.scan(body, X, length=2)
        jo.lax.fori_loop(0, 2, lambda i, c: holder[0](c), X)
    del body
    holder.clear()
    gc.collect()
    assert ref() is None


# -- the hot path: a call with the tracked set, structure and build of the previous call is
# served without the general path's look-ups; it still reads every Variable each call ----


def _closure(model):
    return lambda x: model(x)


@pytest.mark.parametrize(
    "write",
    [
        "set_raw_value bypassing the check",
        "object.__setattr__ (as nnx.jit's partials write)",
        "the slot, as this adapter writes",
        "index assignment",
    ],
)
def test_a_write_between_hot_calls_is_seen_however_it_is_made(write):
    model = Counter()
    f = jo.jit(_closure(model))
    reference = Counter()
    new_w = jnp.full(3, 0.5, jnp.float32)
    with jaxoverride_nnx.track(model):
        for _ in range(3):  # the later calls are hot
            f(X)
            reference(X)
        if write.startswith("set_raw_value"):
            model.w.set_raw_value(new_w, _unsafe_bypass_check=True)
        elif write.startswith("object"):
            object.__setattr__(model.w, "_raw_value", new_w)
        elif write.startswith("the slot"):
            nnx.Variable.__dict__["_raw_value"].__set__(model.w, new_w)
        else:
            model.w[...] = new_w
        reference.w[...] = new_w
        got = f(X)
    np.testing.assert_allclose(got, reference(X), rtol=1e-6)  # both at their fourth call
    assert int(model.count[...]) == 4


@pytest.mark.skipif(
    not hasattr(nnx, "jit_partial"),
    reason="this Flax has no nnx.jit_partial (Flax 0.12.1, the oldest supported, lacks it)",
)
def test_hot_calls_and_nnx_partials_share_one_counter():
    model = Counter()
    f = jo.jit(_closure(model))
    partial = nnx.jit_partial(lambda m, x: m(x), model, graph=False)
    cached = nnx.cached_partial(nnx.jit(lambda m, x: m(x)), model)
    with jaxoverride_nnx.track(model):
        for _ in range(2):
            f(X)
            partial(X)
            f(X)
            cached(X)
            f(X)
    assert int(model.count[...]) == 10


def test_a_structural_change_between_hot_calls_is_walked_again():
    class Holder(nnx.Module):
        def __init__(self):
            self.inner = Counter()

        def __call__(self, x):
            return self.inner(x)

    model, traces = Holder(), Traces()
    f = jo.jit(traces.wrap(model))
    with jaxoverride_nnx.track(model):
        f(X)
        f(X)
        model.inner = Counter(seed=1)  # a new submodule: the old structure is stale
        got = f(X)
        f(X)
    np.testing.assert_allclose(got, Counter(seed=1)(X), rtol=1e-6)
    assert int(model.inner.count[...]) == 2
    assert traces.count == 1  # the same structure: the trace is reused


def test_a_new_scope_is_never_served_the_previous_scopes_variables():
    first, second = Counter(), Counter(seed=1)
    current = first
    f = jo.jit(lambda x: current(x))
    with jaxoverride_nnx.track(first):
        f(X)
        f(X)
    current = second
    with jaxoverride_nnx.track(second):
        got = f(X)
    np.testing.assert_allclose(got, Counter(seed=1)(X), rtol=1e-6)
    assert (int(first.count[...]), int(second.count[...])) == (2, 1)


def test_a_hot_call_inside_a_raw_jit_refuses_the_write_as_the_general_path_does():
    model = Counter()
    f = jo.jit(_closure(model))
    with jaxoverride_nnx.track(model):
        f(X)
        f(X)  # hot
        # The values the call carries into the raw jit are refused first (they would be
        # baked in); with that check off, the write is refused as before.
        with pytest.raises(jo.errors.MissingAdapterError, match=r"`Counter\.count`"):
            jax.jit(lambda x: f(x))(X)
        previous = jo.set_adapter_check(False)
        try:
            with pytest.raises(
                jaxoverride_nnx.LevelError, match="not a jaxoverride neutral function"
            ):
                jax.jit(lambda x: f(x))(X)
        finally:
            jo.set_adapter_check(previous)
        assert int(model.count[...]) == 2
        f(X)
    assert int(model.count[...]) == 3


_WHILE_CASES = ["body_writes", "cond_reads", "cond_writes", "both_write"]


def _while_functions(case, model):
    """``(cond_fun, body_fun)`` over ``model`` (a ``Counter``) for one case."""

    def cond(x):
        if case in ("cond_writes", "both_write"):
            model.count[...] += 1
        bound = 10.0 + model.count[...] if case == "cond_reads" else 10.0
        return x.sum() < bound

    def body(x):
        return model(x) + 1.0 if case in ("body_writes", "both_write") else x * 2.0 + 1.0

    return cond, body


def _hand_written_while(case, state, x):
    """The case in raw JAX over explicit state: test before the loop, then (body, test)
    per step, the predicate carried (a Python ``while`` loop's order)."""
    (count, w), tree = jax.tree.flatten(state)

    def cond(x, count, w):
        if case in ("cond_writes", "both_write"):
            count = count + 1
        bound = 10.0 + count if case == "cond_reads" else 10.0
        return x.sum() < bound, count, w

    def body(x, count, w):
        if case in ("body_writes", "both_write"):
            count = count + 1
            return jnp.sin(x * w) + 0.1 * count + 1.0, count, w
        return x * 2.0 + 1.0, count, w

    def step(carry):
        x, count, w, _ = carry
        x, count, w = body(x, count, w)
        going, count, w = cond(x, count, w)
        return x, count, w, going

    going, count, w = cond(x, count, w)
    x, count, w, _ = jax.lax.while_loop(lambda carry: carry[3], step, (x, count, w, going))
    return x, jax.tree.unflatten(tree, [count, w])


@pytest.mark.parametrize("case", _WHILE_CASES)
def test_a_stateful_while_loop_traces_to_the_hand_written_loop(case):
    """Under a trace, a while_loop that touches tracked state is raw JAX's loop over the
    state made explicit: the first test before the loop, the predicate in the carry."""
    graphdef, state = nnx.split(Counter())

    def ours(state, x):
        model = nnx.merge(graphdef, state)
        cond, body = _while_functions(case, model)
        with jaxoverride_nnx.track(model):
            out = jo.lax.while_loop(cond, body, x)
        return out, nnx.state(model)

    expected = jax.make_jaxpr(lambda s, x: _hand_written_while(case, s, x))(state, X)
    assert str(jax.make_jaxpr(ours)(state, X)) == str(expected)
    ref_out, ref_after = _hand_written_while(case, state, X)
    out, after = ours(state, X)  # eagerly: may write into ``state``'s Variables
    np.testing.assert_allclose(out, ref_out, rtol=1e-6)
    assert jax.tree.leaves(after)[0] == jax.tree.leaves(ref_after)[0]


@pytest.mark.parametrize("case", _WHILE_CASES)
def test_an_identical_eager_stateful_while_loop_compiles_once(case):
    model = Counter()
    cond, body = _while_functions(case, model)
    compiles = []

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    outs = []
    with jaxoverride_nnx.track(model):
        outs.append(jo.lax.while_loop(cond, body, X))
        jax.monitoring.register_event_duration_secs_listener(listen)
        try:
            outs += [jo.lax.while_loop(cond, body, X) for _ in range(2)]
        finally:
            jax.monitoring.unregister_event_duration_listener(listen)
    assert compiles == []

    reference = Counter()
    cond, body = _while_functions(case, reference)
    for out in outs:
        x = X
        while cond(x):
            x = body(x)
        np.testing.assert_allclose(out, x, rtol=1e-6)
    assert int(model.count[...]) == int(reference.count[...])


class _TwoCounters(nnx.Module):
    """Writes ``small`` for inputs of up to 3 elements and ``large`` beyond."""

    def __init__(self):
        self.small = nnx.Variable(jnp.array(0))
        self.large = nnx.Variable(jnp.array(0))

    def __call__(self, x):
        if x.shape[0] <= 3:
            self.small[...] += 1
        else:
            self.large[...] += 1
        return x * 2


@pytest.mark.parametrize("order", [(3, 5, 3, 5), (5, 3, 5, 3), (3, 3, 8, 5, 3)])
def test_traces_that_write_other_variables_are_each_written_back(order):
    """A second trace of one build that writes another set of Variables (here: another
    input shape) gets a build that returns the general layout; no output is misread."""
    model = _TwoCounters()
    f = jo.jit(lambda x: model(x))
    with jaxoverride_nnx.track(model):
        for size in order:
            np.testing.assert_array_equal(f(jnp.ones(size)), 2 * np.ones(size))
            np.testing.assert_array_equal(f(jnp.ones(size)), 2 * np.ones(size))  # hot
    small = sum(2 for size in order if size <= 3)
    assert (int(model.small[...]), int(model.large[...])) == (small, 2 * len(order) - small)


def test_a_trace_that_writes_nothing_after_one_that_writes_is_read_right():
    class Maybe(nnx.Module):
        def __init__(self):
            self.count = nnx.Variable(jnp.array(0))

        def __call__(self, x, *, bump):
            if bump:
                self.count[...] += 1
            return x + 1

    model = Maybe()
    f = jo.jit(lambda x, bump: model(x, bump=bump), static_argnums=1)
    with jaxoverride_nnx.track(model):
        outs = [f(X, bump) for bump in (True, False, True, False, False)]
        assert model.count.get_value().shape == ()
    for out in outs:
        np.testing.assert_allclose(out, X + 1)
    assert int(model.count[...]) == 2
    with jaxoverride_nnx.track(model):
        shapes = f.eval_shape(X, False), f.eval_shape(X, True)
    assert [s.shape for s in shapes] == [X.shape, X.shape]
    assert int(model.count[...]) == 2  # eval_shape changes nothing
