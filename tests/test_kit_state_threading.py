"""The kit's state-threading combinators over a minimal state source (no framework)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax.core import Tracer

from jaxoverride import adapter_kit as kit


class Recording(kit.DictStateSource):
    """A dict source that initialises, records its passes and can ask for a retrace."""

    def __init__(self, store: dict[str, Any], initializing: bool = False):
        super().__init__(store)
        self.log: list[str] = []
        self._initializing = initializing
        self.grow: dict[str, Any] = {}
        self._pending = False
        self.undone = False
        self._entered: dict[str, Any] = {}

    def initializing(self) -> bool:
        return self._initializing

    def create(self, thunk: Callable[[], Any]) -> None:
        self.log.append("create")
        thunk()
        self.store.setdefault("w", jnp.float32(2.0))

    def undo_creation(self) -> None:
        self.undone = True
        self.store.pop("w", None)

    def read(self) -> Any:
        slots = {k: jnp.zeros(a.shape, a.dtype) for k, a in self.grow.items()}
        return {**self.store, **slots}

    def enter(self, state: Any) -> Any:
        self._entered = state
        return super().enter(state)

    def leave(self, token: Any) -> Any:
        after = dict(self.store)
        for name in set(after) - set(self._entered):
            self.grow[name] = jax.ShapeDtypeStruct(jnp.shape(after[name]), after[name].dtype)
            self._pending = True
        self.abandon(token)
        entered, self._entered = self._entered, {}
        return {k: after.get(k, v) for k, v in entered.items()}

    def retrace(self) -> bool:
        pending, self._pending = self._pending, False
        return pending


def test_init_runs_the_creation_pass_then_the_threaded_loop_once():
    source = Recording({}, initializing=True)

    def body(c: Any, x: Any) -> Any:
        source.log.append("body")
        return c * source.store.get("w", 1.0), None

    out, _ = kit.threaded_scan(source, jax.lax.scan, body, 1.0, jnp.ones(3))
    assert float(out) == 8.0
    assert source.log == ["create", "body", "body"]  # the creation pass, then one trace
    assert kit.is_applying() is False


def test_a_structure_change_is_a_clear_error():
    store = {"a": jnp.zeros(())}
    source = kit.DictStateSource(store)

    def body(c: Any, x: Any) -> Any:
        store["b"] = c
        return c, None

    with pytest.raises(kit.StateStructureError, match="changed the structure"):
        kit.threaded_scan(source, jax.lax.scan, body, 0.0, jnp.ones(2))
    assert set(store) == {"a"}


def test_a_source_that_met_new_state_gets_the_call_run_again_before_anything_is_written():
    source = Recording({"n": jnp.int32(0)})

    def body(i: Any, c: Any) -> Any:
        source.store["n"] = source.store["n"] + 1
        source.store["last"] = i
        return c

    with jax.checking_leaks():
        kit.threaded_fori_loop(source, jax.lax.fori_loop, 0, 3, body, 0.0)
    assert int(source.store["n"]) == 3  # written once, by the second run
    assert int(source.store["last"]) == 2


def test_a_failure_after_the_creation_pass_undoes_it():
    source = Recording({}, initializing=True)

    def body(c: Any, x: Any) -> Any:
        if isinstance(c, Tracer):
            raise KeyError("traced")
        return c, None

    with pytest.raises(KeyError):
        kit.threaded_scan(source, jax.lax.scan, body, 1.0, jnp.ones(2))
    assert source.undone and "w" not in source.store


def test_the_source_protocol_is_checkable():
    assert isinstance(kit.DictStateSource({}), kit.StateSource)
    assert not isinstance(object(), kit.StateSource)


@pytest.mark.parametrize("xs", [3.0, "abc"], ids=["scalar", "string"])
def test_a_creation_pass_over_xs_jax_refuses_raises_jax_own_error(xs: Any):
    """The creation pass meets ``xs`` first: it must fail as JAX's scan fails on them,
    not with an indexing error of its own, and before the body runs."""
    source = Recording({}, initializing=True)
    with pytest.raises((TypeError, ValueError)) as expected:
        jax.lax.scan(lambda c, x: (c, None), 0.0, xs)

    def body(c: Any, x: Any) -> Any:
        source.log.append("body")
        return c, None

    with pytest.raises(type(expected.value)) as raised:
        kit.threaded_scan(source, jax.lax.scan, body, 0.0, xs)
    assert str(raised.value) == str(expected.value)
    assert "body" not in source.log


@pytest.mark.parametrize("combinator", ["cond", "switch"])
def test_operand_and_positional_operands_together_are_refused_as_jax_refuses_them(
    combinator: str,
):
    store = {"hits": jnp.int32(0)}
    source = kit.DictStateSource(store)

    def hit(x: Any) -> Any:
        store["hits"] = store["hits"] + 1
        return x

    with pytest.raises(TypeError, match="'operand' keyword is passed") as expected:
        jax.lax.cond(True, hit, hit, 1.0, operand=2.0)
    calls = {
        "cond": lambda: kit.threaded_cond(source, jax.lax.cond, True, hit, hit, 1.0, operand=2.0),
        "switch": lambda: kit.threaded_switch(source, jax.lax.switch, 0, [hit], 1.0, operand=2.0),
    }
    with pytest.raises(TypeError) as refused:
        calls[combinator]()
    assert str(refused.value) == str(expected.value)
    assert int(store["hits"]) == 0  # refused before any branch ran
