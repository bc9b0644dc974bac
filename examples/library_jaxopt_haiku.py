"""An unmodified third-party solver (jaxopt) with a Haiku model inside its callback.

``jaxopt.FixedPointIteration`` jits its ``update`` (``jax.jit(self.update)``) and loops with
``jax.lax.scan``/``cond`` (``implicit_diff=False``). The model's fixed-point map is a Haiku
layer that also counts its calls in Haiku state. Raw, Haiku's state leaks out of jaxopt's
trace. After ``jo.interpose`` of jaxopt's modules (their ``jax`` becomes the neutral API,
which is JAX itself while nothing is active) and ``jaxoverride_haiku.context()``, the same
jaxopt works at init and at apply, eagerly and under ``jax.jit``, and finds what it finds on
the explicit parameters outside Haiku.

Run: ``python examples/library_jaxopt_haiku.py``.
"""

from __future__ import annotations

import sys
import warnings

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # "JAXopt is no longer maintained"
    import jaxopt

import jaxoverride as jo
import jaxoverride_haiku as joh

N = 4


def forward(x: jax.Array) -> jax.Array:
    """A deep-equilibrium layer: the fixed point of ``z -> tanh(z W + b + x)``."""
    layer = hk.Linear(N, w_init=hk.initializers.RandomNormal(0.2), name="cell")

    def cell(z: jax.Array) -> jax.Array:
        hk.set_state("calls", hk.get_state("calls", [], jnp.int32, init=jnp.zeros) + 1)
        return jnp.tanh(layer(z) + x)

    solver = jaxopt.FixedPointIteration(cell, maxiter=50, tol=1e-5, implicit_diff=False)
    return solver.run(jnp.zeros(N)).params


def main() -> None:
    model = hk.transform_with_state(forward)
    x, rng = jnp.linspace(-1.0, 1.0, N), jax.random.PRNGKey(0)

    try:
        params, state = model.init(rng, x)
        model.apply(params, state, None, x)
    except jax.errors.UnexpectedTracerError:
        print("raw jaxopt inside hk.transform: Haiku state leaked out of jaxopt's jit")
    else:
        raise AssertionError("raw jaxopt was expected to leak Haiku state")

    # Every already-imported jaxopt module; restored on exit.
    with jo.interpose(sys.modules["jaxopt"], recursive=True), joh.context():
        params, state = model.init(rng, x)
        z, state = jax.jit(model.apply)(params, state, None, x)

    w, b = params["cell"]["w"], params["cell"]["b"]
    explicit = jaxopt.FixedPointIteration(
        lambda z: jnp.tanh(z @ w + b + x), maxiter=50, tol=1e-5, implicit_diff=False
    )
    expected = explicit.run(jnp.zeros(N)).params
    print("fixed point via Haiku:      ", np.round(np.asarray(z), 5))
    print("on the explicit parameters: ", np.round(np.asarray(expected), 5))
    np.testing.assert_allclose(z, expected, rtol=1e-6, atol=1e-6)
    print("cell applications counted in Haiku state:", int(state["~"]["calls"]))


if __name__ == "__main__":
    main()
