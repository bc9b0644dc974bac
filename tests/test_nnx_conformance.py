"""The NNX adapter against JAX's custom-derivative suite and misuse: round 3 of the
conformance work (issue 21). Each test fails on the adapter before the fix."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from flax import nnx

import jaxoverride as jo
import jaxoverride_nnx

# -- track scopes and install ---------------------------------------------------------


def test_track_scopes_exited_out_of_order_are_refused_and_change_nothing():
    v1, v2, v3 = (nnx.Variable(jnp.zeros(())) for _ in range(3))
    first, second = jaxoverride_nnx.track(v1), jaxoverride_nnx.track(v2)
    first.__enter__()
    second.__enter__()
    with pytest.raises(RuntimeError, match="reverse order of entry"):
        first.__exit__(None, None, None)
    # Nothing changed: both are still tracked, and they exit in order.
    assert [v for _, v in jaxoverride_nnx.tracked_variables()] == [v1, v2]
    second.__exit__(None, None, None)
    assert [v for _, v in jaxoverride_nnx.tracked_variables()] == [v1]
    first.__exit__(None, None, None)
    assert jaxoverride_nnx.tracked_variables() == []
    with jaxoverride_nnx.track(v3):  # a later scope tracks only its own module
        assert [v for _, v in jaxoverride_nnx.tracked_variables()] == [v3]
    assert not jo.current_stack().layers


def test_install_twice_returns_the_same_handle():
    try:
        first = jaxoverride_nnx.install()
        assert jaxoverride_nnx.install() is first
    finally:
        assert jaxoverride_nnx.uninstall()
    assert not jaxoverride_nnx.uninstall()
