"""The kit's pieces against JAX itself: argnums as ``jax.jit`` reads them, ``lax.map``'s
batches, the wrapper cache's lifetime and bound, the stack position, JAX's own errors."""

from __future__ import annotations

import gc
import inspect
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import api_util  # the reference the kit's inference must match

import jaxoverride as jo
from jaxoverride import adapter_kit as kit


def _positional(a, b, /, c, d=1, *args, e, f=2, **kwargs): ...


def _plain(x, y, z): ...


@pytest.mark.parametrize("fun", [_positional, _plain, lambda *args: None])
@pytest.mark.parametrize(
    ("argnums", "argnames"),
    [(None, None), (0, None), ((1, 3), None), (-1, None), (None, "c"), (None, ("y", "e")),
     ((0,), ("z",)), ((), ())],
)  # fmt: skip
def test_argnum_inference_is_jaxs(fun, argnums, argnames):
    expected = api_util.infer_argnums_and_argnames(inspect.signature(fun), argnums, argnames)
    got = kit.infer_argnums_and_argnames(fun, argnums, argnames)
    assert got == (tuple(expected[0]), tuple(expected[1]))


def test_resolve_argnums_counts_donations_among_all_arguments():
    def solve(f, x, steps, y): ...

    donated, _, static, _ = kit.resolve_argnums(solve, (1, 3), None, (0, 2), None)
    assert donated == (1, 3) and static == (0, 2)


def test_shift_argnums_moves_past_leading_state():
    assert kit.shift_argnums((0, 2, -1), by=2) == (2, 4, -1)


@pytest.mark.parametrize("batch_size", [0, 1, 3, 7, 10])
def test_batched_map_is_lax_map(batch_size):
    xs = {"a": jnp.arange(7.0), "b": jnp.arange(14.0).reshape(7, 2)}
    f = lambda x: x["a"] * x["b"].sum()
    blocks = lambda b: jax.lax.scan(lambda _, x: ((), jax.vmap(f)(x)), (), b)[1]
    try:
        want = jax.lax.map(f, xs, batch_size=batch_size)
    except ZeroDivisionError:  # batch_size=0 before JAX 0.9: the same error, as JAX's
        with pytest.raises(ZeroDivisionError):
            kit.batched_map(blocks, jax.vmap(f), xs, batch_size)
        return
    got = kit.batched_map(blocks, jax.vmap(f), xs, batch_size)
    np.testing.assert_array_equal(got, want)


def test_wrapper_cache_is_weak_and_bounded():
    cache: kit.WrapperCache[object] = kit.WrapperCache(limit=2)

    def body(x):
        return x

    made = []
    make = lambda getters: made.append(getters) or object()
    first = cache.get((body,), "a", make)
    assert cache.get((body,), "a", make) is first and len(made) == 1
    cache.get((body,), "b", make)
    cache.get((body,), "c", make)  # past the limit: the table starts afresh
    assert cache.get((body,), "a", make) is not first
    assert made[0][0]() is body
    alive = weakref.ref(body)
    del body
    gc.collect()
    assert alive() is None  # the cache kept no strong reference
    assert made[0][0]() is None


def test_wrapper_cache_without_weak_references_builds_anew():
    cache: kit.WrapperCache[object] = kit.WrapperCache()
    unhashable_key = ["plan"]
    a = cache.get((len,), unhashable_key, lambda getters: object())  # type: ignore[arg-type]
    assert a is not cache.get((len,), unhashable_key, lambda getters: object())  # type: ignore[arg-type]


def test_override_position_sees_the_layers_above_and_below():
    seen = []

    def lower(*args, **kwargs):
        seen.append(kit.override_position("lax.scan"))
        return jo.next_impl("lax.scan")(*args, **kwargs)

    def upper(*args, **kwargs):
        return jo.next_impl("lax.scan")(*args, **kwargs)

    with jo.override_context({"lax.scan": lower}), jo.override_context({"lax.scan": upper}):
        jo.lax.scan(lambda c, x: (c, x), 0, length=1)
    assert seen[0].below is jax.lax.scan and seen[0].above == (upper,)
    with pytest.raises(RuntimeError, match="no override is running"):
        kit.override_position("lax.scan")


def test_raise_as_jax_prefers_jaxs_error():
    ours = RuntimeError("the adapter's")
    with pytest.raises(TypeError, match="scan body output must be a pair"):
        kit.raise_as_jax(lambda: jax.lax.scan(lambda c, x: c, 0.0, None, length=1), ours)
    with pytest.raises(RuntimeError, match="the adapter's"):
        kit.raise_as_jax(lambda: jax.lax.scan(lambda c, x: (c, x), 0.0, None, length=1), ours)


def test_no_operand_is_jaxs_default():
    assert inspect.signature(jax.lax.cond).parameters["operand"].default is kit.NO_OPERAND
    assert inspect.signature(jax.shard_map).parameters["in_specs"].default is kit.INFER_SPECS


class _TraceAgain(kit.TraceAbort):
    """What an adapter raises inside a trace to trace again."""


def test_a_released_trace_abort_leaves_no_tracer_of_the_enclosing_trace():
    """JAX frees a trace that an exception aborts only if the catcher releases it: the
    aborted loop body kept an effectful equation with the jit's ``x`` as a constant,
    which ``jax.checking_leaks()`` reports otherwise. The catcher's trace goes on."""
    aborts = []

    def outer(x):
        def body(c):
            jax.debug.callback(lambda v: None, x)
            raise _TraceAgain()

        try:
            jax.lax.while_loop(lambda c: c < 3, body, 0)
        except _TraceAgain as abort:
            aborts.append(isinstance(abort, Exception))
            abort.release()
        return x + 1

    with jax.checking_leaks():
        assert float(jax.jit(outer)(1.0)) == 2.0
    assert aborts == [False]  # user code that catches Exception cannot swallow it
