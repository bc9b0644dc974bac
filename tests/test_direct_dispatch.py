"""A neutral transform calls an override's direct call (``jit_api``'s ``direct``) once built
in a stack, skipping the core's dispatch frame, and goes back to dispatching whenever that
could be wrong: another stack in the thread, another thread, a guarded adapter installed,
the process idle, the build dropped. Calls are counted (frames and the override's own
tallies), never timed."""

from __future__ import annotations

import collections
import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxoverride as jo
import jaxoverride_dag as dag
from jaxoverride import _neutral, _stack

TALLY: collections.Counter[str] = collections.Counter()
_COMPILES: list[str] = []


def _listener(event: str, duration: float, **kwargs: object) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES.append(event)


jax.monitoring.register_event_duration_secs_listener(_listener)


def counting_jit(fun: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    """A ``"jit"`` override that tallies how each call reached it."""
    inner = jo.next_impl("jit")(fun, **options)

    def make(direct_to: tuple[Any, Any, Any] | None) -> Callable[..., Any]:
        current, stack, fallback = direct_to or (None, None, None)

        def call(*args: Any, **kwargs: Any) -> Any:
            if current is not None and current() is not stack:
                TALLY["fallback"] += 1
                return fallback(*args, **kwargs)
            TALLY["dispatched" if current is None else "direct"] += 1
            return inner(*args, **kwargs)

        return call

    def stage(method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return getattr(inner, method)(*args, **kwargs)

    return jo.jit_api(
        make(None),
        fun,
        stage=stage,
        jitted=lambda: [inner],
        direct=lambda current, stack, fallback: make((current, stack, fallback)),
    )


COUNTING = jo.override_context({"jit": counting_jit}, name="counting")
OTHER = jo.override_context({"lax.map": jax.lax.map}, name="other")


@pytest.fixture(autouse=True)
def _fresh_tally() -> Iterator[None]:
    TALLY.clear()
    yield
    assert _stack.context_snapshot() is _stack.ROOT


@contextlib.contextmanager
def frames(*names: str) -> Iterator[collections.Counter[str]]:
    """Counts the Python frames of these names entered in this thread meanwhile; a name
    ``"path/file.py::function"`` counts only that file's functions of that name."""
    counts: collections.Counter[str] = collections.Counter()
    wanted = [(name, *name.rpartition("::")[::2]) for name in names]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            for name, where, function in wanted:
                if code.co_name == function and code.co_filename.endswith(where):
                    counts[name] += 1

    sys.setprofile(profile)
    try:
        yield counts
    finally:
        sys.setprofile(None)


def state_of(wrapper: Any) -> _neutral._TransformState:
    return wrapper.__dict__["_jaxoverride_state"]


def test_the_direct_call_is_taken_and_skips_the_core_frame():
    double = jo.jit(lambda x: 2 * x)
    x = jnp.arange(3.0)
    before = len(_COMPILES)
    with COUNTING:
        first = double(x)
        assert TALLY == {"dispatched": 1}
        assert state_of(double).direct is _stack.context_snapshot()
        with frames("slow_call", "call") as counts:
            outs = [double(x) for _ in range(5)]
    assert counts == {"call": 5}  # the override's frame only: no core dispatch frame
    assert TALLY == {"dispatched": 1, "direct": 5}
    assert len(_COMPILES) - before == 1
    for out in [first, *outs]:
        assert out.tolist() == [0.0, 2.0, 4.0]


def test_the_wrapper_api_is_unchanged_while_direct():
    def double(x):
        return 2 * x

    jitted = jo.jit(double)
    x = jnp.arange(3.0)
    with COUNTING:
        jitted(x)
        state = state_of(jitted)
        assert state.direct is not None
        assert jitted.func.__wrapped__ is state.plain  # JAX names the user's function
        assert jitted.__wrapped__ is double
        assert jitted.__name__ == "double"
        assert "module" in jitted.lower(x).as_text()
        assert jitted.trace(x).jaxpr.eqns
        assert jitted.eval_shape(x).shape == (3,)
        assert jitted._cache_size() == 1
        jitted.clear_cache()
        assert jitted._cache_size() == 0
        assert jitted(x).tolist() == [0.0, 2.0, 4.0]
        assert TALLY["direct"] == 1


def test_a_second_context_dispatches_and_the_first_stays_right():
    double = jo.jit(lambda x: 2 * x)
    x = jnp.ones(2)
    with COUNTING:
        double(x)
        outer = state_of(double).direct
        with OTHER:  # another stack: the direct call's check fails over to dispatch
            assert double(x).tolist() == [2.0, 2.0]
            assert TALLY["fallback"] == 1
            inner = _stack.context_snapshot()
            assert state_of(double).direct is inner  # built anew there, and direct for it
            double(x)
        assert TALLY == {"dispatched": 2, "fallback": 1, "direct": 1}
        TALLY.clear()
        assert double(x).tolist() == [2.0, 2.0]  # back outside: the outer build runs
        assert TALLY == {"fallback": 1, "dispatched": 1}
        assert set(state_of(double).builds) == {outer, inner}


def test_installing_a_guard_resets_the_direct_target_and_uninstalling_restores_it():
    double = jo.jit(lambda x: 2 * x)
    x = jnp.ones(2)
    maps: list[int] = []

    def map_below(f: Any, xs: Any, **kwargs: Any) -> Any:
        maps.append(1)
        return jo.next_impl("lax.map")(f, xs, **kwargs)

    with COUNTING:
        double(x)
        assert state_of(double).direct is not None
        handle = jo.install({"lax.map": map_below}, when=lambda: True, name="guard")
        try:
            assert state_of(double).direct is None  # switched back by the installation
            TALLY.clear()
            with frames("slow_call") as counts:
                assert double(x).tolist() == [2.0, 2.0]
                double(x)
            assert counts == {"slow_call": 2}
            # The guard's layer is under the context: a new stack, dispatched every call.
            assert TALLY == {"dispatched": 2}
            assert state_of(double).direct is None
            assert jo.lax.map(jnp.sin, jnp.ones(1)).shape == (1,) and maps == [1]
        finally:
            handle.uninstall()
        TALLY.clear()
        double(x)  # no guard left: the slow target makes the direct call the target again
        assert state_of(double).direct is _stack.context_snapshot()
        double(x)
        assert TALLY == {"dispatched": 1, "direct": 1}


def test_exit_goes_idle_and_back_to_jax_itself():
    double = jo.jit(lambda x: 2 * x)
    x = jnp.ones(2)
    with COUNTING:
        double(x)
        assert state_of(double).direct is not None
    assert _stack.idle
    assert double(x).tolist() == [2.0, 2.0]  # the direct call fails over: JAX's own target
    assert double.func is state_of(double).plain
    assert state_of(double).direct is None
    assert double not in _stack._direct
    assert TALLY == {"dispatched": 1, "fallback": 1}
    with COUNTING:  # entering again: the existing build becomes the target again
        double(x)
        double(x)
        assert TALLY == {"dispatched": 2, "fallback": 1, "direct": 1}


def test_another_thread_at_the_root_runs_jax_not_the_direct_call():
    double = jo.jit(lambda x: 2 * x)
    x = jnp.ones(2)
    seen: list[Any] = []
    with COUNTING:
        double(x)
        assert state_of(double).direct is not None
        thread = threading.Thread(target=lambda: seen.append(double(x).tolist()))
        thread.start()
        thread.join()
        assert seen == [[2.0, 2.0]]
        assert TALLY == {"dispatched": 1, "fallback": 1}  # no override ran for the thread
        assert state_of(double).direct is not None  # and the thread left this one direct


def test_a_dropped_build_is_no_longer_the_target(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(_neutral, "BUILD_LIMIT", 2)
    double = jo.jit(lambda x: 2 * x)
    x = jnp.ones(2)
    layers = [jo.override_context({"lax.map": jax.lax.map}, name=f"layer{i}") for i in range(3)]
    with COUNTING:
        double(x)
        first = _stack.context_snapshot()
        assert state_of(double).direct is first
        for layer in layers:  # each a new stack: builds, and drops the oldest
            with layer:
                double.lower(x)  # builds without calling
        assert first not in state_of(double).builds
        assert state_of(double).direct is None
        assert first not in state_of(double).directs
        TALLY.clear()
        assert double(x).tolist() == [2.0, 2.0]
        assert TALLY == {"dispatched": 1}
        assert state_of(double).direct is first


def test_an_override_without_a_direct_call_keeps_dispatching():
    def plain_jit(fun: Callable[..., Any], **options: Any) -> Callable[..., Any]:
        inner = jo.next_impl("jit")(fun, **options)
        TALLY["built"] += 1
        return inner

    double = jo.jit(lambda x: 2 * x)
    with jo.override_context({"jit": plain_jit}):
        with frames("slow_call") as counts:
            double(jnp.ones(2))
            double(jnp.ones(2))
        assert counts == {"slow_call": 2}
        assert state_of(double).direct is None and not state_of(double).directs


def test_the_debug_layer_over_dag_is_not_skipped():
    import jaxoverride_debug as jd

    double = jo.jit(lambda x: 2 * x)
    with dag.context(), jd.trace(log=lambda call: None) as trace:
        double(jnp.ones(2))
        double(jnp.ones(2))
    assert state_of(double).direct is None
    assert [c.kind for c in trace.calls].count("run") == 2


DAG_HOT_PATH = "jaxoverride_dag/_jit.py::jitted"


def test_dag_jit_goes_direct_keeps_identity_and_compiles_once():
    pair = jo.jit(lambda p: (p["a"], p["b"]))
    one = jo.jit(lambda x: x * 2.0)
    w, v = jnp.ones(3), jnp.zeros(3)
    with dag.context():
        a, b = pair({"a": w, "b": w})
        assert a is b
        pair({"a": w, "b": v})
        one(w)
        assert state_of(one).direct is _stack.context_snapshot()
        before = len(_COMPILES)
        with frames("slow_call", DAG_HOT_PATH) as counts:
            for _ in range(3):
                assert one(w).tolist() == [2.0, 2.0, 2.0]
                a, b = pair({"a": w, "b": w})  # a shared leaf: the hot path's fallback
                assert a is b
                c, d = pair({"a": w, "b": v})
                assert c is not d
        assert len(_COMPILES) == before  # cache hits only
        assert counts["slow_call"] == 0
        assert counts[DAG_HOT_PATH] == 9  # each call entered the DAG's direct frame
        with OTHER:  # dag is still the top "jit" here, in another stack
            assert one(w).tolist() == [2.0, 2.0, 2.0]
    assert one(w).tolist() == [2.0, 2.0, 2.0]
    assert one.func is state_of(one).plain


def test_dag_jit_with_static_arguments_goes_direct():
    scale = jo.jit(lambda x, k: x * k, static_argnums=1)
    with dag.context():
        scale(jnp.ones(2), 3)
        assert state_of(scale).direct is not None
        with frames("slow_call") as counts:
            assert scale(jnp.ones(2), 3).tolist() == [3.0, 3.0]
            assert scale(jnp.ones(2), 4).tolist() == [4.0, 4.0]
        assert counts == {}


def test_a_wrapper_that_copies_or_forwards_attributes_is_not_skipped():
    import functools

    def wrapping_jit(fun: Callable[..., Any], **options: Any) -> Callable[..., Any]:
        inner = jo.next_impl("jit")(fun, **options)  # the counting override's, with direct

        @functools.wraps(inner)  # copies its __dict__, the direct call's holder included
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            TALLY["wrapper"] += 1
            return inner(*args, **kwargs)

        return wrapper

    double = jo.jit(lambda x: 2 * x)
    with COUNTING, jo.override_context({"jit": wrapping_jit}):
        double(jnp.ones(2))
        double(jnp.ones(2))
    assert state_of(double).direct is None
    assert TALLY == {"wrapper": 2, "dispatched": 2}


def test_a_wrapper_under_the_missing_adapter_check_never_goes_direct():
    from flax import nnx

    from jaxoverride.errors import MissingAdapterError

    layer = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    apply = jo.jit(lambda x: layer(x))
    assert state_of(apply).check is not None
    with dag.context():
        for _ in range(2):  # the dag build offers a direct call: the check keeps its frame
            with pytest.raises(MissingAdapterError, match="bake their current weights"):
                apply(jnp.ones(2))
    assert state_of(apply).direct is None and not state_of(apply).directs


def _nnx_counter() -> Any:
    from flax import nnx

    class Counter(nnx.Module):
        def __init__(self, seed: int) -> None:
            self.linear = nnx.Linear(2, 2, rngs=nnx.Rngs(seed))
            self.calls = nnx.Variable(jnp.array(0))

        def __call__(self, x: jax.Array) -> jax.Array:
            self.calls[...] += 1
            return self.linear(x)

    return Counter


@contextlib.contextmanager
def _served_directly_under_track(first: Any) -> Iterator[tuple[Any, Callable[[Any], None], Any]]:
    """``jit_over_a_cell(first)`` called three times under ``track(first)``, after which the
    NNX adapter's direct call serves it; yields the jit, the cell's rebind and the input,
    inside that ``track``."""
    import jaxoverride_nnx
    from _nnx_models import jit_over_a_cell

    apply, rebind = jit_over_a_cell(first)
    x = jnp.ones(2)
    with jaxoverride_nnx.track(first):
        for _ in range(3):
            apply(x)
        yield apply, rebind, x


def test_nnx_track_goes_direct_under_the_check_and_every_refusal_still_fires():
    """Under ``track`` a checked ``jo.jit`` of a one-cell closure is served by the NNX
    adapter's direct call (no check frame); a rebound cell, a structural change and a
    tracked set without the module (same stack) each go back through the check, which
    refuses what it refused before, and the right module serves again after."""
    import jaxoverride_nnx
    from jaxoverride.errors import MissingAdapterError

    counter = _nnx_counter()
    first, second, other = counter(0), counter(1), counter(2)
    with _served_directly_under_track(first) as (apply, rebind, x):
        assert state_of(apply).check is not None and state_of(apply).direct is not None
        direct = apply.func
        rebind(second)  # not tracked
        with pytest.raises(MissingAdapterError, match="track it too"):
            apply(x)
        rebind(first)
        np.testing.assert_allclose(apply(x), first(x), rtol=1e-6)
        apply(x)
        assert apply.func is direct  # still direct: the misses went through the check
        first.linear = counter(3).linear  # ``first`` changes structure: walked again
        apply(x)
    with jaxoverride_nnx.track(other):  # the same stack, a tracked set without ``first``
        assert apply.func is direct
        # the new tracked set traces anew: the adapter's own, more precise error first
        with pytest.raises(jaxoverride_nnx.UntrackedModuleError, match="not tracked"):
            apply(x)
    with jaxoverride_nnx.track(first):
        np.testing.assert_allclose(apply(x), counter(3).linear(x), rtol=1e-6)
    # As without the direct call: each call ran once but the one refused while tracing;
    # the refused cache hit with ``second`` ran (and wrote) the trace made with ``first``,
    # and ``first(x)`` itself counts.
    assert int(first.calls[...]) == 3 + 1 + 2 + 1 + 1 + 1
    assert int(second.calls[...]) == 0 and int(other.calls[...]) == 0


def test_a_checked_direct_call_with_the_check_off_runs_as_the_check_off_does():
    counter = _nnx_counter()
    first, second = counter(0), counter(1)
    with _served_directly_under_track(first) as (apply, rebind, x):
        previous = jo.set_adapter_check(False)
        try:
            rebind(second)  # the program means it: run as without the check
            apply(x)
            rebind(first)
            apply(x)
        finally:
            jo.set_adapter_check(previous)
        apply(x)
    # as with the check off and no direct call: the call with ``second`` ran the trace
    # made with ``first`` (what the check is there to refuse), nothing was refused
    assert int(first.calls[...]) == 6 and int(second.calls[...]) == 0
