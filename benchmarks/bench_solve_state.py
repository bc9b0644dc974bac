"""``jaxoverride.solve_state``: a DEQ with dropout and BatchNorm in its map, declared, against
the hand-written twin.

For each of Haiku, Flax Linen and Flax NNX: ``jit(grad)`` of the loss of a DEQ layer whose
map is ``z -> tanh(BN(dropout(z) W + x U))``, solved by ``examples/fpsolve.py`` (Anderson,
implicit gradient), with the framework's own dropout and BatchNorm *inside* the map and
the solve wrapped in ``jo.solve_state()`` (one mask per solve, the statistics at the
solution). The twin is what a user writes without the declaration, in the same framework: it draws
the dropout key before the solve and passes it through the map's ``args`` (the map draws
the same mask from it at every evaluation), normalises with the batch statistics by hand
inside the map, and updates the running statistics once, after the solve, by calling the
framework's BatchNorm at ``z*``. Both run the same computation on the same parameters and
state, up to the mask (each derives its dropout key its own way): target <= 1.05x,
compiled, cache-hit calls. The NNX models are tracked one per ``track``, as a user tracks
the model being trained: a declaration covers every tracked Variable, so under one track
over both models the declared step would also thread the twin's state (measured 1.25x).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

import jaxoverride as jo
from benchmarks._harness import Row, at_most, guarded, interleaved, main, ratio_rows

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from fpsolve import fixed_point

SUITE = "solve_state"
HIDDEN, INPUTS, BATCH = 16, 8, 64
RATE, MOMENTUM, EPSILON = 0.1, 0.9, 1e-5
SOLVER = {"method": "anderson", "implicit": True}
DECLARED, TWIN = "jo.solve_state()", "key through args, stats updated once"


def _inputs() -> jax.Array:
    return jax.random.normal(jax.random.key(0), (BATCH, INPUTS))


def _normalised(h: jax.Array) -> jax.Array:
    """BatchNorm in training mode without scale and offset, by hand: the twin's map."""
    mean = jnp.mean(h, axis=0)
    return (h - mean) / jnp.sqrt(jnp.mean((h - mean) ** 2, axis=0) + EPSILON)


def _dropped(key: jax.Array, z: jax.Array) -> jax.Array:
    """Dropout as the frameworks draw it: keep with probability 1 - RATE, rescale."""
    keep = jax.random.bernoulli(key, 1.0 - RATE, z.shape)
    return jnp.where(keep, z / (1.0 - RATE), 0.0)


def _pair(
    case: str, declared: Callable[[], Any], twin: Callable[[], Any], quick: bool
) -> list[Row]:
    samples = interleaved(
        {DECLARED: declared, TWIN: twin},
        number=10 if quick else 50,
        rounds=5 if quick else 25,
    )
    return ratio_rows(SUITE, case, samples, TWIN, {DECLARED: at_most(1.05)})


def _compiled_grad(loss: Callable[..., Any], params: Any, state: Any) -> Callable[[], Any]:
    """A call of ``jax.jit(jax.grad(loss, has_aux=True))`` at ``params`` and ``state``."""
    grad = jax.jit(jax.grad(loss, has_aux=True))
    return lambda: grad(params, state)


def _haiku(quick: bool) -> list[Row]:
    import haiku as hk

    import jaxoverride_haiku

    small = hk.initializers.RandomNormal(0.2 / HIDDEN**0.5)

    def layers() -> tuple[Any, Any, Any]:
        hidden = hk.Linear(HIDDEN, with_bias=False, w_init=small, name="hidden")
        inject = hk.Linear(HIDDEN, name="inject")
        norm = hk.BatchNorm(False, False, decay_rate=MOMENTUM, eps=EPSILON, name="norm")
        return hidden, inject, norm

    def declared(x: jax.Array, key: jax.Array | None) -> jax.Array:
        del key  # drawn from the frame's stream, inside the map
        hidden, inject, norm = layers()

        def cell(z: jax.Array, u: jax.Array) -> jax.Array:
            z = hk.dropout(hk.next_rng_key(), RATE, z)
            return jnp.tanh(norm(hidden(z) + u, is_training=True))

        with jo.solve_state():
            return fixed_point(cell, jnp.zeros((BATCH, HIDDEN)), inject(x), **SOLVER).value

    def twin(x: jax.Array, key: jax.Array) -> jax.Array:
        # The key drawn before the call, an argument (with an rng in apply instead, no
        # declaration and fpsolve's implicit mode, the Haiku adapter fails under
        # jax.jit(jax.grad): a tracer among the inner jit's constants, open).
        hidden, inject, norm = layers()
        cell = lambda z, a: jnp.tanh(_normalised(hidden(_dropped(a[1], z)) + a[0]))
        z = fixed_point(cell, jnp.zeros((BATCH, HIDDEN)), (inject(x), key), **SOLVER).value
        norm(hidden(_dropped(key, z)) + inject(x), is_training=True)  # the statistics, once
        return z

    x, key = _inputs(), jax.random.key(1)
    with jaxoverride_haiku.context():
        grads = {}
        for name, forward, rng in ((DECLARED, declared, key), (TWIN, twin, None)):
            model = hk.transform_with_state(forward)
            params, state = model.init(jax.random.key(2), x, key)

            def loss(params: Any, state: Any, model: Any = model, rng: Any = rng) -> Any:
                z, state = model.apply(params, state, rng, x, key)
                return jnp.sum(z**2), state

            grads[name] = _compiled_grad(loss, params, state)
        return _pair("Haiku DEQ with dropout and BatchNorm, jax.jit(jax.grad)",
                     grads[DECLARED], grads[TWIN], quick)  # fmt: skip


def _linen(quick: bool) -> list[Row]:
    import flax.linen as nn

    import jaxoverride_linen

    small = nn.initializers.normal(0.2 / HIDDEN**0.5)

    class DEQ(nn.Module):
        declared: bool

        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            hidden = nn.Dense(HIDDEN, use_bias=False, kernel_init=small, name="hidden")
            inject = nn.Dense(HIDDEN, name="inject")
            norm = nn.BatchNorm(
                use_running_average=False, momentum=MOMENTUM, epsilon=EPSILON,
                use_scale=False, use_bias=False, name="norm",
            )  # fmt: skip
            z0 = jnp.zeros((BATCH, HIDDEN))
            if self.declared:
                dropout = nn.Dropout(RATE, deterministic=False)
                cell = lambda z, u: jnp.tanh(norm(hidden(dropout(z)) + u))
                with jo.solve_state():
                    return fixed_point(cell, z0, inject(x), **SOLVER).value
            key = self.make_rng("dropout")
            cell = lambda z, a: jnp.tanh(_normalised(hidden(_dropped(a[1], z)) + a[0]))
            z = fixed_point(cell, z0, (inject(x), key), **SOLVER).value
            norm(hidden(_dropped(key, z)) + inject(x))  # the statistics, once
            return z

    x, key = _inputs(), jax.random.key(1)
    with jaxoverride_linen.context():
        grads = {}
        for name, declared in ((DECLARED, True), (TWIN, False)):
            model = DEQ(declared)
            variables = model.init({"params": jax.random.key(2), "dropout": key}, x)

            def loss(params: Any, stats: Any, model: Any = model) -> Any:
                z, updates = model.apply(
                    {"params": params, "batch_stats": stats}, x,
                    rngs={"dropout": key}, mutable=["batch_stats"],
                )  # fmt: skip
                return jnp.sum(z**2), updates["batch_stats"]

            grads[name] = _compiled_grad(loss, variables["params"], variables["batch_stats"])
        return _pair("Linen DEQ with dropout and BatchNorm, jax.jit(jax.grad)",
                     grads[DECLARED], grads[TWIN], quick)  # fmt: skip


def _nnx(quick: bool) -> list[Row]:
    from flax import nnx

    import jaxoverride_nnx

    small = nnx.initializers.normal(0.2 / HIDDEN**0.5)

    class DEQ(nnx.Module):
        def __init__(self, declared: bool, rngs: nnx.Rngs):
            self.declared = declared
            self.hidden = nnx.Linear(HIDDEN, HIDDEN, use_bias=False, kernel_init=small, rngs=rngs)
            self.inject = nnx.Linear(INPUTS, HIDDEN, rngs=rngs)
            self.norm = nnx.BatchNorm(
                HIDDEN, momentum=MOMENTUM, epsilon=EPSILON, use_scale=False, use_bias=False,
                rngs=rngs,
            )  # fmt: skip
            self.dropout = nnx.Dropout(RATE, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            z0 = jnp.zeros((BATCH, HIDDEN))
            if self.declared:
                cell = lambda z, u: jnp.tanh(self.norm(self.hidden(self.dropout(z)) + u))
                with jo.solve_state():
                    return fixed_point(cell, z0, self.inject(x), **SOLVER).value
            stream = self.dropout.rngs
            assert stream is not None
            key = stream()  # the dropout stream, drawn once before the solve
            cell = lambda z, a: jnp.tanh(_normalised(self.hidden(_dropped(a[1], z)) + a[0]))
            z = fixed_point(cell, z0, (self.inject(x), key), **SOLVER).value
            self.norm(self.hidden(_dropped(key, z)) + self.inject(x))  # the statistics, once
            return z

    x = _inputs()
    models = {
        name: DEQ(declared, nnx.Rngs(2, dropout=1))
        for name, declared in ((DECLARED, True), (TWIN, False))
    }
    grad = jo.jit(jo.grad(lambda model: jnp.sum(model(x) ** 2)))
    # Each model under its own track, as a user tracks the model they train (a declaration
    # covers every tracked Variable: one track over both would make the declared step
    # thread the twin's state too).
    tracks = {name: jaxoverride_nnx.track(model) for name, model in models.items()}

    def step(name: str) -> Any:
        with tracks[name]:
            return grad(models[name])

    return _pair("NNX DEQ with dropout and BatchNorm, jo.jit(jo.grad) under track",
                 lambda: step(DECLARED), lambda: step(TWIN), quick)  # fmt: skip


def run(quick: bool) -> list[Row]:
    """The three frameworks' rows; a case that cannot run says why in its row."""
    return [
        *guarded(SUITE, "Haiku DEQ with dropout and BatchNorm", _haiku, quick),
        *guarded(SUITE, "Linen DEQ with dropout and BatchNorm", _linen, quick),
        *guarded(SUITE, "NNX DEQ with dropout and BatchNorm", _nnx, quick),
    ]


if __name__ == "__main__":
    main(run)
