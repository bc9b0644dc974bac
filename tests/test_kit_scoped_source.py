"""A source that gives ``run`` itself, and ``ScopedStateSource``'s ``reuse_key``: the state
is installed as a scope, and a loop or branch called again with the same function is
neither traced nor compiled again, as JAX's own loop; without ``reuse_key`` it is traced
on every call, as before. A source that is not a ``StateSource`` is refused by name."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxoverride import adapter_kit as kit

_COMPILES: list[str] = []


def _listener(event: str, duration_secs: float, **kwargs: object) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES.append(event)


jax.monitoring.register_event_duration_secs_listener(_listener)


class Scoped(kit.ScopedStateSource):
    """A dict of arrays, installed for the extent of each traced call only."""

    def __init__(self, store: dict[str, Any]):
        self.store = store
        self.scopes = 0

    def read(self) -> Any:
        return dict(self.store)

    def run(self, state: Any, fun: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
        self.scopes += 1
        saved = dict(self.store)
        self.store.update(state)
        try:
            return fun(*args), dict(self.store)
        finally:
            self.store.clear()
            self.store.update(saved)

    def write(self, state: Any) -> None:
        self.store.update(state)


class Uncached(Scoped):
    def reuse_key(self) -> Any:
        return None


def _calls(store: dict[str, Any], traces: list[int]) -> dict[str, Callable[[Any], Any]]:
    def scan_body(c: Any, x: Any) -> Any:
        traces.append(1)
        store["n"] = store["n"] + 1
        return c + x, None

    def fori_body(i: Any, c: Any) -> Any:
        traces.append(1)
        store["n"] = store["n"] + 1
        return c + i

    def branch(c: Any) -> Any:
        traces.append(1)
        store["n"] = store["n"] + 1
        return c * 2

    def other(c: Any) -> Any:
        return c

    return {
        "scan": lambda s: kit.threaded_scan(s, jax.lax.scan, scan_body, 0.0, jnp.ones(3))[0],
        "fori": lambda s: kit.threaded_fori_loop(s, jax.lax.fori_loop, 0, 3, fori_body, 0),
        "cond": lambda s: kit.threaded_cond(s, jax.lax.cond, True, branch, other, 1.0),
        "switch": lambda s: kit.threaded_switch(s, jax.lax.switch, 0, [branch, other], 1.0),
    }


@pytest.mark.parametrize("name", ["scan", "fori", "cond", "switch"])
def test_cached_bodies_trace_and_compile_once(name: str) -> None:
    store = {"n": jnp.int32(0)}
    traces: list[int] = []
    call = _calls(store, traces)[name]
    with jax.checking_leaks():  # which also turns JAX's caches off: compiles counted below
        call(Scoped(store))
    first = call(Scoped(store))
    after_first, compiled = len(traces), len(_COMPILES)
    source = Scoped(store)
    second = call(source)
    assert float(first) == float(second)
    steps = 3 if name in ("scan", "fori") else 1
    assert int(store["n"]) == 3 * steps
    assert after_first >= 1
    assert len(traces) == after_first, "a cached body was traced again"
    assert len(_COMPILES) == compiled, "a cached body was compiled again"
    assert source.scopes == 0  # the second call ran no Python of the body


@pytest.mark.parametrize("name", ["scan", "fori", "cond", "switch"])
def test_without_reuse_key_every_call_traces(name: str) -> None:
    store = {"n": jnp.int32(0)}
    traces: list[int] = []
    call = _calls(store, traces)[name]
    with jax.checking_leaks():
        call(Uncached(store))
        after_first = len(traces)
        source = Uncached(store)
        call(source)
    assert len(traces) == 2 * after_first
    assert source.scopes >= 1


def test_a_cached_body_keeps_nothing_alive() -> None:
    import weakref

    store = {"n": jnp.int32(0)}

    def body(c: Any, x: Any) -> Any:
        store["n"] = store["n"] + 1
        return c + x, None

    kit.threaded_scan(Scoped(store), jax.lax.scan, body, 0.0, jnp.ones(2))
    ref = weakref.ref(body)
    del body
    gc.collect()
    assert ref() is None
    assert int(store["n"]) == 2


class Duck:
    """The methods of a source, without the contract's class: its defaults are missing."""

    def __init__(self, store: dict[str, Any]):
        self.store = store

    def read(self) -> Any:
        return dict(self.store)

    def run(self, state: Any, fun: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
        return fun(*args), state

    def write(self, state: Any) -> None:
        self.store.update(state)

    def initializing(self) -> bool:
        return False


@pytest.mark.parametrize("name", ["scan", "fori", "cond", "switch"])
def test_a_source_that_is_not_a_state_source_is_refused_by_name(name: str) -> None:
    store = {"n": jnp.int32(0)}
    with pytest.raises(TypeError, match=r"is not a jaxoverride\.adapter_kit\.StateSource"):
        _calls(store, [])[name](Duck(store))
    with pytest.raises(TypeError, match="subclass StateSource"):
        kit.threaded_call(Duck(store), lambda: None, "jit")  # type: ignore[arg-type]
    assert int(store["n"]) == 0
    assert isinstance(Scoped({}), kit.StateSource)


@pytest.mark.parametrize("name", ["scan", "fori", "cond", "switch"])
def test_a_reused_wrapper_writes_through_the_current_source(name: str) -> None:
    """The reused ``Threaded`` is bound to each call's source: a source made per call
    (NNX's) gets the JAX call's result, not the source of the call that traced."""
    store = {"n": jnp.int32(0)}
    call = _calls(store, [])[name]
    first = Scoped(store)
    call(first)
    writes: list[Any] = []

    class Recording(Scoped):
        def reuse_key(self) -> Any:
            return Scoped  # the wrappers of ``first``'s call

        def write(self, state: Any) -> None:
            writes.append(state)
            super().write(state)

    second = Recording(store)
    call(second)
    assert second.scopes == 0  # reused: not traced again
    assert len(writes) == 1
    steps = 3 if name in ("scan", "fori") else 1
    assert int(writes[0]["n"]) == 2 * steps


@pytest.mark.parametrize("name", ["cond", "switch"])
def test_a_reused_branch_beside_a_fresh_one_is_not_traced_again(name: str) -> None:
    """As JAX caches each branch's trace on its own: a fresh ``lambda`` as the other
    branch (a new one on every call) does not make the reused branch traced again."""
    store = {"n": jnp.int32(0)}
    traces: list[int] = []

    def branch(c: Any) -> Any:
        traces.append(1)
        store["n"] = store["n"] + 1
        return c * 2

    def call() -> Any:
        source = Scoped(store)
        if name == "cond":
            return kit.threaded_cond(source, jax.lax.cond, True, branch, lambda c: c, 1.0)
        return kit.threaded_switch(source, jax.lax.switch, 0, [branch, lambda c: c], 1.0)

    outs = [float(call()) for _ in range(3)]
    assert outs == [2.0, 2.0, 2.0]
    assert len(traces) == 1
    assert int(store["n"]) == 3


class Holding(Scoped):
    """Holds the values it read, as NNX's source does (an enclosing trace's tracers)."""

    def __init__(self, store: dict[str, Any]):
        super().__init__(store)
        self.held = dict(store)

    def reuse_key(self) -> Any:
        return Scoped


@pytest.mark.parametrize("name", ["scan", "fori", "cond", "switch"])
def test_reused_wrappers_keep_no_source_past_the_call(name: str) -> None:
    """A source holding an enclosing trace's values (NNX's under ``jit``) is bound to
    the reused wrappers only for its call: the cache keeps no tracer alive."""
    store = {"n": jnp.int32(0)}
    call = _calls(store, [])[name]

    def traced(n: Any) -> Any:
        store["n"] = n
        try:
            call(Holding(store))
            return store["n"]
        finally:
            store["n"] = np.int32(0)  # not jnp: under a trace that would be a tracer

    call(Scoped(store))  # the wrappers are cached before the traced calls
    store["n"] = jnp.int32(0)
    with jax.checking_leaks():
        counts = [int(jax.jit(traced)(jnp.int32(0))) for _ in range(2)]
    steps = 3 if name in ("scan", "fori") else 1
    assert counts == [steps, steps]
