"""A custom rule inside ``jax.linearize`` in a bound Linen module with a mutable collection.

From JAX 0.12 a ``custom_jvp`` call met in a partial evaluation with an unknown input (a
tangent, inside ``jax.linearize``) is staged as one equation whose outputs are all
unknown. The Linen adapter's rule returns the collections it threads as extra outputs: a
collection the rule only carried must still come out as the known value it was, or the
enclosing function's primal output is unknown and JAX refuses the linearization. This is
the pattern of optimistix's Newton step (``jax.linearize`` of a function that calls its
``custom_jvp`` ``_asarray`` on the tangent, in its rule), against the real Flax Linen.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jaxoverride as jo
import jaxoverride_linen

N = 3
X = jnp.linspace(-1.0, 1.0, N)
KEY = jax.random.key(0)


@jo.custom_jvp
def _as_array(x: jax.Array) -> jax.Array:
    return jnp.asarray(x)


@_as_array.defjvp
def _as_array_jvp(primals: tuple[jax.Array], tangents: tuple[jax.Array]) -> tuple:
    # As optimistix's rule: the function itself, on the primal and on the tangent.
    return _as_array(primals[0]), _as_array(tangents[0])


class Step(nn.Module):
    """One Newton-like step on a Dense, with a counter written outside the step."""

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        dense = nn.Dense(N)
        calls = self.variable("counters", "calls", lambda: jnp.zeros((), jnp.int32))
        calls.value += 1
        fx, lin = jo.linearize(lambda y: _as_array(jnp.tanh(dense(y)) - y), x)
        return fx, lin(jnp.ones(N))


def _explicit(params: dict, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    f = lambda y: jnp.tanh(y @ params["kernel"] + params["bias"]) - y
    fx, lin = jax.linearize(f, x)
    return fx, lin(jnp.ones(N))


def test_linearize_of_a_rule_that_calls_itself_on_the_tangent_keeps_carried_state_known():
    model = Step()
    with jaxoverride_linen.context():
        with jax.checking_leaks():
            variables = model.init(KEY, X)
            (fx, tangent), state = model.apply(variables, X, mutable=["counters"])
        jitted, jitted_state = jax.jit(lambda v: model.apply(v, X, mutable=["counters"]))(variables)
    expected = _explicit(variables["params"]["Dense_0"], X)
    for got in ((fx, tangent), jitted):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, expected)
    assert int(variables["counters"]["calls"]) == 1
    assert int(state["counters"]["calls"]) == int(jitted_state["counters"]["calls"]) == 2
