"""Neutral transforms inside bound Linen modules: state threaded, init-exact."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxoverride as jo
from _linen_models import (
    assert_trees_close,
    check_init_exact,
    counting,
    leaves_are_arrays,
)
from jaxoverride import lax as jlax

pytestmark = pytest.mark.usefixtures("linen_installed")


def dense(h: jax.Array) -> jax.Array:
    return jnp.tanh(nn.Dense(2)(h))


CASES: dict[str, Callable[[jax.Array], Any]] = {
    "vmap": lambda x: jo.vmap(dense)(x),
    "vmap_in_axes": lambda x: jo.vmap(lambda a, b: dense(a) + b, in_axes=(0, None))(x, 1.0),
    "grad": lambda x: jo.grad(lambda r: dense(r).sum())(x),
    "value_and_grad": lambda x: jo.value_and_grad(lambda r: dense(r).sum())(x),
    "grad_has_aux": lambda x: jo.grad(lambda r: (dense(r).sum(), r), has_aux=True)(x),
    "jacfwd": lambda x: jo.jacfwd(dense)(x[0]),
    "jacrev": lambda x: jo.jacrev(dense)(x[0]),
    "hessian": lambda x: jo.hessian(lambda r: dense(r).sum())(x[0]),
    "jvp": lambda x: jo.jvp(dense, (x,), (jnp.ones_like(x),)),
    "vjp": lambda x: jo.vjp(dense, x)[1](jnp.ones((x.shape[0], 2))),
    "linearize": lambda x: jo.linearize(dense, x)[1](x),
    "checkpoint": lambda x: jo.checkpoint(dense)(x),
    "remat": lambda x: jo.remat(dense)(x),
    "jit": lambda x: jo.jit(dense)(x),
    "eval_shape": lambda x: jnp.zeros(jo.eval_shape(dense, x).shape) + dense(x),
    "make_jaxpr": lambda x: (jo.make_jaxpr(dense)(x), dense(x))[1],
    "grad_of_scan": lambda x: jo.grad(
        lambda r: jlax.scan(lambda c, _: (dense(c) @ jnp.ones((2, 3)), None), r, length=2)[0].sum()
    )(x),
    "vmap_of_while": lambda x: jo.vmap(
        lambda r: jlax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, dense(c[1])), (0, r))[1]
    )(x[:, :2]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_transform_is_init_exact_and_names_as_linen(name: str):
    run = CASES[name]

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> Any:
            return run(x)

    variables = check_init_exact(Model(), jnp.arange(6.0).reshape(2, 3) / 6)
    expected = ["Dense_0", "Dense_1"] if name in ("eval_shape", "make_jaxpr") else ["Dense_0"]
    assert sorted(variables["params"]) == expected


def test_grad_inside_matches_the_explicit_gradient():
    x = jnp.arange(6.0).reshape(2, 3) / 6

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            return jo.grad(lambda r: dense(r).sum())(x)

    variables = Model().init(jax.random.key(0), x)
    kernel = variables["params"]["Dense_0"]
    expected = jax.grad(lambda r: jnp.tanh(r @ kernel["kernel"] + kernel["bias"]).sum())(x)
    assert_trees_close(Model().apply(variables, x), expected)


def test_batch_stats_written_under_vmap_must_not_depend_on_the_batch():
    class Model(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            return jo.vmap(counting(self, "counters", "n", dense))(x)

    x = jnp.ones((4, 3))
    with jax.checking_leaks():
        variables = Model().init(jax.random.key(0), x)
        _, updates = Model().apply(variables, x, mutable=["counters"])
    assert leaves_are_arrays(updates)
    # Shared across the batch, once per call (as nn.vmap with variable_axes={}).
    assert int(updates["counters"]["n"]) == int(variables["counters"]["n"]) + 1
    np.testing.assert_array_equal(variables["counters"]["n"], 1)
