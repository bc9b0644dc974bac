"""The kit's optional source hooks: ``reuse_key``, ``init_call``, ``abort_changed_predicate``."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp

from jaxoverride import adapter_kit as kit

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class Reusing(kit.DictStateSource):
    """A dict source whose wrappers JAX may reuse across calls."""

    def reuse_key(self) -> Hashable:
        return ("reusing", tuple(sorted(self.store)))


class Aborting(kit.DictStateSource):
    abort_changed_predicate = True


def _count_compiles(run: Callable[[], Any]) -> int:
    compiles: list[str] = []

    def listen(event: str, duration: float, **kwargs: Any) -> None:
        if event == _COMPILE_EVENT:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        run()
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return len(compiles)


def _count_body(store: dict[str, Any]) -> Callable[[Any, Any], Any]:
    def body(i: Any, x: Any) -> Any:
        store["n"] = store["n"] + i
        return x + 1.0

    return body


def test_a_source_with_a_reuse_key_compiles_an_identical_eager_loop_once() -> None:
    store = {"n": jnp.int32(0)}
    body = _count_body(store)
    loop = lambda: kit.threaded_fori_loop(Reusing(store), jax.lax.fori_loop, 0, 3, body, 0.0)
    with jax.checking_leaks():
        assert float(loop()) == 3.0
    loop()  # the state is now the loop's output (as every later call sees it)
    assert _count_compiles(loop) == 0  # an identical call: JAX's caches hit
    assert int(store["n"]) == 9


def test_a_state_changing_predicate_runs_as_python_would_with_and_without_abort() -> None:
    for source_type in (kit.DictStateSource, Aborting):
        store = {"calls": jnp.int32(0)}

        def cond(x: Any, store: dict[str, Any] = store) -> Any:
            store["calls"] = store["calls"] + 1  # a write in cond_fun
            return x < 4

        out = kit.threaded_while_loop(
            source_type(store), jax.lax.while_loop, cond, lambda x: x + 1, 0
        )
        assert (int(out), int(store["calls"])) == (4, 5), source_type


def test_init_call_replaces_the_creation_pass() -> None:
    log: list[str] = []

    class OwnInit(kit.DictStateSource):
        def initializing(self) -> bool:
            return True

        def init_call(self, call: Callable[[], Any], two_pass: Callable[[], Any]) -> Any:
            log.append("init_call")
            return call()

        def create(self, thunk: Callable[[], Any]) -> None:
            log.append("create")
            thunk()

    store = {"n": jnp.int32(0)}
    out = kit.threaded_fori_loop(OwnInit(store), jax.lax.fori_loop, 0, 2, _count_body(store), 0.0)
    assert (float(out), log) == (2.0, ["init_call"])


def test_two_threads_in_one_situation_each_thread_through_their_own_source() -> None:
    # A reused wrapper is bound to its call's source while the call runs: two threads
    # tracing the same body at once, in an equal situation, must not share that binding.
    import threading

    stores: dict[int, dict[str, Any]] = {}
    both_tracing = threading.Barrier(2, timeout=30)

    def body(i: Any, x: Any) -> Any:
        store = stores[threading.get_ident()]
        both_tracing.wait()
        store["n"] = store["n"] + i
        return x + 1.0

    results: dict[str, Any] = {}

    def run(name: str, start: int) -> None:
        store = {"n": jnp.int32(start)}
        stores[threading.get_ident()] = store
        try:
            out = kit.threaded_fori_loop(Reusing(store), jax.lax.fori_loop, 0, 3, body, 0.0)
            results[name] = (float(out), int(store["n"]))
        except Exception as error:  # reported below, with the thread's name
            results[name] = error

    threads = [
        threading.Thread(target=run, args=(name, start)) for name, start in [("a", 0), ("b", 100)]
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == {"a": (3.0, 3), "b": (3.0, 103)}
