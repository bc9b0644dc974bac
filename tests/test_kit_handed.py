"""The kit's optional source hooks: ``reuse_key``, ``init_call``, ``abort_changed_predicate``,
``carried_predicate``, and ``threaded_map``'s reused scan bodies."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import pytest

from jaxoverride import adapter_kit as kit

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class Reusing(kit.DictStateSource):
    """A dict source whose wrappers JAX may reuse across calls."""

    def reuse_key(self) -> Hashable:
        return ("reusing", tuple(sorted(self.store)))


class Aborting(kit.DictStateSource):
    abort_changed_predicate = True


class Carrying(Reusing):
    carried_predicate = True


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


def _carried_loop(n: Any, x: Any, python_runs: list[str] | None = None) -> tuple[Any, Any]:
    """A ``while_loop`` whose ``cond_fun`` and ``body_fun`` both count in the state."""
    store = {"n": n}

    def cond(x: Any) -> Any:
        if python_runs is not None:
            python_runs.append("cond")
        store["n"] = store["n"] + 1
        return x.sum() < 10.0

    def body(x: Any) -> Any:
        if python_runs is not None:
            python_runs.append("body")
        store["n"] = store["n"] + 1
        return x * 2.0 + store["n"]

    out = kit.threaded_while_loop(Carrying(store), jax.lax.while_loop, cond, body, x)
    return out, store["n"]


def _hand_written_loop(n: Any, x: Any) -> tuple[Any, Any]:
    """``_carried_loop`` in raw JAX: test, then (body, test) per step, the predicate carried."""

    def cond(x: Any, n: Any) -> Any:
        n = n + 1
        return x.sum() < 10.0, n

    def body(x: Any, n: Any) -> Any:
        n = n + 1
        return x * 2.0 + n, n

    def step(carry: Any) -> Any:
        x, n, _ = carry
        x, n = body(x, n)
        going, n = cond(x, n)
        return x, n, going

    going, n = cond(x, n)
    x, n, _ = jax.lax.while_loop(lambda carry: carry[2], step, (x, n, going))
    return x, n


def test_carried_predicate_is_the_hand_written_loop() -> None:
    args = (jnp.int32(0), jnp.ones(3))
    ours = jax.make_jaxpr(_carried_loop)(*args)
    assert str(ours) == str(jax.make_jaxpr(_hand_written_loop)(*args))
    # As Python runs it: the test once before the loop and once after each step.
    n, x = args
    out, count = _carried_loop(n, x)
    ref_x, ref_n = x, int(n)
    while True:
        ref_n += 1
        if not ref_x.sum() < 10.0:
            break
        ref_n += 1
        ref_x = ref_x * 2.0 + ref_n
    assert (out.tolist(), int(count)) == (ref_x.tolist(), ref_n)


def test_carried_predicate_runs_no_python_again_on_an_identical_eager_call() -> None:
    python_runs: list[str] = []
    store = {"n": jnp.int32(0)}

    def cond(x: Any) -> Any:
        python_runs.append("cond")
        store["n"] = store["n"] + 1
        return x.sum() < 10.0

    def body(x: Any) -> Any:
        python_runs.append("body")
        return x * 2.0

    loop = lambda: kit.threaded_while_loop(
        Carrying(store), jax.lax.while_loop, cond, body, jnp.ones(3)
    )
    with jax.checking_leaks():
        assert loop().tolist() == [4.0, 4.0, 4.0]
    runs, tests = len(python_runs), int(store["n"])
    assert runs > 0 and tests == 3  # before the loop, and after each of its two steps
    loop()  # the state is now the loop's output (as every later call sees it)
    assert _count_compiles(loop) == 0
    assert len(python_runs) == runs  # neither the first test nor the loop ran Python
    assert int(store["n"]) == 3 * tests  # ... yet the tests' writes still come out


def test_carried_predicate_is_carried_as_cond_fun_returns_it() -> None:
    # Not cast to bool: a non-boolean predicate gets JAX's own error, as for raw JAX.
    store = {"n": jnp.int32(0)}
    with pytest.raises(TypeError, match="boolean scalar"):
        kit.threaded_while_loop(
            Carrying(store), jax.lax.while_loop, lambda x: jnp.int32(0), lambda x: x, 1.0
        )
    with pytest.raises(TypeError, match="boolean scalar"):
        jax.lax.while_loop(lambda x: jnp.int32(0), lambda x: x, 1.0)


def test_threaded_map_hands_scan_the_same_body_on_every_call() -> None:
    store = {"n": jnp.int32(0)}
    traces: list[None] = []

    def f(x: Any) -> Any:
        traces.append(None)
        store["n"] = store["n"] + 1
        return x * 2.0

    def scan(*args: Any, **kwargs: Any) -> Any:
        return kit.threaded_scan(Reusing(store), jax.lax.scan, *args, **kwargs)

    xs = jnp.arange(5.0)
    for batch_size in (None, 2):
        mapped = lambda b=batch_size: kit.threaded_map(scan, jax.vmap, f, xs, batch_size=b)
        expected = jax.lax.map(lambda x: x * 2.0, xs, batch_size=batch_size)
        assert mapped().tolist() == expected.tolist()
        traced = len(traces)
        assert _count_compiles(mapped) == 0  # an identical call compiles once in all
        if batch_size is None:
            assert len(traces) == traced  # and the scan body is not traced again
    assert int(store["n"]) == 2 * 5 + 2 * 3  # per element, then per batch (2, 2, rest 1)
