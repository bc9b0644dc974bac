"""One structure-change error: ``jaxoverride.errors.StructureChangeError``.

The kit's state threading and the NNX adapter raise the same class (a
``JaxoverrideError`` and, as before, a ``ValueError``), and its message says what changed
(paths added or removed, leaves of a new shape or dtype) instead of printing two raw
``PyTreeDef``s.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import pytest

import jaxoverride_nnx
from jaxoverride import adapter_kit as kit, errors
from jaxoverride._tree_diff import describe


def test_the_kit_and_the_adapters_raise_the_one_class():
    assert kit.StateStructureError is errors.StructureChangeError
    assert jaxoverride_nnx.StructureChangeError is errors.StructureChangeError
    assert issubclass(errors.StructureChangeError, errors.JaxoverrideError)
    assert issubclass(errors.StructureChangeError, ValueError)


def test_a_threaded_loop_that_adds_state_names_what_it_added():
    store = {"params": {"w": jnp.zeros(2)}}
    source = kit.DictStateSource(store)

    def body(c: Any, x: Any) -> Any:
        store["params"] = {**store["params"], "b": c}
        return c, None

    with jax.checking_leaks(), pytest.raises(errors.StructureChangeError) as info:
        kit.threaded_scan(source, jax.lax.scan, body, jnp.float32(0), jnp.ones(2))
    message = str(info.value)
    assert "lax.scan: the traced function changed the structure of the state" in message, message
    assert "['params']['b'] added (float32[])" in message
    assert "PyTreeDef" not in message and "Create every variable before the loop" in message
    assert set(store["params"]) == {"w"}  # nothing written


def test_a_threaded_loop_that_drops_state_names_what_it_dropped():
    store = {"w": jnp.zeros(2), "count": jnp.int32(0)}
    source = kit.DictStateSource(store)

    def body(c: Any, x: Any) -> Any:
        del store["count"]
        return c, None

    with jax.checking_leaks(), pytest.raises(errors.StructureChangeError) as info:
        kit.threaded_scan(source, jax.lax.scan, body, jnp.float32(0), jnp.ones(2))
    assert "['count'] removed (was int32[])" in str(info.value)


def test_the_description_names_changed_leaves_and_containers_and_stays_short():
    assert (
        describe({"w": jnp.ones(2)}, {"w": jnp.ones((2, 3))}) == "['w'] float32[2] -> float32[2,3]"
    )
    assert (
        describe({"w": jnp.ones(2)}, {"w": jnp.ones(2, jnp.int32)})
        == "['w'] float32[2] -> int32[2]"
    )
    assert describe({"a": [1, 2]}, {"a": (1, 2)}) == "['a']: a list became a tuple"
    assert "[1] added (empty subtrees, such as None)" in describe([1.0], [1.0, None])
    many = describe({}, {f"k{i}": i for i in range(10)})
    assert many.count(" added ") == 6 and many.endswith("... and 4 more")


def test_between_builds_the_message_from_the_two_states():
    error = errors.StructureChangeError.between(
        "jaxoverride.lax.scan", {"w": jnp.ones(2)}, {}, "Fix: create it outside."
    )
    assert str(error) == (
        "jaxoverride.lax.scan: the traced function changed the structure of the state it "
        "threads: ['w'] removed (was float32[2]). Fix: create it outside."
    )
