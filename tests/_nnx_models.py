"""Small NNX models with state, shared by the ``test_nnx_*`` files.

Each *kind* builds fresh, identically initialised modules (``build``) and a callback
``apply(models, x)`` that reads and writes them. ``state(models)`` and
``assert_same_state`` compare everything the modules hold, RNG keys included.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

FEATURES = 3


class Counter(nnx.Module):
    """Counts its calls; a smooth nonlinear map so that every derivative is nonzero."""

    def __init__(self, seed: int = 0):
        key = jax.random.key(seed)
        self.w = nnx.Param(jax.random.normal(key, (FEATURES,)) * 0.5 + 1.0)
        self.count = nnx.Variable(jnp.array(0))

    def __call__(self, x: jax.Array) -> jax.Array:
        self.count[...] += 1
        return jnp.sin(x * self.w[...]) + 0.1 * self.count[...]


class Normed(nnx.Module):
    """A BatchNorm that updates its running statistics, after a scaling Param."""

    def __init__(self, axis_name: str | None = None):
        self.w = nnx.Param(jnp.linspace(0.5, 1.5, FEATURES))
        self.norm = nnx.BatchNorm(
            FEATURES,
            use_running_average=False,
            momentum=0.8,
            axis_name=axis_name,
            use_scale=False,
            use_bias=False,
            rngs=nnx.Rngs(1),
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.norm(x * self.w[...])


class Dropped(nnx.Module):
    """A scaling Param followed by Dropout that draws from its own ``nnx.Rngs`` stream."""

    def __init__(self):
        self.w = nnx.Param(jnp.linspace(-1.0, 1.0, FEATURES))
        self.dropout = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=3))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.dropout(jnp.sin(x * self.w[...]))


class Branch(nnx.Module):
    """Holds a submodule that another ``Branch`` holds too."""

    def __init__(self, shared: Counter, seed: int):
        self.shared = shared
        self.own = Counter(seed)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.shared(self.own(x))


@dataclass(frozen=True)
class Kind:
    name: str
    build: Callable[[], tuple[nnx.Module, ...]]
    apply: Callable[[tuple[nnx.Module, ...], jax.Array], jax.Array]


def _shared() -> tuple[nnx.Module, ...]:
    shared = Counter(7)
    return Branch(shared, 8), Branch(shared, 9)


KINDS = {
    "counter": Kind("counter", lambda: (Counter(),), lambda ms, x: ms[0](x)),
    "batchnorm": Kind("batchnorm", lambda: (Normed(),), lambda ms, x: ms[0](x)),
    "dropout": Kind("dropout", lambda: (Dropped(),), lambda ms, x: ms[0](x)),
    "shared": Kind("shared", _shared, lambda ms, x: ms[0](x) + ms[1](x)),
}


def jit_over_a_cell(module: Any) -> tuple[Any, Callable[[Any], None]]:
    """A ``jaxoverride.jit`` of ``lambda x: model(x)`` whose closure cell ``model`` holds
    ``module``, and the function that rebinds that cell, as a program's ``model = other``
    after building the jit does.

    Example:
      >>> apply, rebind = jit_over_a_cell(first)
      >>> rebind(second)  # apply(x) now reads second
    """
    import jaxoverride as jo

    model = module
    jitted = jo.jit(lambda x: model(x))

    def rebind(other: Any) -> None:
        nonlocal model
        model = other

    return jitted, rebind


def identity_with_jvp(custom_jvp: Any, rule: Callable[[Any, Any], Any]) -> Any:
    """The identity ``f(x) = x`` as a ``custom_jvp`` (``jax.custom_jvp`` or
    ``jaxoverride.custom_jvp``) whose JVP is ``rule(primals, tangents)``.

    Example:
      >>> f = identity_with_jvp(jo.custom_jvp, lambda p, t: (p[0], 2 * t[0]))
    """

    @custom_jvp
    def f(x):
        return x

    f.defjvp(rule)
    return f


def leaves(models: Any) -> list[np.ndarray]:
    """Every Variable value in ``models`` (graph order), keys as their raw data."""
    out = []
    for leaf in jax.tree_util.tree_leaves(nnx.state(models)):
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        out.append(np.asarray(leaf))
    return out


def assert_same_state(ours: Any, reference: Any, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    mine, theirs = leaves(ours), leaves(reference)
    assert len(mine) == len(theirs)
    for a, b in zip(mine, theirs, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (a, b)
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


def assert_close(ours: Any, reference: Any, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol),
        ours,
        reference,
    )
