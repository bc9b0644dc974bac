"""The kit's optional ``run_scoped`` and ``body_key`` hooks (``ScopedStateSource``): the
state is installed as a scope, and a loop or branch called again with the same function
is neither traced nor compiled again, as JAX's own loop; without ``body_key`` it is
traced on every call, as before."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest

from jaxoverride import adapter_kit as kit

_COMPILES: list[str] = []


def _listener(event: str, duration: float, **kwargs: object) -> None:
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

    def run_scoped(self, state: Any, fun: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
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
    def body_key(self) -> Any:
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
def test_without_body_key_every_call_traces(name: str) -> None:
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


def test_enter_is_refused_on_a_scoped_source() -> None:
    with pytest.raises(TypeError, match="run_scoped"):
        Scoped({}).enter({})
    assert isinstance(Scoped({}), kit.StateSource)
