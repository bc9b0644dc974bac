"""A deep-equilibrium (DEQ) layer in Flax NNX, trained through unmodified optimistix.

The layer's output is the fixed point ``z* = tanh(z* W + x U + b)``, found by
``optimistix.fixed_point`` with ``FixedPointIteration``; a linear readout maps it to a
prediction. optimistix differentiates the solve implicitly: it closure-converts the cell
(``eqx.filter_closure_convert``, through ``jax.make_jaxpr``), so the weights the cell
reads become explicit operands of its implicit-function rule.

Nothing in optimistix or Equinox changes. ``jo.interpose_on_import`` must run before
they are first imported: ``eqx.filter_jit`` builds its ``jax.jit`` while optimistix is
imported, and interposed from the first line it is ``jaxoverride.jit``, which under
``jaxoverride_nnx.track`` reads the current weights on every call (never stale) and
threads them as inputs. The training step, ``jaxoverride.value_and_grad`` of the loss and
the ``nnx.Optimizer`` update, runs under ``jaxoverride.jit`` and reaches the model and
the optimizer through closures.

``explicit_loss`` is the same model on a plain parameter dict, the reference for the
gradient (and for ``benchmarks/bench_equinox_nnx.py``).

Run it with ``python examples/deq_optimistix_nnx.py``; it prints the loss falling.
"""

from __future__ import annotations

import jaxoverride as jo

# Before the first import of equinox/optimistix anywhere in the program.
_interposed = jo.interpose_on_import("equinox", "lineax", "optimistix")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import optimistix as optx  # noqa: E402
from flax import nnx  # noqa: E402

import jaxoverride_nnx  # noqa: E402

HIDDEN, INPUTS, EXAMPLES = 8, 4, 32
SOLVER = optx.FixedPointIteration(rtol=1e-5, atol=1e-5)


def solve(cell, x: jax.Array) -> jax.Array:
    """The equilibrium ``z* = cell(z*, x)`` for a batch ``x``, from ``z = 0``."""
    z0 = jnp.zeros((x.shape[0], HIDDEN))
    return optx.fixed_point(cell, SOLVER, z0, args=x, max_steps=100).value


class DEQ(nnx.Module):
    """A fixed-point layer and a linear readout."""

    def __init__(self, rngs: nnx.Rngs):
        small = nnx.initializers.normal(0.4 / HIDDEN**0.5)  # a contraction at the start
        self.hidden = nnx.Linear(HIDDEN, HIDDEN, use_bias=False, kernel_init=small, rngs=rngs)
        self.inject = nnx.Linear(INPUTS, HIDDEN, rngs=rngs)
        self.readout = nnx.Linear(HIDDEN, 1, rngs=rngs)

    def cell(self, z: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.tanh(self.hidden(z) + self.inject(x))

    def __call__(self, x: jax.Array) -> jax.Array:
        # The cell closes over the module: optimistix sees a plain function.
        return self.readout(solve(lambda z, x: self.cell(z, x), x))[:, 0]


def data() -> tuple[jax.Array, jax.Array]:
    kx, kw = jax.random.split(jax.random.key(42))
    x = jax.random.normal(kx, (EXAMPLES, INPUTS))
    return x, jnp.sin(x @ jax.random.normal(kw, (INPUTS,)))


def loss(model: DEQ, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((model(x) - y) ** 2)


def parameters(model: DEQ) -> dict[str, jax.Array]:
    """The model's weights as a plain dict, for ``explicit_loss``."""
    return {
        "W": model.hidden.kernel[...],
        "U": model.inject.kernel[...],
        "b": model.inject.bias[...],  # type: ignore[index]
        "R": model.readout.kernel[...],
        "c": model.readout.bias[...],  # type: ignore[index]
    }


def explicit_loss(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    """``loss`` on explicit arrays: the same optimistix solve, no module, no jaxoverride."""

    def cell(z: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.tanh(z @ params["W"] + x @ params["U"] + params["b"])

    prediction = solve(cell, x) @ params["R"] + params["c"]
    return jnp.mean((prediction[:, 0] - y) ** 2)


def train(steps: int = 20, learning_rate: float = 0.05) -> list[float]:
    """Trains a fresh layer; returns the loss before each step and after the last."""
    model = DEQ(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(learning_rate), wrt=nnx.Param)
    x, y = data()

    @jo.jit
    def train_step() -> jax.Array:
        value, grads = jo.value_and_grad(loss)(model, x, y)  # grads: an nnx.State
        optimizer.update(model, grads)
        return value

    with jaxoverride_nnx.track(model, optimizer):
        losses = [float(train_step()) for _ in range(steps)]
        losses.append(float(jo.jit(lambda: loss(model, x, y))()))
    assert int(optimizer.step[...]) == steps
    return losses


def gradient_error() -> tuple[float, float]:
    """Largest difference between ``jo.grad`` w.r.t. the tracked module and ``jax.grad`` of
    ``explicit_loss`` (the hidden kernel, which only the solve's implicit rule reaches),
    and the norm of that gradient."""
    model = DEQ(nnx.Rngs(0))
    x, y = data()
    with jaxoverride_nnx.track(model):
        grads = jo.jit(jo.grad(loss))(model, x, y)
    expected = jax.grad(explicit_loss)(parameters(model), x, y)
    error = jnp.max(jnp.abs(grads["hidden"]["kernel"][...] - expected["W"]))
    return float(error), float(jnp.linalg.norm(expected["W"]))


def main() -> None:
    error, norm = gradient_error()
    print(f"gradient max error vs explicit parameters: {error:.2e} (norm {norm:.3f})")
    losses = train()
    shown = ", ".join(f"{value:.4f}" for value in losses[::4])
    print(f"optimistix DEQ loss: {shown} ... {losses[-1]:.4f}")
    if not losses[-1] < 0.5 * losses[0]:
        raise AssertionError(f"the loss did not decrease enough: {losses}")


if __name__ == "__main__":
    main()
