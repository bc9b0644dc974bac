"""Watch what unmodified solver libraries do: every jax call they make, and a progress bar.

jaxopt and optax are used exactly as installed. ``jaxoverride.interpose`` rebinds the
``jax`` references of the modules that hold their loops to the neutral API (JAX itself
while nothing is active), and ``jaxoverride_debug.trace`` then logs each call with its
shapes and the implementation it goes to, and puts a tqdm bar on the fixed-length scan
that jaxopt runs for ``unroll=True``. Results are compared with an untraced run.

Run: ``python examples/debug_trace.py``
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jaxopt
import jaxopt._src.loop as jaxopt_loop
import numpy as np
import optax
import optax._src.linear_algebra as optax_linear_algebra

import jaxoverride as jo
import jaxoverride_debug


def least_squares(w, data):
    inputs, targets = data
    return jnp.mean((inputs @ w - targets) ** 2)


def problem() -> tuple[jax.Array, tuple[jax.Array, jax.Array], jax.Array]:
    k_inputs, k_w, k_matrix = jax.random.split(jax.random.PRNGKey(0), 3)
    inputs = jax.random.normal(k_inputs, (64, 8))
    targets = inputs @ jax.random.normal(k_w, (8,))
    matrix = jax.random.normal(k_matrix, (16, 16))
    return jnp.zeros(8), (inputs, targets), matrix @ matrix.T


def solve(w0, data, matrix):
    # unroll=True makes jaxopt run a fixed-length lax.scan: a static trip count.
    solver = jaxopt.GradientDescent(least_squares, maxiter=300, tol=1e-6, unroll=True, jit=True)
    w, _ = solver.run(w0, data)
    eigenvalue = optax.power_iteration(matrix, num_iters=100)[1]
    return w, eigenvalue


def main() -> None:
    w0, data, matrix = problem()
    expected = solve(w0, data, matrix)
    with jo.interpose(jaxopt_loop), jo.interpose(optax_linear_algebra):
        with jaxoverride_debug.trace(log=print, progress=True, min_steps=50) as trace:
            actual = solve(w0, data, matrix)
        jax.effects_barrier()  # let the last progress callbacks print
    # The same up to float rounding: XLA compiles a loop body around the progress bar's
    # callback anew (jax 0.12 on CPU differs in the last bits; see docs/debug.md).
    for got, want in zip(actual, expected, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    names = sorted({call.name for call in trace.calls})
    print(f"\n{len(trace.calls)} neutral calls ({', '.join(names)}); results unchanged.")


if __name__ == "__main__":
    main()
