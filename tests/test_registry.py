"""The override registry: resolution, nesting, delegation, isolation, caching, installs."""

from __future__ import annotations

import asyncio
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jaxoverride as jo
from _threads import run_in_threads
from jaxoverride import _stack, lax as jlax


def tagging_scan(tag: str, log: list[str]):
    """A lax.scan override that logs ``tag`` and delegates to the next implementation."""

    def scan(f, init, xs=None, length=None, reverse=False, unroll=1, _split_transpose=False):
        log.append(tag)
        return jo.next_impl("lax.scan")(f, init, xs, length, reverse, unroll, _split_transpose)

    scan.__qualname__ = f"scan[{tag}]"
    return scan


def count_up(n: int):
    return jlax.scan(lambda c, _: (c + 1, c), 0, length=n)


def test_nothing_active_is_jax_itself():
    assert jo.resolve("lax.scan") is jax.lax.scan
    assert jo.resolve("jit") is jax.jit
    assert repr(jo.current_stack()).startswith("<jaxoverride stack: empty")
    assert _stack.idle


def test_nesting_innermost_wins_and_delegates_down():
    log: list[str] = []
    outer = jo.override_context({"lax.scan": tagging_scan("outer", log)}, name="outer")
    inner = jo.override_context({"lax.scan": tagging_scan("inner", log)}, name="inner")
    with outer:
        count_up(2)
        with inner:
            carry, ys = count_up(3)
        count_up(1)
    assert log == ["outer", "inner", "outer", "outer"]
    assert int(carry) == 3
    np.testing.assert_array_equal(ys, [0, 1, 2])


def test_same_context_entered_twice_stacks_twice():
    log: list[str] = []
    ctx = jo.override_context({"lax.scan": tagging_scan("x", log)})
    with ctx, ctx:
        count_up(1)
    assert log == ["x", "x"]


def test_override_calling_user_code_sees_the_full_stack():
    """A body run by an override dispatches from the top again, recursively."""
    depth_log: list[int] = []

    def scan(f, init, xs=None, length=None, **kwargs):
        depth_log.append(length)
        return jo.next_impl("lax.scan")(f, init, xs, length, **kwargs)

    def body(carry, _):
        inner, _ = jlax.scan(lambda c, _: (c + 1, None), carry, length=2)
        return inner, None

    with jo.override_context({"lax.scan": scan}):
        carry, _ = jlax.scan(body, 0, length=3)
    assert int(carry) == 6
    # The outer scan, then the nested scan traced once inside its body.
    assert depth_log == [3, 2]


def test_override_calling_user_code_eagerly_recurses_through_itself():
    """An override may run user code itself; that code's neutral calls reach it again."""
    seen: list[int] = []

    def unrolling_fori(lower, upper, body, init, *, unroll=None):
        seen.append(upper)
        value = init
        for i in range(lower, upper):
            value = body(i, value)
        return value

    def body(i, x):
        return x + jlax.fori_loop(0, i, lambda j, y: y + 1, 0)

    with jo.override_context({"lax.fori_loop": unrolling_fori}):
        out = jlax.fori_loop(0, 4, body, 0)
    assert out == 0 + 0 + 1 + 2 + 3
    assert seen == [4, 0, 1, 2, 3]


def test_next_impl_reaches_other_names_below():
    log: list[str] = []

    def jit_override(fun, **kwargs):
        log.append("jit")
        return jo.next_impl("jit")(fun, **kwargs)

    with (
        jo.override_context({"lax.scan": tagging_scan("scan", log)}),
        jo.override_context({"jit": jit_override}),
    ):
        assert jo.next_impl.__name__ == "next_impl"
        out = jo.jit(lambda n: count_up(3)[0] + n)(1)
    assert int(out) == 4
    assert log == ["jit", "scan"]


def test_next_impl_outside_an_override_is_an_error():
    with pytest.raises(RuntimeError, match="no override is running"):
        jo.next_impl("lax.scan")


@pytest.mark.parametrize("fail_at", ["enter", "body"])
def test_exceptions_unwind(fail_at):
    log: list[str] = []
    ctx = jo.override_context({"lax.scan": tagging_scan("a", log)})

    def failing_scan(*args, **kwargs):
        raise ZeroDivisionError("inside the override")

    def run():
        with ctx:
            if fail_at == "enter":
                raise ZeroDivisionError
            with jo.override_context({"lax.scan": failing_scan}):
                count_up(1)

    with pytest.raises(ZeroDivisionError):
        run()
    assert _stack.context_snapshot() is _stack.ROOT
    count_up(1)
    assert jo.resolve("lax.scan") is jax.lax.scan


def test_exiting_out_of_order_is_refused_and_changes_nothing():
    a = jo.override_context({"lax.scan": tagging_scan("a", [])}, name="a")
    b = jo.override_context({"lax.map": lambda f, xs, **kw: None}, name="b")
    a.__enter__()
    b.__enter__()
    with pytest.raises(RuntimeError, match="reverse order"):
        a.__exit__(None, None, None)
    assert [layer.label for layer in jo.current_stack().layers] == ["b", "a"]
    b.__exit__(None, None, None)
    a.__exit__(None, None, None)


def test_threads_do_not_share_contexts():
    results: dict[int, list[str]] = {}
    barrier = threading.Barrier(8)

    def worker(index: int) -> None:
        log: list[str] = []
        barrier.wait()
        for depth in range(20):
            ctx = jo.override_context({"lax.scan": tagging_scan(f"{index}.{depth}", log)})
            with ctx:
                count_up(1)
                # Peek at the top of this thread's stack while others churn theirs.
                assert (
                    jo.current_stack().layers[0].overrides["lax.scan"].__qualname__
                    == f"scan[{index}.{depth}]"
                )
        count_up(1)  # nothing active here any more
        results[index] = log

    run_in_threads(worker, 8)
    for index, log in results.items():
        assert log == [f"{index}.{depth}" for depth in range(20)]


def test_threads_nested_contexts_no_cross_talk():
    """8 threads, each nesting several contexts; every resolution sees only its own."""

    def worker(index: int) -> None:
        for _ in range(10):
            log: list[str] = []
            contexts = [
                jo.override_context({"lax.scan": tagging_scan(f"{index}:{level}", log)})
                for level in range(4)
            ]
            for ctx in contexts:
                ctx.__enter__()
            count_up(1)
            for ctx in reversed(contexts):
                ctx.__exit__(None, None, None)
            assert log == [f"{index}:{level}" for level in (3, 2, 1, 0)], log

    run_in_threads(worker, 8)


def test_asyncio_tasks_are_isolated():
    async def task(tag: str, delay: float) -> list[str]:
        log: list[str] = []
        with jo.override_context({"lax.scan": tagging_scan(tag, log)}):
            await asyncio.sleep(delay)
            count_up(1)
            await asyncio.sleep(delay)
            count_up(1)
        count_up(1)
        return log

    async def untouched() -> str | None:
        await asyncio.sleep(0.005)
        return None if jo.resolve("lax.scan") is jax.lax.scan else "leaked"

    async def main():
        return await asyncio.gather(task("a", 0.01), task("b", 0.003), untouched())

    a, b, leak = asyncio.run(main())
    assert a == ["a", "a"]
    assert b == ["b", "b"]
    assert leak is None


def test_task_created_inside_a_context_keeps_it_after_the_creator_leaves():
    """An activation stays alive, and so stays honoured, in a copied context."""
    log: list[str] = []
    jitted = jo.jit(lambda n: count_up(2)[0] + n)

    async def child() -> int:
        await asyncio.sleep(0.01)
        return int(jitted(1))

    async def main():
        with jo.override_context({"lax.scan": tagging_scan("kept", log)}):
            pending = asyncio.create_task(child())
        return await pending

    assert asyncio.run(main()) == 3
    assert log == ["kept"]


class TraceCounter:
    def __init__(self):
        self.traces = 0

    def __call__(self, x):
        self.traces += 1
        return count_up(2)[0] + x


def test_jit_no_retrace_on_cache_hit_and_no_stale_override():
    fn = TraceCounter()
    jitted = jo.jit(fn)
    log: list[str] = []
    ctx = jo.override_context({"lax.scan": tagging_scan("ctx", log)})

    assert int(jitted(1)) == 3 and fn.traces == 1
    assert int(jitted(1)) == 3 and fn.traces == 1
    with ctx:
        assert int(jitted(1)) == 3
        assert fn.traces == 2 and log == ["ctx"]  # the override is seen, not the cached trace
        jitted(1)
        assert fn.traces == 2 and log == ["ctx"]  # cache hit within the context
    assert int(jitted(1)) == 3
    assert fn.traces == 2 and log == ["ctx"]  # back to the first trace, not the context's
    with ctx:
        jitted(1)
    assert fn.traces == 2 and log == ["ctx"]  # an earlier snapshot returns: cache hit again


def test_raw_jax_jit_around_neutral_code_is_not_stale():
    """The active stack is part of jax.jit's cache key, through a jax user context."""
    fn = TraceCounter()
    jitted = jax.jit(fn)
    log: list[str] = []
    jitted(1)
    with jo.override_context({"lax.scan": tagging_scan("raw", log)}):
        jitted(1)
    jitted(1)
    assert fn.traces == 2
    assert log == ["raw"]


def test_equal_contexts_share_caches():
    fn = TraceCounter()
    jitted = jo.jit(fn)
    log: list[str] = []
    scan = tagging_scan("eq", log)
    with jo.override_context({"lax.scan": scan}):
        jitted(1)
    with jo.override_context({"lax.scan": scan}):
        jitted(1)
    assert fn.traces == 1


def test_transform_wrapper_built_before_context_resolves_at_call():
    built: list[str] = []

    def vmap_override(fun, *args, **kwargs):
        built.append("vmap")
        return jo.next_impl("vmap")(fun, *args, **kwargs)

    batched = jo.vmap(lambda x: x * 2)  # built while nothing is active
    ctx = jo.override_context({"vmap": vmap_override})
    with ctx:
        np.testing.assert_array_equal(batched(jnp.arange(3)), [0, 2, 4])
        batched(jnp.arange(3))
    np.testing.assert_array_equal(batched(jnp.arange(3)), [0, 2, 4])
    assert built == ["vmap"]  # built once per snapshot, then cached


def test_wrapper_switches_back_to_plain_target_when_idle():
    jitted = jo.jit(lambda x: x + 1)
    plain = jitted.func
    assert type(plain).__name__ == "PjitFunction"
    with jo.override_context({"lax.map": lambda f, xs, **kw: xs}):
        jitted(1)
        assert jitted.func is not plain
    jitted(1)
    assert jitted.func is plain


def test_install_is_active_only_while_predicate_holds():
    switch = {"on": False}
    log: list[str] = []
    handle = jo.install(
        {"lax.scan": tagging_scan("installed", log)}, when=lambda: switch["on"], name="switchable"
    )
    try:
        count_up(1)
        assert log == []
        assert "installed (inactive)" in repr(jo.current_stack())
        switch["on"] = True
        count_up(1)
        assert log == ["installed"]
        # Contexts sit above installed adapters and delegate down to them.
        with jo.override_context({"lax.scan": tagging_scan("ctx", log)}):
            count_up(1)
        assert log == ["installed", "ctx", "installed"]
    finally:
        assert handle.uninstall() is True
    assert handle.uninstall() is False
    assert not handle.installed
    count_up(1)
    assert log == ["installed", "ctx", "installed"]


def test_install_twice_returns_the_same_installation():
    scan = tagging_scan("x", [])
    first = jo.install({"lax.scan": scan}, name="twice")
    second = jo.install({"lax.scan": scan}, name="twice")
    try:
        assert first._entry is second._entry
        assert len([e for e in _stack.installed if e.layer.label == "twice"]) == 1
    finally:
        first.uninstall()


def test_installed_adapter_changes_raw_jit_key():
    fn = TraceCounter()
    jitted = jax.jit(fn)
    jitted(1)
    log: list[str] = []
    with jo.install({"lax.scan": tagging_scan("i", log)}, name="key"):
        jitted(1)
    jitted(1)
    assert fn.traces == 2 and log == ["i"]


def test_current_stack_repr_is_readable():
    with jo.override_context({"lax.scan": tagging_scan("r", [])}, name="readable"):
        text = repr(jo.current_stack())
        stack = jo.current_stack()
    assert "readable" in text and "lax.scan=" in text and "scan[r]" in text
    assert stack.resolutions()["lax.scan"].endswith("scan[r]")
    assert stack.resolutions()["jit"] == "jax.jit"


def test_context_is_a_mapping_and_composes():
    scan = tagging_scan("m", [])
    ctx = jo.override_context({"lax.scan": scan})
    assert dict(ctx) == {"lax.scan": scan}
    combined = jo.override_context({**ctx, "lax.map": jax.lax.map})
    assert sorted(combined) == ["lax.map", "lax.scan"]
    assert jo.override_context(ctx)["lax.scan"] is scan


def test_context_as_decorator_sync_and_async():
    log: list[str] = []
    ctx = jo.override_context({"lax.scan": tagging_scan("deco", log)})

    @ctx
    def run():
        return count_up(1)

    @ctx
    async def run_async():
        return count_up(1)

    run()
    asyncio.run(run_async())
    assert log == ["deco", "deco"]
    assert run.__name__ == "run"


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "c", "skip"]), min_size=0, max_size=6))
def test_random_override_stacks_resolve_top_down(tags):
    """For any stack, one scan call visits every scan layer top-down, then JAX."""
    log: list[str] = []
    contexts = []
    for tag in tags:
        if tag == "skip":
            contexts.append(jo.override_context({"lax.map": jax.lax.map}))
        else:
            contexts.append(jo.override_context({"lax.scan": tagging_scan(tag, log)}))
    for ctx in contexts:
        ctx.__enter__()
    try:
        carry, _ = count_up(2)
    finally:
        for ctx in reversed(contexts):
            ctx.__exit__(None, None, None)
    assert int(carry) == 2
    assert log == [tag for tag in reversed(tags) if tag != "skip"]


def test_neutral_lax_names_are_the_neutral_functions():
    """Guards the re-exports in jaxoverride.lax against the star import shadowing them."""
    from jaxoverride import _lax

    for name in ("scan", "while_loop", "fori_loop", "cond", "switch", "map"):
        assert getattr(jlax, name) is getattr(_lax, name)
        assert getattr(jlax, name) is not getattr(jax.lax, name)


def test_scoped_install_is_idle_outside_its_scopes():
    log: list[str] = []
    handle = jo.install({"lax.scan": tagging_scan("scoped", log)}, scoped=True, name="sc")
    jitted = jo.jit(lambda n: count_up(2)[0] + n)
    try:
        jitted(0)
        assert _stack.idle  # installed, but no scope entered: JAX's own speed
        assert type(jitted.func).__name__ == "PjitFunction"
        assert log == []
        with handle.scope():
            assert int(jitted(1)) == 3
            with jo.override_context({"lax.scan": tagging_scan("ctx", log)}), handle.scope():
                count_up(1)  # re-entering the scope adds no second copy beneath ctx
            text = repr(jo.current_stack())
        assert log == ["scoped", "ctx", "scoped"]
        assert "installed, scope" in text
        count_up(1)
        assert log == ["scoped", "ctx", "scoped"]
        with pytest.raises(TypeError, match="not both"):
            jo.install({"lax.scan": jax.lax.scan}, scoped=True, when=lambda: True)
    finally:
        handle.uninstall()
    guarded = jo.install({"lax.scan": jax.lax.scan}, name="guarded")
    try:
        with pytest.raises(TypeError, match="scoped=True"):
            guarded.scope()
    finally:
        guarded.uninstall()


def test_version_is_the_installed_distributions():
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("jaxoverride")
    except PackageNotFoundError:  # a source tree on PYTHONPATH that was never installed
        installed = "0+unknown"
    assert jo.__version__ == installed
