"""A Linen DEQ with dropout and BatchNorm in its solver's map, and its fixed-mask twin.

Shared by ``tests/test_solve_state_linen.py`` and the fresh-interpreter script
``tests/_solve_state_linen_script.py`` (optimistix, diffrax). ``DEQ(run)`` calls
``run(f, z0)`` (a runner of ``_solve_state_solvers``) in its ``__call__``, on a map ``f``
that calls the submodule ``block``: ``nn.BatchNorm(use_running_average=False)``
(momentum 0.9), ``nn.Dropout`` (its mask recorded with ``record``), an ``nn.Dense``, and,
with ``count=True``, a ``counters`` variable incremented at each evaluation.

The twin is the same block applied on explicit variables with an explicit mask
(``twin_map``): the solver runs on it with nothing of Linen's state inside.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jaxoverride as jo
from _solve_state_solvers import record

N = 4
RATE = 0.5
X = jax.random.normal(jax.random.key(1), (3, N))
KEYS = {"params": jax.random.key(0), "dropout": jax.random.key(2)}

Run = Callable[[Callable[[jax.Array], jax.Array], jax.Array], tuple[Any, Any]]


class Block(nn.Module):
    """The map's layers; with ``keep`` the mask is given (the twin), else drawn."""

    count: bool = False
    norm: bool = True

    @nn.compact
    def __call__(self, z: jax.Array, x: jax.Array, keep: jax.Array | None = None) -> jax.Array:
        h = z
        if self.norm:
            h = nn.BatchNorm(use_running_average=False, momentum=0.9, name="bn")(z)
        if keep is None:
            # nn.Dropout on ones is its scaled mask: h * scaled is nn.Dropout(h), and the
            # mask is recorded whatever h is (h is 0 at z0 = 0).
            scaled = nn.Dropout(RATE, deterministic=False, name="drop")(jnp.ones_like(h))
            record(scaled != 0)
            h = h * scaled
        else:
            h = jnp.where(keep, h / (1.0 - RATE), 0.0)
        if self.count:
            calls = self.variable("counters", "calls", lambda: jnp.zeros((), jnp.int32))
            calls.value += 1
        return 0.3 * jnp.tanh(nn.Dense(N, name="dense")(h)) + x


class DEQ(nn.Module):
    """Solves ``z = block(z, x)`` with ``run``, under ``jo.solve_state(**declare)``
    (``declare=None``: no declaration); ``twice`` solves a second time after the first."""

    run: Run
    declare: dict[str, Any] | None = None
    count: bool = False
    twice: bool = False
    norm: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, Any]:
        block = Block(self.count, self.norm, name="block")
        f = lambda z: block(z, x)
        if self.is_initializing():
            return f(x), jnp.zeros((), jnp.int32)
        z, steps = self._solve(f, jnp.zeros_like(x))
        if self.twice:
            z, steps = self._solve(f, z)
        return z, steps

    def _solve(self, f: Callable[[jax.Array], jax.Array], z0: jax.Array) -> tuple[Any, Any]:
        if self.declare is None:
            return self.run(f, z0)
        with jo.solve_state(**self.declare):
            return self.run(f, z0)


def init(count: bool = False, norm: bool = True) -> Any:
    """The variables (params, batch_stats with ``norm``, counters with ``count``)."""
    return DEQ(lambda f, z: (f(z), 0), count=count, norm=norm).init(KEYS, X)


def apply(
    model: DEQ, variables: Any, key: jax.Array, mutable: tuple[str, ...] = ("batch_stats",)
) -> tuple[tuple[jax.Array, Any], Any]:
    """``model.apply`` with the dropout key ``key``; returns ``((z, steps), updates)``."""
    return model.apply(variables, X, rngs={"dropout": key}, mutable=list(mutable))


def mask_of(seen: bytes) -> jax.Array:
    """A recorded mask as an array."""
    return jnp.asarray(np.frombuffer(seen, dtype=bool).reshape(X.shape))


def twin_map(params: Any, variables: Any, keep: jax.Array) -> Callable[[jax.Array], jax.Array]:
    """The block on explicit ``params`` and ``variables``' statistics, with mask ``keep``."""
    if "batch_stats" not in variables:
        bare = {"params": params["block"]}
        return lambda z: cast(jax.Array, Block(norm=False).apply(bare, z, X, keep))
    stats = {"params": params["block"], "batch_stats": variables["batch_stats"]["block"]}
    return lambda z: Block().apply(stats, z, X, keep, mutable=["batch_stats"])[0]


def twin_statistics(variables: Any, z: jax.Array, keep: jax.Array) -> Any:
    """The running statistics after one update with the batch statistics at ``z``."""
    stats = {
        "params": variables["params"]["block"],
        "batch_stats": variables["batch_stats"]["block"],
    }
    return Block().apply(stats, z, X, keep, mutable=["batch_stats"])[1]["batch_stats"]


def largest(a: Any, b: Any) -> float:
    """The largest absolute difference between two trees of arrays."""
    diffs = jax.tree.map(lambda u, v: float(jnp.max(jnp.abs(jnp.asarray(u) - v))), a, b)
    return max(jax.tree.leaves(diffs), default=0.0)
