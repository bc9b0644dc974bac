"""A Haiku neural ODE trained through diffrax, unmodified, inside ``hk.transform``.

The vector field ``dy/dt = MLP(y)`` is a Haiku module; ``diffrax.diffeqsolve`` (``Tsit5``,
its default ``RecursiveCheckpointAdjoint``) integrates it, and a few Adam steps fit the
trajectory of a damped spiral. diffrax builds its ``eqx.filter_jit`` when it is imported
and closure-converts the vector field with ``jax.make_jaxpr``, so **import order matters**:
``equinox`` and ``diffrax`` are interposed as they are imported, before their module bodies
run, and ``jaxoverride_haiku.context()`` then makes init create the MLP's parameters once
and apply read them at every trace level. A state write or an rng draw inside the vector
field is refused (``PureFunctionWriteError``): nothing written inside a converted function
can come out of it.

The first loss and gradient are checked against the same diffrax call on the explicit
parameters with raw JAX. Run: ``python examples/haiku_neural_ode.py``.
"""

from __future__ import annotations

from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxoverride as jo
import jaxoverride_haiku as joh


def import_diffrax() -> Any:
    """Imports diffrax with ``equinox`` and ``diffrax`` interposed from their first line on."""
    jo.interpose_on_import("equinox", "diffrax")  # before the first import of either
    import diffrax

    return diffrax


diffrax = import_diffrax()

TS = jnp.linspace(0.0, 2.0, 9)
Y0 = jnp.array([2.0, 0.0])
SPIRAL = jnp.array([[-0.1, 2.0], [-2.0, -0.1]])  # dy/dt = y @ SPIRAL: a damped rotation
STEPS = 8


def _target() -> jax.Array:
    term = diffrax.ODETerm(lambda t, y, args: y @ SPIRAL)
    saveat = diffrax.SaveAt(ts=TS)
    return diffrax.diffeqsolve(term, diffrax.Tsit5(), 0.0, 2.0, 0.1, Y0, saveat=saveat).ys


def _solve(vector_field: Any, y0: jax.Array) -> jax.Array:
    term = diffrax.ODETerm(lambda t, y, args: vector_field(y))
    saveat = diffrax.SaveAt(ts=TS)
    return diffrax.diffeqsolve(term, diffrax.Tsit5(), 0.0, 2.0, 0.1, y0, saveat=saveat).ys


def trajectory(y0: jax.Array) -> jax.Array:
    """The neural ODE's trajectory at ``TS``: the MLP is built once, outside the callback."""
    mlp = hk.nets.MLP([16, 2], activation=jnp.tanh, name="vector_field")
    return _solve(mlp, y0)


def explicit_trajectory(params: hk.Params, y0: jax.Array) -> jax.Array:
    """The same solve on raw JAX, with the MLP's parameters passed explicitly."""
    first = params["vector_field/~/linear_0"]
    second = params["vector_field/~/linear_1"]
    mlp = lambda y: jnp.tanh(y @ first["w"] + first["b"]) @ second["w"] + second["b"]
    return _solve(mlp, y0)


def main() -> None:
    model = hk.without_apply_rng(hk.transform(trajectory))
    target = _target()
    traces = []

    def loss(params: hk.Params) -> jax.Array:
        traces.append(1)  # Python runs only when JAX traces: counts the traces
        return jnp.mean((model.apply(params, Y0) - target) ** 2)

    explicit_loss = lambda p: jnp.mean((explicit_trajectory(p, Y0) - target) ** 2)
    optimizer = optax.adam(3e-2)

    with joh.context():
        params = model.init(jax.random.PRNGKey(0), Y0)
        loss_and_grad = jax.jit(jax.value_and_grad(loss))
        first_loss, first_grads = loss_and_grad(params)

        losses = []
        opt_state = optimizer.init(params)
        trained = params
        for _ in range(STEPS):
            value, grads = loss_and_grad(trained)  # compiled once, a cache hit afterwards
            updates, opt_state = optimizer.update(grads, opt_state)
            trained = optax.apply_updates(trained, updates)
            losses.append(float(value))

    expected_loss, expected_grads = jax.value_and_grad(explicit_loss)(params)
    np.testing.assert_allclose(first_loss, expected_loss, rtol=1e-5)
    check = lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    jax.tree.map(check, first_grads, expected_grads)  # same structure, same values
    print("parameters:", sorted(params))
    print("traces of the loss:", len(traces))
    print("loss per step:", " ".join(f"{value:.4f}" for value in losses))
    assert losses[-1] < losses[0], losses
    print(f"loss went down: {losses[0]:.4f} -> {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
