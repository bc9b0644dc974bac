"""Mutable collections and rng streams through neutral loops inside Linen modules."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import errors as flax_errors

from _linen_models import assert_trees_close, call_counter, leaves_are_arrays, shapes
from jaxoverride import lax as jlax

pytestmark = pytest.mark.usefixtures("linen_installed")


class Stateful(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> Any:
        norm = nn.BatchNorm(use_running_average=not train)

        def body(h: jax.Array, _: Any) -> Any:
            h = norm(nn.Dense(3)(h))
            key = self.make_rng("dropout") if train else jax.random.key(0)
            return h, jax.random.key_data(key)

        return jlax.scan(body, x, length=3)


RNGS = {"params": jax.random.key(0), "dropout": jax.random.key(1)}


def _apply(variables: Any, x: jax.Array) -> Any:
    return Stateful().apply(
        variables, x, mutable=["batch_stats"], rngs={"dropout": RNGS["dropout"]}
    )


def test_batch_stats_come_out_once_per_call_eager_and_jitted():
    x = jnp.arange(12.0).reshape(4, 3)
    with jax.checking_leaks():
        variables = Stateful().init(RNGS, x)
        (out, keys), updates = _apply(variables, x)
        (out_jit, keys_jit), updates_jit = jax.jit(_apply)(variables, x)
    assert sorted(variables) == ["batch_stats", "params"]
    assert leaves_are_arrays(updates)
    assert shapes(updates) == {"batch_stats": shapes(variables["batch_stats"])}
    assert_trees_close((out, keys, updates), (out_jit, keys_jit, updates_jit))
    # The running statistics moved three times (once per iteration).
    assert not np.allclose(updates["batch_stats"]["BatchNorm_0"]["mean"], 0.0)


def test_batch_stats_accumulate_like_the_unrolled_loop():
    x = jnp.arange(12.0).reshape(4, 3)

    class Unrolled(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            norm, dense = nn.BatchNorm(use_running_average=False), nn.Dense(3)
            for _ in range(3):
                x = norm(dense(x))
            return x

    class Looped(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            norm, dense = nn.BatchNorm(use_running_average=False), nn.Dense(3)
            return jlax.fori_loop(0, 3, lambda i, h: norm(dense(h)), x)

    variables = Unrolled().init(jax.random.key(0), x)
    renamed = jax.tree.map(lambda a: a, variables)
    expected = Unrolled().apply(variables, x, mutable=["batch_stats"])
    got = Looped().apply(renamed, x, mutable=["batch_stats"])
    assert_trees_close(got, expected)


def test_rng_gives_a_fresh_key_per_step_and_the_same_keys_for_the_same_rngs():
    x = jnp.ones((2, 3))
    variables = Stateful().init(RNGS, x)
    (_, keys), _ = _apply(variables, x)
    (_, again), _ = jax.jit(_apply)(variables, x)
    assert len({tuple(np.asarray(k)) for k in keys}) == 3
    np.testing.assert_array_equal(keys, again)
    (_, keys_init), _ = Stateful().init_with_output(RNGS, x)
    np.testing.assert_array_equal(keys, keys_init)


def test_writing_an_immutable_collection_raises_linens_error_and_restores_everything():
    x = jnp.ones((2, 3))
    variables = Stateful().init(RNGS, x)
    with pytest.raises(flax_errors.ModifyScopeVariableError):
        Stateful().apply(variables, x, rngs={"dropout": RNGS["dropout"]})
    # Nothing was left half-written: the variables are unchanged and usable.
    assert leaves_are_arrays(variables)
    Stateful().apply(variables, x, train=False)


class Sow(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        def body(h: jax.Array, _: Any) -> Any:
            h = nn.Dense(3)(h)
            self.sow("intermediates", "h", h)
            return h, None

        return jlax.scan(body, x, length=3)[0]


def test_a_sow_inside_a_body_comes_out_once_per_call_eager_and_jitted():
    x = jnp.arange(3.0).reshape(1, 3)
    apply = lambda v, x: Sow().apply(v, x, mutable=["intermediates"])
    with jax.checking_leaks():
        variables = Sow().init(jax.random.key(0), x)
        out, state = apply(variables, x)
        out_jit, state_jit = jax.jit(apply)(variables, x)
    assert sorted(variables) == ["params"]  # init leaves intermediates out, as Linen does
    assert leaves_are_arrays(state)
    # One sown value per call (the last iteration's), not one per trace or iteration.
    assert shapes(state) == {"intermediates": {"h": ((1, 3),)}}
    np.testing.assert_allclose(state["intermediates"]["h"][0], out, rtol=1e-6)
    assert_trees_close((out, state), (out_jit, state_jit))


def test_a_cond_fun_that_writes_state_runs_as_python_would():
    class Counts(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            tick = call_counter(self, "counts", "n")

            def cond(h: jax.Array) -> jax.Array:
                return tick() < 4

            return jlax.while_loop(cond, lambda h: nn.Dense(1)(h), x)

    x = jnp.ones((1, 1))
    with jax.checking_leaks():
        variables = Counts().init(jax.random.key(0), x)
        out, state = Counts().apply(variables, x, mutable=["counts"])
        out_jit, state_jit = jax.jit(lambda v: Counts().apply(v, x, mutable=["counts"]))(variables)
    start = int(variables["counts"]["n"])
    # cond, body, cond, body, ...: cond runs once more than the body (init: 4 conds,
    # 3 bodies; apply from there: one cond that stops the loop).
    assert start == 4 and int(state["counts"]["n"]) == 5
    assert_trees_close((out, state), (out_jit, state_jit))
