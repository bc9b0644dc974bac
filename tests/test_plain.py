"""``jaxoverride_plain``: the init flag's contextvar semantics, and every init-safe
combinator (directly and through ``context()``) against a small dict-based parameter
store that creates each parameter, computed with JAX, the first time it is asked for.

Such a store is exactly what leaks tracers when its first use happens inside a JAX
control-flow trace: the tests show that leak with the raw ``jax.lax`` functions, and its
absence with the combinators, inside ``jax.checking_leaks()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import threading
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.core import Tracer

import jaxoverride as jo
import jaxoverride_plain as plain
from _parity import (
    JAX,
    assert_same,
    fresh_jax_caches_per_module,  # noqa: F401 - an autouse fixture
)
from _threads import run_in_threads
from jaxoverride import lax as jlax

# --- the parameter store -----------------------------------------------------------------


class Store:
    """Parameters by name, and the order in which they were created."""

    def __init__(self, params: dict[str, jax.Array] | None = None):
        self.params = dict(params or {})
        self.created: list[str] = []


_store: contextvars.ContextVar[Store] = contextvars.ContextVar("test_plain_store")


@contextlib.contextmanager
def using(store: Store) -> Iterator[Store]:
    token = _store.set(store)
    try:
        yield store
    finally:
        _store.reset(token)


def param(name: str, shape: tuple[int, ...]) -> jax.Array:
    """The parameter ``name``, created (by a JAX computation) at init if it is missing."""
    store = _store.get()
    if name not in store.params:
        if not plain.is_initializing():
            raise KeyError(f"parameter {name!r} was not created at init")
        seed = zlib.crc32(name.encode())
        store.params[name] = 0.5 * jax.random.normal(jax.random.key(seed), shape)
        store.created.append(name)
    return store.params[name]


def init(model: Callable[..., Any], *args: Any) -> tuple[dict[str, jax.Array], Any, list[str]]:
    store = Store()
    with using(store), plain.init_context():
        out = model(*args)
    return store.params, out, store.created


def apply(model: Callable[..., Any], params: dict[str, jax.Array], *args: Any) -> Any:
    with using(Store(params)):
        return model(*args)


def is_tracer(value: Any) -> bool:
    return isinstance(value, Tracer)


# --- models, one per combinator, written against an ``ops`` namespace --------------------
#
# ``SAFE`` calls the init-safe combinators directly; ``NEUTRAL`` calls jaxoverride.lax
# (run inside ``plain.context()``); ``RAW`` calls jax.lax and shows the leak.

D = 3


class Ops:
    def __init__(self, scan, while_loop, fori_loop, cond, switch, map):
        self.scan, self.while_loop, self.fori_loop = scan, while_loop, fori_loop
        self.cond, self.switch, self.map = cond, switch, map


SAFE = Ops(
    plain.init_safe_scan,
    plain.init_safe_while_loop,
    plain.init_safe_fori_loop,
    plain.init_safe_cond,
    plain.init_safe_switch,
    plain.init_safe_map,
)
NEUTRAL = Ops(jlax.scan, jlax.while_loop, jlax.fori_loop, jlax.cond, jlax.switch, jlax.map)
RAW = Ops(
    jax.lax.scan, jax.lax.while_loop, jax.lax.fori_loop, jax.lax.cond, jax.lax.switch, jax.lax.map
)


def dense(name: str, h: jax.Array) -> jax.Array:
    return jnp.tanh(h @ param(f"{name}/w", (D, D)) + param(f"{name}/b", (D,)))


def scan_model(ops, h, xs):
    def body(carry, x):
        new = dense("scan", carry + x)
        return new, new.sum()

    return ops.scan(body, h, xs)


def scan_length_model(ops, h, n):
    return ops.scan(lambda c, _: (dense("count", c), None), h, length=n)[0]


def while_model(ops, h, trips):
    def cond(state):
        i, _ = state
        return i < trips

    def body(state):
        i, v = state
        return i + 1, dense("while", v)

    return ops.while_loop(cond, body, (0, h))


def fori_model(ops, h, lower, upper):
    return ops.fori_loop(lower, upper, lambda i, v: dense("fori", v) * (i + 1.0), h)


def cond_model(ops, h, flag):
    return ops.cond(flag, lambda v: dense("yes", v), lambda v: dense("no", v) * 2.0, h)


def cond_operand_model(ops, h, flag):
    return ops.cond(
        flag, lambda pair: dense("left", pair[0]), lambda pair: dense("right", pair[1]),
        operand=(h, h * 2.0),
    )  # fmt: skip


def switch_model(ops, h, index):
    branches = [lambda v, k=k: dense(f"branch{k}", v) for k in range(3)]
    return ops.switch(index, branches, h)


def map_model(ops, xs, batch_size):
    return ops.map(lambda x: dense("map", x), xs, batch_size=batch_size)


def nested_model(ops, h, xs):
    """scan over (fori_loop over cond), plus a map inside the scan body."""

    def inner(i, v):
        return ops.cond(i % 2 == 0, lambda u: dense("even", u), lambda u: dense("odd", u), v)

    def body(carry, x):
        carry = ops.fori_loop(0, 2, inner, carry + x)
        rows = ops.map(lambda r: dense("row", r), jnp.stack([carry, x]))
        return carry + rows.sum(0), None

    return ops.scan(body, h, xs)[0]


H = np.linspace(-1.0, 1.0, D).astype(np.float32)
XS = np.linspace(-0.5, 0.5, 4 * D).astype(np.float32).reshape(4, D)

MODELS = {
    "scan": (scan_model, (H, XS), ["scan/w", "scan/b"]),
    "scan-length": (scan_length_model, (H, 3), ["count/w", "count/b"]),
    "while_loop": (while_model, (H, 3), ["while/w", "while/b"]),
    "fori_loop": (fori_model, (H, 1, 4), ["fori/w", "fori/b"]),
    "cond-true": (cond_model, (H, True), ["yes/w", "yes/b", "no/w", "no/b"]),
    "cond-array-predicate": (cond_model, (H, jnp.bool_(False)), ["yes/w", "yes/b", "no/w", "no/b"]),
    "cond-operand": (cond_operand_model, (H, False), ["left/w", "left/b", "right/w", "right/b"]),
    "switch": (switch_model, (H, 1), [f"branch{k}/{p}" for k in range(3) for p in "wb"]),
    "switch-out-of-range": (switch_model, (H, 7), [f"branch{k}/{p}" for k in range(3)
                                                   for p in "wb"]),
    "map": (map_model, (XS, None), ["map/w", "map/b"]),
    "map-batch-size": (map_model, (XS, 3), ["map/w", "map/b"]),
    "nested": (nested_model, (H, XS[:2]), ["even/w", "even/b", "odd/w", "odd/b", "row/w", "row/b"]),
}  # fmt: skip

ZERO_TRIP = {
    "scan-empty-xs": (scan_model, (H, XS[:0]), ["scan/w", "scan/b"]),
    "scan-length-0": (scan_length_model, (H, 0), ["count/w", "count/b"]),
    "while-zero-trips": (while_model, (H, 0), ["while/w", "while/b"]),
    "fori-empty-range": (fori_model, (H, 3, 3), ["fori/w", "fori/b"]),
    "fori-reversed-range": (fori_model, (H, 5, 2), ["fori/w", "fori/b"]),
    "map-empty": (map_model, (XS[:0], None), ["map/w", "map/b"]),
}


def run_init_and_apply(model, args, ops, *, jit: bool = False):
    def init_fn(*a):
        params, out, _ = init(lambda *b: model(ops, *b), *a)
        return params, out

    def apply_fn(params, *a):
        return apply(lambda *b: model(ops, *b), params, *a)

    if jit:
        # Static non-array arguments (trip counts, Python flags) stay static.
        static = tuple(i for i, a in enumerate(args) if not isinstance(a, np.ndarray | jax.Array))
        params, at_init = jax.jit(init_fn, static_argnums=static)(*args)
        at_apply = jax.jit(apply_fn, static_argnums=tuple(i + 1 for i in static))(params, *args)
    else:
        params, at_init = init_fn(*args)
        at_apply = apply_fn(params, *args)
    return params, at_init, at_apply


def _ops_and_scope(kind: str) -> tuple[Any, contextlib.AbstractContextManager[Any]]:
    """``combinators``: the init-safe combinators, called directly; ``context``: the neutral
    API inside ``jaxoverride_plain.context()``."""
    if kind == "combinators":
        return SAFE, contextlib.nullcontext()
    return NEUTRAL, plain.context()


@pytest.mark.parametrize("kind", ["combinators", "context"])
@pytest.mark.parametrize("model_id", sorted(MODELS))
def test_init_creates_every_parameter_and_matches_apply(model_id, kind):
    model, args, expected_names = MODELS[model_id]
    ops, scope = _ops_and_scope(kind)
    # checking_leaks collects garbage at every trace exit; the store check below is the
    # direct evidence, so the leak checker runs for the combinators only (same code path).
    leaks = jax.checking_leaks() if kind == "combinators" else contextlib.nullcontext()
    with scope, leaks:
        store = Store()
        with using(store), plain.init_context():
            at_init = model(ops, *args)
        at_apply = apply(lambda *a: model(ops, *a), store.params, *args)
    assert sorted(store.created) == sorted(expected_names)
    assert len(store.created) == len(set(store.created))  # each created once
    assert not any(is_tracer(value) for value in store.params.values())
    assert_same(at_init, at_apply)


@pytest.mark.parametrize("model_id", ["scan", "while_loop", "cond-array-predicate", "nested"])
def test_init_under_jax_jit(model_id):
    """The init function itself jitted: parameters are jit values, returned as outputs."""
    model, args, expected_names = MODELS[model_id]
    with jax.checking_leaks():
        params, at_init, at_apply = run_init_and_apply(model, args, SAFE, jit=True)
    assert sorted(params) == sorted(expected_names)
    assert_same(at_init, at_apply)
    # And the jitted init gives the eager init's parameters.
    eager_params, _, _ = run_init_and_apply(model, args, SAFE)
    assert_same(params, eager_params)


@pytest.mark.parametrize("kind", ["combinators", "context"])
@pytest.mark.parametrize("model_id", sorted(ZERO_TRIP))
def test_zero_trip_loops_create_parameters_and_return_init_val(model_id, kind):
    model, args, expected_names = ZERO_TRIP[model_id]
    ops, scope = _ops_and_scope(kind)
    with scope, jax.checking_leaks():
        params, at_init, at_apply = run_init_and_apply(model, args, ops)
    assert sorted(params) == sorted(expected_names)
    assert_same(at_init, at_apply)
    if model_id.startswith("scan"):
        carry = at_init[0] if model_id == "scan-empty-xs" else at_init
        assert_same(carry, jnp.asarray(H))  # the loop never ran: init is returned
    elif model_id.startswith("while"):
        assert int(at_init[0]) == 0
        assert_same(at_init[1], jnp.asarray(H))
    elif model_id.startswith("fori"):
        np.testing.assert_array_equal(at_init, H)
    else:
        assert at_init.shape == (0, D)


def inside_a_trace() -> bool:
    """Whether JAX is tracing here: any operation then gives a tracer."""
    return is_tracer(jnp.zeros(()) + 1)


def test_nested_loops_create_once_per_combinator_outside_every_trace():
    """Inner combinators create in the outer creation pass; in traces they only apply."""
    creations: list[bool] = []

    def create(thunk):
        creations.append(inside_a_trace())
        thunk()

    ops = Ops(*(functools.partial(fn, create=create) for fn in (
        plain.init_safe_scan, plain.init_safe_while_loop, plain.init_safe_fori_loop,
        plain.init_safe_cond, plain.init_safe_switch, plain.init_safe_map,
    )))  # fmt: skip
    store = Store()
    with using(store), plain.init_context(), jax.checking_leaks():
        at_init = nested_model(ops, H, XS[:3])
    # scan, then in its creation pass: fori_loop (whose creation pass runs the cond) and map.
    assert creations == [False, False, False, False]
    assert sorted(store.created) == sorted(MODELS["nested"][2])
    assert not any(is_tracer(value) for value in store.params.values())
    assert_same(at_init, apply(lambda *a: nested_model(ops, *a), store.params, H, XS[:3]))


def test_a_hook_that_always_initialises_creates_only_outside_every_trace():
    """A custom ``initializing`` hook is not asked inside an apply pass: the combinator
    nested in the traced body only applies (its parameters came from the outer creation
    pass), so no creation pass runs inside JAX's trace."""
    creations: list[bool] = []

    def create(thunk):
        creations.append(inside_a_trace())
        thunk()

    always = {"initializing": lambda: True, "create": create}

    def body(carry, x):
        inner = plain.init_safe_cond(x > 0, jnp.sin, jnp.cos, carry, **always)
        return inner + x, None

    with jax.checking_leaks():
        carry, _ = plain.init_safe_scan(body, jnp.float32(0.5), XS[:3, 0], **always)
    assert creations == [False, False]  # the scan's pass, and the cond's inside it
    expected, _ = jax.lax.scan(
        lambda c, x: (jax.lax.cond(x > 0, jnp.sin, jnp.cos, c) + x, None),
        jnp.float32(0.5),
        XS[:3, 0],
    )
    assert_same(carry, expected)


RAW_LEAKS = ["scan", "while_loop", "fori_loop", "cond-array-predicate", "switch", "map", "nested"]


@pytest.mark.parametrize("model_id", RAW_LEAKS)
def test_without_the_combinators_parameters_leak(model_id):
    """The failure the combinators fix: raw jax.lax creates parameters inside its trace,
    so the store keeps tracers, and apply fails on them."""
    model, args, _ = MODELS[model_id]
    params, _, _ = init(lambda *a: model(RAW, *a), *args)
    assert any(is_tracer(value) for value in params.values())
    with pytest.raises(jax.errors.UnexpectedTracerError):
        apply(lambda *a: model(RAW, *a), params, *args)


LEAKY: dict[str, Any] = {}


def leaky_body(carry, x):
    if plain.is_initializing():
        LEAKY.setdefault("w", jnp.full((D,), 0.5) * 2.0)
    return carry * LEAKY["w"] + x, None


@pytest.mark.parametrize("safe", [False, True])
def test_checking_leaks_reports_the_raw_leak_and_not_the_safe_one(safe):
    # A module-level store keeps JAX's leak report short: it walks gc.get_referrers
    # from the tracer up to a module, which costs seconds for a long chain.
    LEAKY.clear()
    scan = plain.init_safe_scan if safe else jax.lax.scan
    try:
        with plain.init_context():
            if safe:
                with jax.checking_leaks():
                    scan(leaky_body, H, XS)
                assert not is_tracer(LEAKY["w"])
            else:
                with pytest.raises(Exception, match="Leaked trace") as info:
                    with jax.checking_leaks():
                        scan(leaky_body, H, XS)
                assert "LEAKY" in str(info.value)  # JAX names where the tracer is kept
    finally:
        LEAKY.clear()


def test_context_outside_init_is_a_pass_through():
    """Inside plain.context() but not initialising, the neutral calls are JAX's: same jaxpr."""
    params, _, _ = init(lambda *a: scan_model(SAFE, *a), H, XS)

    def run(ops):
        return lambda h, xs: apply(lambda *a: scan_model(ops, *a), params, h, xs)

    expected = str(jax.make_jaxpr(run(RAW))(H, XS))
    with plain.context():
        assert str(jax.make_jaxpr(run(NEUTRAL))(H, XS)) == expected


def test_context_makes_transforms_init_safe():
    def model(x):
        scale = jo.jit(lambda v: dense("jit", v))(x)
        grad = jo.grad(lambda v: dense("grad", v).sum())(x)
        batched = jo.vmap(lambda v: dense("vmap", v))(jnp.stack([x, x * 2.0]))
        return scale + grad + batched.sum(0)

    with plain.context(), jax.checking_leaks():
        params, at_init, created = init(model, H)
        at_apply = apply(model, params, H)
    assert sorted(created) == sorted(f"{n}/{p}" for n in ("jit", "grad", "vmap") for p in "wb")
    assert_same(at_init, at_apply)


@pytest.mark.parametrize("in_axes", [(0, None), (1, None), (None, 0), (-1, None)])
def test_context_vmap_creates_on_one_slice_of_each_mapped_argument(in_axes):
    """The creation pass slices along each argument's own axis and leaves None alone."""
    batch = jnp.stack([H, H * 2.0, H * 3.0])  # (3, d)
    mapped = batch if in_axes[0] == 0 else batch.T if in_axes[0] in (1, -1) else H
    offset = H if in_axes[1] is None else batch

    def model(x, y):
        return jo.vmap(lambda v, o: dense("vmap", v) + o, in_axes=in_axes)(x, y)

    with plain.context(), jax.checking_leaks():
        params, at_init, created = init(model, mapped, offset)
        at_apply = apply(model, params, mapped, offset)
    assert sorted(created) == ["vmap/b", "vmap/w"]
    assert_same(at_init, at_apply)


# --- hooks ---------------------------------------------------------------------------------


def test_create_and_initializing_hooks_and_default_impl():
    passes: list[str] = []

    def create(thunk):
        passes.append("create")
        with plain.init_context():  # the hook decides how creation runs
            thunk()

    def counting_scan(*args, **kwargs):
        passes.append("apply")
        return jax.lax.scan(*args, **kwargs)

    store = Store()
    with using(store):
        out = plain.init_safe_scan(
            lambda c, x: (dense("hook", c + x), None),
            H,
            XS,
            default_scan=counting_scan,
            initializing=lambda: True,
            create=create,
        )
    assert passes == ["create", "apply"]
    assert sorted(store.created) == ["hook/b", "hook/w"]
    with using(store):
        expected = jax.lax.scan(lambda c, x: (dense("hook", c + x), None), jnp.asarray(H), XS)
    assert_same(out, expected)
    passes.clear()
    with using(store):
        plain.init_safe_scan(
            lambda c, x: (dense("hook", c + x), None), H, XS, default_scan=counting_scan,
            create=create,
        )  # fmt: skip
    assert passes == ["apply"]  # not initialising: no creation pass


def test_apply_pass_is_marked():
    seen: list[tuple[bool, bool]] = []

    def body(carry, _):
        seen.append((plain.is_initializing(), plain.is_applying()))
        return carry, None

    with plain.init_context():
        plain.init_safe_scan(body, 0.0, length=1)
    assert seen == [(True, False), (False, True)]  # creation pass, then the traced apply


# --- init_context semantics ----------------------------------------------------------------


def test_init_context_nests_and_unwinds():
    assert not plain.is_initializing() and not plain.is_applying()
    with plain.init_context():
        assert plain.is_initializing()
        with plain.init_context(False):
            assert not plain.is_initializing()
            with plain.init_context(True):
                assert plain.is_initializing()
            assert not plain.is_initializing()
        with pytest.raises(KeyError), plain.init_context(False):
            raise KeyError
        assert plain.is_initializing()
        with plain.applying():
            assert plain.is_applying() and not plain.is_initializing()
        assert not plain.is_applying()
    assert not plain.is_initializing()


def test_init_context_is_private_to_each_thread():
    barrier = threading.Barrier(8)
    results: dict[int, list[bool]] = {}

    def worker(index: int) -> None:
        mine = index % 2 == 0
        log = []
        with plain.init_context(mine):
            for _ in range(5):
                barrier.wait()  # every thread inside its own context at once
                log.append(plain.is_initializing())
        log.append(plain.is_initializing())
        results[index] = log

    run_in_threads(worker, 8)
    for index, log in results.items():
        assert log == [index % 2 == 0] * 5 + [False]
    assert not plain.is_initializing()


def test_init_context_is_private_to_each_asyncio_task():
    async def task(initializing: bool, delay: float) -> list[bool]:
        seen = []
        with plain.init_context(initializing):
            for _ in range(3):
                await asyncio.sleep(delay)
                seen.append(plain.is_initializing())
        seen.append(plain.is_initializing())
        return seen

    async def main():
        with plain.init_context():
            return await asyncio.gather(task(False, 0.002), task(True, 0.003), task(False, 0.001))

    a, b, c = asyncio.run(main())
    assert a == [False, False, False, True]  # back to the creator's value, copied at creation
    assert b == [True, True, True, True]
    assert c == [False, False, False, True]


def test_threads_initialising_different_stores_at_once():
    """Two threads init, two apply, the same model through the combinators, concurrently."""
    params, reference, _ = init(lambda *a: scan_model(SAFE, *a), H, XS)
    barrier = threading.Barrier(4)
    outputs: dict[int, Any] = {}

    def worker(index: int) -> None:
        barrier.wait()
        if index % 2:
            outputs[index] = init(lambda *a: scan_model(SAFE, *a), H, XS)[:2]
        else:
            outputs[index] = (params, apply(lambda *a: scan_model(SAFE, *a), params, H, XS))

    run_in_threads(worker, 4)
    for got_params, out in outputs.values():
        assert_same(got_params, params)
        assert_same(out, reference)


# --- bad input at init: JAX's own errors ------------------------------------------------


def _generator():
    return (i for i in range(3))


BAD_LOOP_INPUTS = {
    "scan over a string": lambda api, xs: api.lax.scan(lambda c, x: (c, x), 0.0, xs=xs),
    "map over a string": lambda api, xs: api.lax.map(lambda x: x, xs),
}


def _error(thunk: Callable[[], Any]) -> tuple[type, str]:
    with pytest.raises(Exception) as raised:
        thunk()
    return type(raised.value), str(raised.value)


@contextlib.contextmanager
def _haiku_init() -> Iterator[Callable[[Callable[[], Any]], Any]]:
    import haiku as hk

    import jaxoverride_haiku

    with jaxoverride_haiku.context():
        yield lambda thunk: hk.transform(lambda: thunk()).init(jax.random.PRNGKey(0))


@contextlib.contextmanager
def _plain_init() -> Iterator[Callable[[Callable[[], Any]], Any]]:
    with plain.context(), plain.init_context():
        yield lambda thunk: thunk()


@pytest.mark.parametrize("where", [_plain_init, _haiku_init], ids=["plain", "haiku"])
@pytest.mark.parametrize("make_xs", [lambda: "abc", _generator], ids=["str", "generator"])
@pytest.mark.parametrize("call", list(BAD_LOOP_INPUTS), ids=list(BAD_LOOP_INPUTS))
def test_loops_over_what_jax_refuses_raise_jaxs_error_at_init(where, make_xs, call):
    """JAX refuses ``xs`` that are no arrays with ``TypeError: ... is not a valid JAX type``;
    the creation pass at init used to fail first, with an ``AttributeError``."""
    xs = make_xs()
    expected = _error(lambda: BAD_LOOP_INPUTS[call](JAX, xs))
    with where() as run:
        actual = _error(lambda: run(lambda: BAD_LOOP_INPUTS[call](jo, xs)))
    assert actual == expected


@pytest.mark.parametrize("where", [_plain_init, _haiku_init], ids=["plain", "haiku"])
def test_vmap_of_a_scalar_raises_jaxs_rank_error_at_init(where):
    expected = _error(lambda: jax.vmap(lambda x: x)(1.0))
    assert expected[0] is ValueError and "rank" in expected[1]
    with where() as run:
        assert _error(lambda: run(lambda: jo.vmap(lambda x: x)(1.0))) == expected
        assert _error(
            lambda: run(lambda: jo.vmap(lambda x, y: x, in_axes=(0, 1))(jnp.ones(3), jnp.ones(2)))
        ) == _error(lambda: jax.vmap(lambda x, y: x, in_axes=(0, 1))(jnp.ones(3), jnp.ones(2)))
