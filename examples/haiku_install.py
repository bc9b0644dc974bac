"""``jaxoverride_haiku.install()`` with a third-party library that never heard of Haiku.

``optax.power_iteration`` estimates the dominant eigenvalue of a linear operator given as
a callable, with a ``jax.lax.while_loop`` inside. Pass it a Haiku module that counts its
own applications in Haiku state, and raw JAX fails: the loop body writes state from
inside the loop's trace. After ``jo.interpose`` (its ``jax`` and ``lax`` become the neutral API,
which is JAX itself while nothing is active) and ``jaxoverride_haiku.install()`` (active
only inside Haiku transforms), the unmodified function works at init and at apply, and
finds what it finds on the explicit matrix outside Haiku.

Run: ``python examples/haiku_install.py``.
"""

from __future__ import annotations

from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax._src.linear_algebra as third_party

import jaxoverride as jo
import jaxoverride_haiku as joh

N = 6


class CountingOperator(hk.Module):
    """A linear layer that counts in state how often it has been applied."""

    def __call__(self, v: jax.Array) -> jax.Array:
        calls = hk.get_state("calls", [], jnp.int32, init=jnp.zeros)
        hk.set_state("calls", calls + 1)
        return hk.Linear(N, with_bias=False, name="linear")(v)


def power_iteration(matrix: Any, v0: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``optax.power_iteration`` as this example runs it: (eigenvalue, eigenvector)."""
    eigenvalue, eigenvector = optax.power_iteration(
        matrix, v0=v0, num_iters=500, error_tolerance=1e-7
    )
    return jnp.asarray(eigenvalue), jnp.asarray(eigenvector)


def spectral_radius(v0: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A Haiku model that measures the dominant eigenvalue of its own linear layer."""
    return power_iteration(CountingOperator(name="operator"), v0)


def main() -> None:
    model = hk.transform_with_state(spectral_radius)
    v0 = jnp.ones(N)
    rng = jax.random.PRNGKey(0)

    params, state = model.init(rng, v0)
    _, state = model.apply(params, state, None, v0)
    try:
        _ = state["operator"]["calls"] + 1
    except jax.errors.UnexpectedTracerError:
        # The loop body wrote state from inside the loop's trace: a leaked tracer.
        print("raw optax inside hk.transform: the count leaked out of the loop as a tracer")

    with jo.interpose(third_party), joh.install():
        params, state = model.init(rng, v0)
        (eigenvalue, eigenvector), state = jax.jit(model.apply)(params, state, None, v0)

    # The same library call, outside Haiku, on the explicit matrix (x @ w == w.T @ x).
    w = params["operator/linear"]["w"]
    expected, expected_vector = power_iteration(w.T, v0)
    print(f"params created at init: {jax.tree.map(jnp.shape, params)}")
    print(f"dominant eigenvalue via Haiku: {float(eigenvalue):.6f}, "
          f"on the explicit matrix: {float(expected):.6f}")  # fmt: skip
    np.testing.assert_allclose(eigenvalue, expected, rtol=1e-5)
    np.testing.assert_allclose(eigenvector, expected_vector, rtol=1e-4, atol=1e-5)
    print(f"operator applications counted in Haiku state: {int(state['operator']['calls'])}")
    print("install() is gone again:", not joh.is_installed())


if __name__ == "__main__":
    main()
