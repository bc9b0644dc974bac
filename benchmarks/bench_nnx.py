"""NNX adapter: ``jaxoverride.jit`` cache-hit dispatch under ``track``, side by side.

For a tiny model (a Linear and a call counter that every call increments) and a
50-layer MLP (100 arrays), one cache-hit call of a function that closes over the model:

* ``jax.jit (flat list)``: the floor, ``jax.jit`` of the same computation written as a
  pure function of the flat list of the model's arrays (returning the new counter);
* ``jo.jit + track``: ``jaxoverride.jit(lambda x: model(x))`` inside
  ``jaxoverride_nnx.track(model)``;
* ``nnx.jit``: ``nnx.jit(lambda m, x: m(x))(model, x)`` in its default (graph) mode;
* ``nnx.cached_partial``: the same ``nnx.jit`` function with the model bound by
  ``nnx.cached_partial``;
* ``nnx.jit_partial``: ``nnx.jit_partial(f, model, graph=False)``.

Targets (issue 18): ``jo.jit + track`` within 1.2x of the floor on the tiny model and
1.10x on the MLP, and at least 10x faster than default ``nnx.jit`` on the MLP.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import jaxoverride as jo
import jaxoverride_nnx
from benchmarks._harness import Row, at_least_faster, at_most, interleaved, main, ratio_rows

SUITE = "nnx"
WIDTH = 8


class Tiny(nnx.Module):
    def __init__(self) -> None:
        self.linear = nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(0))
        self.calls = nnx.Variable(jnp.array(0))

    def __call__(self, x: jax.Array) -> jax.Array:
        self.calls[...] += 1
        return self.linear(x)


class MLP(nnx.Module):
    def __init__(self, depth: int = 50) -> None:
        rngs = nnx.Rngs(0)
        self.layers = nnx.List([nnx.Linear(WIDTH, WIDTH, rngs=rngs) for _ in range(depth)])

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return x


def _tiny_floor(model: Tiny) -> tuple[Callable[..., Any], list[jax.Array]]:
    arrays = [model.linear.bias[...], model.linear.kernel[...], model.calls[...]]

    def pure(arrays: list[jax.Array], x: jax.Array) -> tuple[jax.Array, jax.Array]:
        bias, kernel, calls = arrays
        return x @ kernel + bias, calls + 1

    return jax.jit(pure), arrays


def _mlp_floor(model: MLP) -> tuple[Callable[..., Any], list[jax.Array]]:
    arrays = [a for layer in model.layers for a in (layer.kernel[...], layer.bias[...])]

    def pure(arrays: list[jax.Array], x: jax.Array) -> jax.Array:
        for kernel, bias in zip(arrays[::2], arrays[1::2], strict=True):
            x = jnp.tanh(x @ kernel + bias)
        return x

    return jax.jit(pure), arrays


def _case(
    name: str,
    model: Any,
    floor: Callable[..., Any],
    arrays: list[jax.Array],
    quick: bool,
    mlp: bool,
) -> list[Row]:
    x = jnp.ones((WIDTH,))
    ours = jo.jit(lambda x: model(x))

    def apply(m: Any, x: jax.Array) -> jax.Array:
        return m(x)

    nnx_jit = nnx.jit(apply)
    cached = nnx.cached_partial(nnx.jit(apply), model)
    partial = nnx.jit_partial(apply, model, graph=False)
    with jaxoverride_nnx.track(model):
        candidates = {
            "jax.jit (flat list)": lambda: floor(arrays, x),
            "jo.jit + track": lambda: ours(x),
            "nnx.jit": lambda: nnx_jit(model, x),
            "nnx.cached_partial": lambda: cached(x),
            "nnx.jit_partial": lambda: partial(x),
        }
        number = (20 if quick else 100) if mlp else (100 if quick else 1000)
        samples = interleaved(candidates, number=number, rounds=5 if quick else 25)
    rows = ratio_rows(
        SUITE,
        f"{name}: cache-hit call",
        samples,
        "jax.jit (flat list)",
        targets={"jo.jit + track": at_most(1.10 if mlp else 1.2)},
    )
    if mlp:
        pair = {"jo.jit + track": samples["jo.jit + track"], "nnx.jit": samples["nnx.jit"]}
        rows += ratio_rows(
            SUITE,
            f"{name}: cache-hit call",
            pair,
            "nnx.jit",
            targets={"jo.jit + track": at_least_faster(10)},
        )
    return rows


def run(quick: bool) -> list[Row]:
    tiny, mlp = Tiny(), MLP()
    return [
        *_case("tiny (Linear + counter)", tiny, *_tiny_floor(tiny), quick, mlp=False),
        *_case("MLP 50 x Linear", mlp, *_mlp_floor(mlp), quick, mlp=True),
    ]


if __name__ == "__main__":
    main(run)
