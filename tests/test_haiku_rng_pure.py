"""Haiku: a read-only map with a nested neutral call, in an implicit solve, with an rng.

``examples/fpsolve.py`` with ``implicit=True`` converts the map (``closure_convert``), in
which every state write and rng draw is refused: nothing drawn there could come out. A
nested ``jo.lax.fori_loop``, ``jo.jit`` or ``jo.checkpoint`` in the map draws nothing,
and runs with an ``rng`` given to init and apply as with ``rng=None``, under ``jax.grad``
too. A real draw in the map is still refused, also one inside the nested call (whose
frame is built from carried rng state), never served a key.
"""

from __future__ import annotations

from collections.abc import Callable

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxoverride as jo
import jaxoverride_haiku as joh
from _examples import fixed_point  # pyright: ignore[reportAttributeAccessIssue]
from jaxoverride import lax as jlax

X = jnp.linspace(-1.0, 1.0, 3)
NESTED: dict[str, Callable[[Callable[[jax.Array], jax.Array], jax.Array], jax.Array]] = {
    "fori_loop": lambda body, h: jlax.fori_loop(0, 2, lambda _, h: body(h), h),
    "jit": lambda body, h: jo.jit(body)(h),
    "checkpoint": lambda body, h: jo.checkpoint(body)(h),
}


def _model(nested: str, draw: str | None = None) -> hk.Transformed:
    """A DEQ whose map runs ``nested``; ``draw``: where it draws a key ("map", "nested")."""

    def forward(x):
        layer = hk.Linear(3, w_init=hk.initializers.RandomNormal(0.3))

        def body(h):
            if draw == "nested":
                h = h + 0.01 * jax.random.normal(hk.next_rng_key(), h.shape)
            return h * 0.5 + 0.1

        def step(z, x):
            h = NESTED[nested](body, z)
            if draw == "map":
                h = h + 0.01 * jax.random.normal(hk.next_rng_key(), h.shape)
            return jnp.tanh(layer(h) + x)

        return fixed_point(step, jnp.zeros(3), x, implicit=True).value

    return hk.transform(forward)


@pytest.fixture(autouse=True)
def _haiku_context():
    with joh.context():
        yield


@pytest.mark.parametrize("nested", list(NESTED))
def test_a_nested_call_in_an_implicitly_solved_map_runs_with_an_rng(nested):
    model = _model(nested)
    key = jax.random.PRNGKey(1)
    with jax.checking_leaks():
        params = model.init(key, X)
        without = model.apply(params, None, X)
        given = model.apply(params, key, X)
        grads = jax.grad(lambda p: model.apply(p, key, X).sum())(params)
        reference = jax.grad(lambda p: model.apply(p, None, X).sum())(params)
    np.testing.assert_allclose(given, without)
    np.testing.assert_allclose(grads["linear"]["w"], reference["linear"]["w"])
    assert float(jnp.abs(grads["linear"]["w"]).sum()) > 0


@pytest.mark.parametrize("draw", ["map", "nested"])
@pytest.mark.parametrize("nested", list(NESTED))
def test_a_draw_in_an_implicitly_solved_map_is_still_refused(nested, draw):
    model = _model(nested, draw)
    key = jax.random.PRNGKey(1)
    params = _model(nested).init(key, X)
    for run in (lambda: model.init(key, X), lambda: model.apply(params, key, X)):
        with pytest.raises(joh.PureFunctionWriteError, match=r"rng key was drawn"):
            run()
