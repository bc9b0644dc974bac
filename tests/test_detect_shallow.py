"""The missing-adapter check's shallow lookup of captured NNX state.

``captured_state`` runs at every call of a neutral transform built over captured NNX
state. For a function none of whose direct values is searched further it reads them
without the full search: the result must be the full search's, in its order.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import pytest
from flax import nnx

from jaxoverride import _detect

MODEL = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
OTHER = nnx.Linear(2, 2, rngs=nnx.Rngs(1))
COUNTER = nnx.Variable(jnp.array(0))


def _full(fun: Any) -> list[tuple[str, Any]]:
    return [(n, v) for n, v in _detect._values_of(fun) if _detect.NNX.is_state(v)]


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
