"""The missing-adapter check's shallow lookup of captured NNX state.

``captured_state`` runs at every call of a neutral transform built over captured NNX
state. For a function none of whose direct values is searched further it reads them
without the full search: the result must be the full search's, in its order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _nnx_models import jit_over_a_cell
from jaxoverride import _detect

# The private lookups below read the loaded framework records; a neutral call loads them
# (`watching`) before it looks. Without this the file passed only after another test had.
_detect.frameworks()

MODEL = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
OTHER = nnx.Linear(2, 2, rngs=nnx.Rngs(1))
COUNTER = nnx.Variable(jnp.array(0))


def _full(fun: Any) -> list[tuple[str, Any]]:
    return [(n, v) for n, v in _detect._values_of(fun) if _detect.is_state(v)]


def _cases() -> dict[str, Any]:
    cell = OTHER

    def with_default(x, m=MODEL):
        return m(x)

    def nested(x):
        return (lambda y: MODEL(y) + cell(y))(x)

    listed = [MODEL, OTHER]
    return {
        "global": lambda x: MODEL(x),
        "cell and global": lambda x: MODEL(x) + cell(x) + COUNTER[...],
        "twice the same": lambda x: MODEL(x) + MODEL(x),
        "default": with_default,
        "nested code": nested,
        "a list (full search)": lambda x: listed[0](x),
        "nothing": lambda x: x,
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_the_shallow_lookup_finds_what_the_full_search_finds(name):
    fun = _cases()[name]
    got = _detect.captured_state(fun)
    assert [(n, id(v)) for n, v in got] == [(n, id(v)) for n, v in _full(fun)]


def test_a_rebound_global_is_seen_at_the_next_call():
    namespace: dict[str, Any] = {"model": MODEL}
    fun = eval("lambda x: model(x)", namespace)
    assert [v for _, v in _detect.captured_state(fun)] == [MODEL]
    namespace["model"] = OTHER
    assert [v for _, v in _detect.captured_state(fun)] == [OTHER]
    del namespace["model"]
    assert _detect.captured_state(fun) == []


# -- the per-wrapper memo of TransformCheck: a call under track reuses the last answer only
# while every object the lookup reads is the same one --------------------------------------


def _check_of(fun: Any) -> _detect.TransformCheck:
    check = _detect.TransformCheck("jit", fun)
    assert [v for _, v in check.captured()] == [v for _, v in _detect.captured_state(fun)]
    return check


def test_the_memo_answers_as_the_lookup_does_for_every_shape():
    for fun in _cases().values():
        check = _check_of(fun)
        for _ in range(2):
            got = check.captured()
            assert [(n, id(v)) for n, v in got] == [(n, id(v)) for n, v in _full(fun)]


def test_the_memo_sees_a_rebound_cell_a_global_and_a_default():
    namespace: dict[str, Any] = {"glob": MODEL, "COUNTER": COUNTER}
    fun = eval("lambda x, d=COUNTER: glob(x) + d[...]", namespace)
    cell = OTHER

    def closure(x):
        return cell(x)

    for function, rebind in [
        (closure, lambda: None),
        (fun, lambda: namespace.__setitem__("glob", OTHER)),
        (fun, lambda: setattr(fun, "__defaults__", (OTHER,))),
    ]:
        check = _check_of(function)
        check.captured()
        assert check._memo is not None  # the memo is in use
        rebind()
        assert [(n, id(v)) for n, v in check.captured()] == [(n, id(v)) for n, v in _full(function)]
    cell = MODEL  # read by ``closure``
    check = _check_of(closure)
    cell = nnx.Linear(2, 2, rngs=nnx.Rngs(2))
    assert [v for _, v in check.captured()] == [cell]
    cell = None
    assert check.captured() == []


def test_the_memo_keeps_no_module_alive():
    import gc
    import weakref

    holder = nnx.Linear(2, 2, rngs=nnx.Rngs(3))
    ref = weakref.ref(holder)

    def fun(x):
        return holder(x)

    check = _check_of(fun)
    assert [v for _, v in check.captured()] == [holder]
    assert check._memo is not None
    holder = None  # the closure cell now holds None
    gc.collect()
    assert ref() is None
    assert check.captured() == []


def _jit_over_a_cell(seeds: tuple[int, int]) -> tuple[Any, Any, Any, Callable[[Any], None]]:
    """Two Linear modules (from ``seeds``) and ``jit_over_a_cell`` of the first."""
    first, second = (nnx.Linear(2, 2, rngs=nnx.Rngs(seed)) for seed in seeds)
    return first, second, *jit_over_a_cell(first)


def test_under_track_a_cell_rebound_to_an_untracked_module_is_refused_at_the_next_call():
    import jaxoverride_nnx
    from jaxoverride.errors import MissingAdapterError

    first, second, jitted, rebind = _jit_over_a_cell((4, 5))
    x = jnp.ones(2)
    with jaxoverride_nnx.track(first):
        jitted(x)
        jitted(x)  # served by the memo
        rebind(second)
        with pytest.raises(MissingAdapterError, match="track it too"):
            jitted(x)
        rebind(first)
        jitted(x)
    with jaxoverride_nnx.track(first, second):
        rebind(second)
        np.testing.assert_allclose(jitted(x), second(x), rtol=1e-6)


def test_under_track_a_captured_submodule_that_leaves_the_tracked_set_is_refused():
    """The checked call's fast path (same stack, cell and object) still asks whether the
    object is tracked after every call: here the graph changes under it."""
    import jaxoverride as jo
    import jaxoverride_nnx
    from jaxoverride.errors import MissingAdapterError

    class Holder(nnx.Module):
        def __init__(self):
            self.inner = nnx.Linear(2, 2, rngs=nnx.Rngs(6))

    holder = Holder()
    inner = holder.inner
    jitted = jo.jit(lambda x: inner(x))
    x = jnp.ones(2)
    with jaxoverride_nnx.track(holder):
        for _ in range(3):  # the later calls take the fast path
            jitted(x)
        holder.inner = nnx.Linear(2, 2, rngs=nnx.Rngs(7))  # ``inner`` is no longer tracked
        with pytest.raises(MissingAdapterError, match="track it too"):
            jitted(x)
        holder.inner = inner
        np.testing.assert_allclose(jitted(x), inner(x), rtol=1e-6)


def test_the_fast_path_obeys_the_escape_hatch():
    import jaxoverride as jo
    import jaxoverride_nnx

    first, second, jitted, rebind = _jit_over_a_cell((8, 9))
    x = jnp.ones(2)
    with jaxoverride_nnx.track(first):
        jitted(x)
        jitted(x)
        previous = jo.set_adapter_check(False)
        try:
            rebind(second)  # refused with the check on; the program means it here
            jitted(x)
        finally:
            jo.set_adapter_check(previous)
