"""Every neutral function x {counter, BatchNorm, Dropout+Rngs, shared submodule} x
{called eagerly, called inside ``jaxoverride.jit``}, against eager Python.

Each cell runs a callback that reads and writes closure-captured NNX modules through a
neutral function, twice, under ``jax.checking_leaks()``, and compares the outputs and
every Variable afterwards (counts, BatchNorm statistics, RNG counters and keys) with a
reference that runs the same computation step by step in plain Python on identically
built modules. Derivatives in the reference come from JAX applied to a pure function
that rebuilds the modules with ``nnx.merge``; state in the reference always comes from
calling the modules eagerly, once per time the callback runs.

``vmap`` broadcasts tracked state: every example starts from the same state and the
state must end the same for all of them, so the reference runs each example on a copy
of the incoming state. For BatchNorm, whose statistics depend on the batch, the
vmapped model reduces over the mapped axis (``axis_name``) and the reference applies
an ordinary BatchNorm to the whole batch.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxoverride as jo
import jaxoverride_nnx
from _nnx_models import (
    FEATURES,
    KINDS,
    Kind,
    Normed,
    assert_close,
    assert_same_state,
    leaves,
)
from jaxoverride import lax as jlax

BATCH, STEPS = 4, 3


@pytest.fixture(autouse=True, scope="module")
def _frozen_heap():
    """Make ``jax.checking_leaks`` affordable: its ``gc.collect()`` after every trace
    then scans only objects created by these tests, not the whole JAX/Flax heap. (A
    tracer leaked into an object older than this module would go unnoticed.)"""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


X = jnp.linspace(-1.0, 1.0, BATCH * FEATURES).reshape(BATCH, FEATURES)
XS = jnp.stack([X * (t + 1) * 0.3 for t in range(STEPS)])


def functional(models: tuple[nnx.Module, ...], apply: Callable[..., Any]) -> Callable[..., Any]:
    """``x -> apply(copy of models, x)``, pure: the copy is rebuilt inside every trace."""
    graphdef, state = nnx.split(models)
    return lambda x: apply(nnx.merge(graphdef, state, copy=True), x)


# A case: (ours, reference). ``ours(models, apply, x, *extra)`` uses neutral functions;
# ``reference(models, apply, x, *extra)`` is eager Python on its own models.
Case = tuple[Callable[..., Any], Callable[..., Any]]


def _derivative(neutral: Callable[..., Any], jax_version: Callable[..., Any], scalar: bool) -> Case:
    def wrap(apply: Callable[..., Any]) -> Callable[..., Any]:
        return (lambda ms, x: apply(ms, x).sum()) if scalar else apply

    def ours(models, apply, x):
        f = wrap(apply)
        return neutral(lambda x: f(models, x))(x)

    def reference(models, apply, x):
        f = wrap(apply)
        # JAX's transform of the pure function (jitted: one compilation instead of one
        # per primitive); the state: one eager call, as the transform traces f once.
        out = jax.jit(jax_version(functional(models, f)))(x)
        f(models, x)
        return out

    return ours, reference


def _vmap_ours(models, apply, x):
    return jo.vmap(lambda e: apply(models, e))(x)


def _vmap_reference(models, apply, x):
    graphdef, start = nnx.split(models)
    outs, ends = [], []
    for example in x:
        copy = nnx.merge(graphdef, start, copy=True)
        outs.append(apply(copy, example))
        ends.append(nnx.state(copy))
    for end in ends[1:]:
        assert_same_state(end, ends[0])
    nnx.update(models, ends[0])
    return jnp.stack(outs)


def _checkpoint_ours(models, apply, x):
    def loss(x):
        return jo.checkpoint(lambda y: apply(models, y))(x).sum()

    return jo.value_and_grad(loss)(x)


def _checkpoint_reference(models, apply, x):
    out = jax.jit(jax.value_and_grad(lambda x: functional(models, apply)(x).sum()))(x)
    apply(models, x)
    return out


def _zeros(shapes: Any) -> Any:
    # ShapeDtypeStructs cannot leave a jit; arrays of those shapes can.
    return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _eval_shape_ours(models, apply, x):
    return _zeros(jo.eval_shape(lambda x: apply(models, x), x))


def _eval_shape_reference(models, apply, x):
    return _zeros(jax.eval_shape(functional(models, apply), x))  # the state is untouched


def _scan_ours(models, apply, x, xs):
    return jlax.scan(lambda c, xt: (apply(models, c) * 0.5 + xt, c.sum()), x, xs)


def _scan_reference(models, apply, x, xs):
    carry, ys = x, []
    for xt in xs:
        carry, y = apply(models, carry) * 0.5 + xt, carry.sum()
        ys.append(y)
    return carry, jnp.stack(ys)


def _while_ours(models, apply, x):
    return jlax.while_loop(
        lambda s: s[1] < STEPS, lambda s: (apply(models, s[0]) * 0.5 + 1.0, s[1] + 1), (x, 0)
    )


def _while_reference(models, apply, x):
    value, i = x, 0
    while i < STEPS:
        value, i = apply(models, value) * 0.5 + 1.0, i + 1
    return value, jnp.asarray(i)


def _fori_ours(models, apply, x):
    return jlax.fori_loop(0, STEPS, lambda i, c: apply(models, c) * 0.5 + i, x)


def _fori_reference(models, apply, x):
    for i in range(STEPS):
        x = apply(models, x) * 0.5 + i
    return x


def _cond_ours(models, apply, x, pred):
    return jlax.cond(pred, lambda c: apply(models, c), lambda c: apply(models, c * 2.0) - 1.0, x)


def _cond_reference(models, apply, x, pred):
    return apply(models, x) if pred else apply(models, x * 2.0) - 1.0


_BRANCHES = (
    lambda models, apply, c: apply(models, c),
    lambda models, apply, c: c * 3.0,
    lambda models, apply, c: apply(models, apply(models, c)),
)


def _switch_ours(models, apply, x, index):
    branches = [lambda c, b=b: b(models, apply, c) for b in _BRANCHES]
    return jlax.switch(index, branches, x)


def _switch_reference(models, apply, x, index):
    return _BRANCHES[index](models, apply, x)


def _map_ours(models, apply, x):
    return jlax.map(lambda e: apply(models, e), x)


def _map_reference(models, apply, x):
    return jnp.stack([apply(models, e) for e in x])


CASES: dict[str, Case] = {
    "jit": (
        lambda ms, apply, x: jo.jit(lambda x: apply(ms, x))(x),
        lambda ms, apply, x: apply(ms, x),
    ),
    "vmap": (_vmap_ours, _vmap_reference),
    "grad": _derivative(jo.grad, jax.grad, scalar=True),
    "value_and_grad": _derivative(jo.value_and_grad, jax.value_and_grad, scalar=True),
    "jacfwd": _derivative(jo.jacfwd, jax.jacfwd, scalar=False),
    "jacrev": _derivative(jo.jacrev, jax.jacrev, scalar=False),
    "hessian": _derivative(jo.hessian, jax.hessian, scalar=True),
    "checkpoint": (_checkpoint_ours, _checkpoint_reference),
    "eval_shape": (_eval_shape_ours, _eval_shape_reference),
    "lax.scan": (_scan_ours, _scan_reference),
    "lax.while_loop": (_while_ours, _while_reference),
    "lax.fori_loop": (_fori_ours, _fori_reference),
    "lax.cond": (_cond_ours, _cond_reference),
    "lax.switch": (_switch_ours, _switch_reference),
    "lax.map": (_map_ours, _map_reference),
}

# Extra arguments of the two calls each cell makes (the second call may hit a cache).
EXTRA: dict[str, tuple[tuple[Any, ...], tuple[Any, ...]]] = {
    "lax.scan": ((XS,), (XS[::-1],)),
    "lax.cond": ((True,), (False,)),
    "lax.switch": ((2,), (0,)),
}


EAGER_ONCE = {"grad", "value_and_grad", "jacfwd", "jacrev", "hessian", "checkpoint"}


def _vmap_batchnorm(inside_jit: bool) -> None:
    """BatchNorm under vmap: reduce over the mapped axis; compare with a whole-batch BN."""
    ours_model, reference_model = Normed(axis_name="batch"), Normed()

    def call(x):
        return jo.vmap(ours_model, axis_name="batch")(x)

    run = jo.jit(call) if inside_jit else call
    with jax.checking_leaks(), jaxoverride_nnx.track(ours_model):
        outs = [run(X), run(X * 2.0)]
    expected = [reference_model(X), reference_model(X * 2.0)]
    assert_close(outs, expected, rtol=1e-4, atol=1e-5)
    assert_same_state(ours_model, reference_model, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("inside_jit", [False, True], ids=["eager", "in_jit"])
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("name", list(CASES))
def test_cell(name: str, kind: str, inside_jit: bool):
    if name == "vmap" and kind == "batchnorm":
        _vmap_batchnorm(inside_jit)
        return
    spec: Kind = KINDS[kind]
    ours, reference = CASES[name]
    models, reference_models = spec.build(), spec.build()
    extras = EXTRA.get(name, ((), ()))
    inputs = [X, X * 0.5 - 0.2]
    if name in EAGER_ONCE and not inside_jit:
        # Eager differentiation under checking_leaks recompiles every backward-pass
        # primitive on every call (JAX does not cache them there): one call keeps the
        # cell affordable; state continuity across calls is covered by the other cells.
        extras, inputs = extras[:1], inputs[:1]

    def call(x, *extra):
        return ours(models, spec.apply, x, *extra)

    run = jo.jit(call) if inside_jit else call
    with jax.checking_leaks(), jaxoverride_nnx.track(*models):
        outs = [run(x, *extra) for x, extra in zip(inputs, extras, strict=True)]
    expected = [
        reference(reference_models, spec.apply, x, *extra)
        for x, extra in zip(inputs, extras, strict=True)
    ]
    assert jax.tree_util.tree_structure(outs) == jax.tree_util.tree_structure(expected)
    assert [(o.shape, o.dtype) for o in jax.tree_util.tree_leaves(outs)] == [
        (e.shape, e.dtype) for e in jax.tree_util.tree_leaves(expected)
    ]
    # Hessians of BatchNorm reach ~30 with entries near 1e-5: compare on that scale.
    atol = 1e-3 if name == "hessian" else 1e-5
    assert_close(outs, expected, rtol=1e-4, atol=atol)
    assert_same_state(models, reference_models, rtol=1e-4, atol=1e-5)
    if kind == "shared":
        assert models[0].shared is models[1].shared
    if name != "eval_shape":
        # The state really moved (the comparison above is not vacuous).
        moved = leaves(nnx.state(models, nnx.Not(nnx.Param)))
        initial = leaves(nnx.state(spec.build(), nnx.Not(nnx.Param)))
        assert not all(np.array_equal(a, b) for a, b in zip(moved, initial, strict=True))
