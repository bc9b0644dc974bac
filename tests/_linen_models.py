"""Shared helpers of the Linen adapter tests: run a model every way and compare."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def call_counter(module: Any, collection: str, name: str) -> Callable[[], jax.Array]:
    """An int32 variable ``collection``/``name`` of ``module`` (called inside its compact
    method), zero when created, and the function that adds one to it and returns the count.

    Example:
      >>> tick = call_counter(self, "counters", "n")  # in an ``@nn.compact`` method
      >>> tick()  # count.value = count.value + 1; the new count
    """
    count = module.variable(collection, name, lambda: jnp.zeros((), jnp.int32))

    def tick() -> jax.Array:
        count.value = count.value + 1
        return count.value

    return tick


def counting(
    module: Any, collection: str, name: str, fun: Callable[..., Any]
) -> Callable[..., Any]:
    """``fun``, counting its calls in ``call_counter(module, collection, name)``.

    Example:
      >>> step = counting(self, "counters", "n", nn.Dense(3))  # in an ``@nn.compact`` method
    """
    tick = call_counter(module, collection, name)

    def counted(*args: Any) -> Any:
        tick()
        return fun(*args)

    return counted


def leaves_are_arrays(tree: Any) -> bool:
    """True when no leaf of ``tree`` is a tracer (a leaked trace value)."""
    return all(not isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(tree))


def assert_trees_close(a: Any, b: Any) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


def check_init_exact(model: Any, x: Any, rngs: Any = None) -> dict[str, Any]:
    """Eager init, jitted init, init_with_output and apply (eager and jitted) agree."""
    rngs = jax.random.key(0) if rngs is None else rngs
    with jax.checking_leaks():
        variables = model.init(rngs, x)
        jitted = jax.jit(model.init)(rngs, x)
        out, with_output = model.init_with_output(rngs, x)
        applied = model.apply(variables, x)
        applied_jit = jax.jit(model.apply)(variables, x)
    assert leaves_are_arrays(variables) and leaves_are_arrays(jitted)
    assert_trees_close(variables, jitted)
    assert_trees_close(variables, with_output)
    assert_trees_close(out, applied)
    assert_trees_close(applied, applied_jit)
    return variables


def shapes(tree: Any) -> Any:
    return jax.tree.map(jnp.shape, tree)
