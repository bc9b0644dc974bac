"""Differential parity of the neutral transforms and calls (``jo.jit`` ... ``jo.eval_shape``).

Same harness as ``test_parity_lax``: every case runs through JAX and jaxoverride, idle and
under pass-through overrides, and must give the same outputs, jaxprs and derivatives.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import _parity
import jaxoverride as jo
from _parity import (
    JAX,
    Case,
    active,
    assert_same,
    f32,
    fresh_jax_caches_per_module,  # noqa: F401 - an autouse fixture
    mesh8,
)


def g(x):
    return jnp.sin(x) * x


def g_scalar(x):
    return jnp.sum(jnp.sin(x) * x)


def g2(x, y):
    return jnp.tanh(x * y) + y


def g2_scalar(x, y):
    return jnp.sum(jnp.tanh(x * y) + y**2)


def g3_scalar(x, y, z):
    return jnp.sum(x * jnp.cos(y) + z**3)


def with_aux(x):
    return jnp.sum(x**2), {"norm": jnp.linalg.norm(x), "n": 3}


def vector_with_aux(x):
    return jnp.sin(x) * 2.0, x.sum()


def power(x, n):
    out = x
    for _ in range(n - 1):
        out = out * x
    return out


def mlp(x, w1, w2):
    return jnp.sum(jnp.tanh(jnp.tanh(x @ w1) @ w2))


def normalise(x):
    return x / jax.lax.psum(jnp.abs(x).sum(), "i")


def shard_body(x):
    return jax.lax.psum(jnp.sin(x).sum(0), "x")


def shard_body_two(x, w):
    return jnp.tanh(x * w)


def sharded(x, spec=None):
    """Eager shard_map in JAX 0.10 wants its inputs already laid out as in_specs says."""
    return jax.device_put(x, NamedSharding(mesh8(), P("x") if spec is None else spec))


def matrices():
    return f32(4, 3), f32(3, 3, offset=0.2), f32(3, 2, offset=-0.1)


def transformed_case(
    id: str,
    uses: str,
    transform: Callable[[Any], Any],
    fun: Callable[..., Any],
    shape: tuple[int, ...] = (3,),
    **options: Any,
) -> Case:
    """``transform(api)(fun, **options)(x)`` over an x of ``shape``, for the cases that differ
    only in the transform (``lambda api: api.grad``), the function and the options."""
    return Case(
        id,
        lambda api, x: transform(api)(fun, **options)(x),
        lambda: (f32(*shape),),
        (uses,),
    )


def axis_name_case(uses: str, mapping: Callable[[Any], Any], shape: tuple[int, int]) -> Case:
    """``normalise`` mapped over xs of ``shape`` by ``mapping(api)`` (``api.vmap``,
    ``api.pmap``) with ``axis_name="i"``: its psum is a collective over the mapped axis."""
    return transformed_case(f"{uses}-axis-name", uses, mapping, normalise, shape, axis_name="i")


CASES = [
    # --- jit ----------------------------------------------------------------------------
    Case("jit", lambda api, x: api.jit(g)(x), lambda: (f32(5),), ("jit",)),
    Case(
        "jit-static-argnums",
        lambda api, x: api.jit(power, static_argnums=1)(x, 3),
        lambda: (f32(4),),
        ("jit",),
    ),
    Case(
        "jit-static-argnums-negative",
        lambda api, x: api.jit(power, static_argnums=-1)(x, 2),
        lambda: (f32(4),),
        ("jit",),
    ),
    Case(
        "jit-static-argnames",
        lambda api, x: api.jit(power, static_argnames="n")(x, n=3),
        lambda: (f32(4),),
        ("jit",),
    ),
    Case(
        "jit-static-argnames-positional-use",
        lambda api, x: api.jit(power, static_argnames=("n",))(x, 2),
        lambda: (f32(4),),
        ("jit",),
    ),
    Case(
        "jit-donate-argnums",
        lambda api, x: api.jit(g, donate_argnums=0)(jnp.array(x)),
        lambda: (f32(6),),
        ("jit",),
    ),
    Case(
        "jit-donate-argnames",
        lambda api, x: api.jit(g2, donate_argnames="y")(x, jnp.array(x)),
        lambda: (f32(6),),
        ("jit",),
    ),
    Case(
        "jit-shardings",
        lambda api, x: api.jit(
            g,
            in_shardings=NamedSharding(mesh8(), P("x")),
            out_shardings=NamedSharding(mesh8(), P()),
        )(x),
        lambda: (f32(8, 2),),
        ("jit",),
    ),
    Case(
        "jit-keep-unused-inline",
        lambda api, x, y: api.jit(lambda a, b: a * 2, keep_unused=True, inline=True)(x, y),
        lambda: (f32(3), f32(3)),
        ("jit",),
    ),
    Case(
        "jit-decorator-with-options",
        lambda api, x: api.jit(static_argnums=1)(power)(x, 2),
        lambda: (f32(4),),
        ("jit",),
    ),
    Case(
        "jit-kwargs-call",
        lambda api, x, y: api.jit(g2)(y=y, x=x),
        lambda: (f32(3), f32(3, offset=1)),
        ("jit",),
        argnums=(0, 1),
    ),
    Case(
        "jit-nested",
        lambda api, x: api.jit(lambda v: api.jit(g)(v) + 1.0)(x),
        lambda: (f32(3),),
        ("jit",),
    ),
    Case(
        "jit-vmap-grad-composition",
        lambda api, xs: api.jit(api.vmap(api.grad(g_scalar)))(xs),
        lambda: (f32(4, 3),),
        ("jit", "vmap", "grad"),
    ),
    Case(
        "jit-of-scan",
        lambda api, c, xs: api.jit(lambda c, xs: api.lax.scan(lambda c, x: (c * x + 1, c), c, xs))(
            c, xs
        ),
        lambda: (f32(2), f32(3, 2)),
        ("jit", "lax.scan"),
        argnums=(0, 1),
    ),
    # --- vmap ---------------------------------------------------------------------------
    Case("vmap", lambda api, xs: api.vmap(g)(xs), lambda: (f32(4, 3),), ("vmap",)),
    Case(
        "vmap-in-out-axes",
        lambda api, xs, y: api.vmap(g2, in_axes=(1, None), out_axes=1)(xs, y),
        lambda: (f32(3, 4), f32(3)),
        ("vmap",),
        argnums=(0, 1),
    ),
    axis_name_case("vmap", lambda api: api.vmap, (5, 2)),
    Case(
        "vmap-axis-size",
        lambda api, x: api.vmap(lambda v: v * 2.0, in_axes=None, axis_size=3)(x),
        lambda: (f32(2),),
        ("vmap",),
    ),
    Case(
        "vmap-keyword-arguments",
        lambda api, xs, ys: api.vmap(g2)(xs, y=ys),
        lambda: (f32(4, 2), f32(4, 2, offset=1)),
        ("vmap",),
        argnums=(0, 1),
    ),
    Case(
        "vmap-nested-dict-axes",
        lambda api, a, b: api.vmap(
            api.vmap(lambda t: t["a"] * t["b"], in_axes=({"a": 0, "b": None},)),
            in_axes=({"a": 1, "b": 0},),
        )({"a": a, "b": b}),
        lambda: (f32(3, 2), f32(2, offset=0.5)),
        ("vmap",),
        argnums=(0, 1),
    ),
    # --- pmap on 8 CPU devices ----------------------------------------------------------
    axis_name_case("pmap", lambda api: api.pmap, (8, 3)),
    Case(
        "pmap-in-axes-static-broadcast",
        lambda api, x, y: api.pmap(
            lambda a, n, b: power(a, n) + b, in_axes=(0, None, 1), static_broadcasted_argnums=1
        )(x, 2, y),
        lambda: (f32(8, 2), f32(2, 8)),
        ("pmap",),
        argnums=(0, 1),
    ),
    Case(
        "pmap-out-axes", lambda api, x: api.pmap(g, out_axes=1)(x), lambda: (f32(8, 2),), ("pmap",)
    ),
    # --- grad family --------------------------------------------------------------------
    Case("grad", lambda api, x: api.grad(g_scalar)(x), lambda: (f32(4),), ("grad",)),
    Case(
        "grad-fun-keyword", lambda api, x: api.grad(fun=g_scalar)(x), lambda: (f32(4),), ("grad",)
    ),
    Case(
        "grad-argnums-tuple",
        lambda api, x, y, z: api.grad(g3_scalar, argnums=(0, 2))(x, y, z),
        lambda: (f32(3), f32(3, offset=1), f32(3, offset=2)),
        ("grad",),
        argnums=(0, 1, 2),
    ),
    Case(
        "grad-argnums-int",
        lambda api, x, y: api.grad(g2_scalar, 1)(x, y),
        lambda: (f32(3), f32(3, offset=1)),
        ("grad",),
        argnums=(0, 1),
    ),
    transformed_case("grad-has-aux", "grad", lambda api: api.grad, with_aux, has_aux=True),
    Case(
        "grad-allow-int",
        lambda api, x, n: api.grad(lambda a, k: jnp.sum(a * k), argnums=(0, 1), allow_int=True)(
            x, n
        ),
        lambda: (f32(3), np.int32(2)),
        ("grad",),
    ),
    Case(
        "value_and_grad-has-aux-argnums",
        lambda api, x, y: api.value_and_grad(
            lambda a, b: (g2_scalar(a, b), a.sum()), argnums=(0, 1), has_aux=True
        )(x, y),
        lambda: (f32(3), f32(3, offset=1)),
        ("value_and_grad",),
        argnums=(0, 1),
    ),
    # Eager forward-over-reverse runs dozens of tiny eager ops, each compiled again per
    # active stack (the stack is part of jax.jit's cache key): these run under jax.jit.
    Case("jacfwd", lambda api, x: jax.jit(api.jacfwd(g))(x), lambda: (f32(3),), ("jacfwd",)),
    Case(
        "jacfwd-argnums-has-aux",
        lambda api, x, y: jax.jit(
            api.jacfwd(lambda a, b: (g2(a, b), b.sum()), argnums=(0, 1), has_aux=True)
        )(x, y),
        lambda: (f32(3), f32(3, offset=1)),
        ("jacfwd",),
        diff=None,
    ),
    Case("jacrev", lambda api, x: jax.jit(api.jacrev(g))(x), lambda: (f32(3),), ("jacrev",)),
    Case(
        "jacrev-has-aux",
        lambda api, x: jax.jit(api.jacrev(vector_with_aux, has_aux=True))(x),
        lambda: (f32(3),),
        ("jacrev",),
    ),
    Case(
        "hessian", lambda api, x: jax.jit(api.hessian(g_scalar))(x), lambda: (f32(3),), ("hessian",)
    ),
    Case(
        "hessian-argnums",
        lambda api, x, y: jax.jit(api.hessian(g2_scalar, argnums=(0, 1)))(x, y),
        lambda: (f32(2), f32(2, offset=1)),
        ("hessian",),
        diff=None,
    ),
    # --- checkpoint / remat -------------------------------------------------------------
    Case(
        "checkpoint-policy",
        lambda api, x, w1, w2: api.checkpoint(
            mlp, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        )(x, w1, w2),
        matrices,
        ("checkpoint",),
        argnums=(0, 1, 2),
    ),
    Case(
        "checkpoint-static-argnums",
        lambda api, x: api.checkpoint(
            lambda a, n: jnp.sum(power(jnp.sin(a), n)), static_argnums=(1,)
        )(x, 3),
        lambda: (f32(3),),
        ("checkpoint",),
    ),
    transformed_case(
        "checkpoint-prevent-cse-false",
        "checkpoint",
        lambda api: api.checkpoint,
        g_scalar,
        prevent_cse=False,
    ),
    Case(
        "remat-policy",
        lambda api, x, w1, w2: api.remat(mlp, policy=jax.checkpoint_policies.nothing_saveable)(
            x, w1, w2
        ),
        matrices,
        ("remat",),
        argnums=(0, 1, 2),
    ),
    Case(
        "checkpoint-inside-scan",
        lambda api, c, xs: api.lax.scan(api.checkpoint(lambda c, x: (jnp.sin(c * x), c)), c, xs),
        lambda: (f32(2), f32(3, 2)),
        ("checkpoint", "lax.scan"),
        argnums=(0, 1),
    ),
    # --- shard_map on the 8-device CPU mesh ---------------------------------------------
    Case(
        "shard_map",
        lambda api, x: api.shard_map(shard_body, mesh=mesh8(), in_specs=P("x"), out_specs=P())(x),
        lambda: (sharded(f32(8, 3)),),
        ("shard_map",),
    ),
    Case(
        "shard_map-decorator-form",
        lambda api, x, w: api.shard_map(mesh=mesh8(), in_specs=(P("x"), P()), out_specs=P("x"))(
            shard_body_two
        )(x, w),
        lambda: (sharded(f32(16, 2)), sharded(f32(2, offset=0.3), P())),
        ("shard_map",),
        argnums=(0, 1),
    ),
    Case(
        "shard_map-check-vma-false",
        lambda api, x: api.shard_map(
            lambda v: v * 2.0, mesh=mesh8(), in_specs=P("x"), out_specs=P("x"), check_vma=False
        )(x),
        lambda: (sharded(f32(8, 2)),),
        ("shard_map",),
    ),
    # --- calls --------------------------------------------------------------------------
    Case(
        "jvp",
        lambda api, x, t: api.jvp(g, (x,), (t,)),
        lambda: (f32(3), f32(3, offset=0.5)),
        ("jvp",),
        argnums=(0, 1),
    ),
    Case(
        "jvp-has-aux",
        lambda api, x, t: api.jvp(vector_with_aux, (x,), (t,), has_aux=True),
        lambda: (f32(3), f32(3, offset=0.5)),
        ("jvp",),
        argnums=(0, 1),
    ),
    Case(
        "vjp",
        lambda api, x, y: (lambda out: (out[0], out[1](jnp.ones_like(out[0]))))(api.vjp(g2, x, y)),
        lambda: (f32(3), f32(3, offset=1)),
        ("vjp",),
        argnums=(0, 1),
    ),
    Case(
        "vjp-has-aux",
        lambda api, x: (lambda out: (out[0], out[1](jnp.ones(3)), out[2]))(
            api.vjp(vector_with_aux, x, has_aux=True)
        ),
        lambda: (f32(3),),
        ("vjp",),
    ),
    Case(
        "linearize",
        lambda api, x, t: (lambda out: (out[0], out[1](t)))(api.linearize(g, x)),
        lambda: (f32(3), f32(3, offset=0.5)),
        ("linearize",),
        argnums=(0, 1),
    ),
    Case(
        "linearize-has-aux",
        lambda api, x: (lambda out: (out[0], out[1](x), out[2]))(
            api.linearize(vector_with_aux, x, has_aux=True)
        ),
        lambda: (f32(3),),
        ("linearize",),
    ),
    Case(
        "eval_shape",
        lambda api, x, y: api.eval_shape(g2, x, y=y),
        lambda: (f32(3, 2), f32(2)),
        ("eval_shape",),
        diff=None,
        jaxpr=False,
    ),
    Case(
        "eval_shape-pytree-and-sds",
        lambda api, x: api.eval_shape(
            lambda t: {"a": t[0] @ t[1], "b": t[0].sum()},
            (jax.ShapeDtypeStruct((2, 5), jnp.float16), x),
        ),
        lambda: (f32(5, 3),),
        ("eval_shape",),
        diff=None,
        jaxpr=False,
    ),
    Case(
        "eval_shape-under-trace",
        lambda api, x: jnp.zeros(api.eval_shape(g, x).shape) + x,
        lambda: (f32(3),),
        ("eval_shape",),
    ),
]


def test_every_neutral_transform_and_call_has_a_case():
    from test_parity_rules import CASES as RULE_CASES  # the implicit-differentiation names

    covered = {name for case in [*CASES, *RULE_CASES] for name in case.uses}
    assert covered >= {name for name in jo.OVERRIDEABLE if not name.startswith("lax.")}


test_parity = _parity.parity_tests(CASES)
# Under ``track`` the tracked Variables enter ``shard_map`` as extra inputs with spec P().
# An eager ``jax.shard_map`` converts every input to the mesh with a compilation of its
# own on every call (JAX's second call compiles 4 times here), so each Variable adds one
# per call. Closing over the values instead fails for a Variable whose array lives on
# another mesh (say after a pmap wrote it), so the inputs stay.
test_parity_under_adapter = _parity.adapter_parity_tests(CASES)
test_raw_jax_ignores_overrides = _parity.raw_jax_test(CASES)
test_jaxprs_inside_a_scoped_installation = _parity.scoped_jaxprs_test(CASES)


@pytest.mark.parametrize("mode", ["idle", "context"])
def test_pmap_really_uses_eight_devices(mode):
    x = f32(8, 3)
    with active(mode):
        out = jo.pmap(normalise, axis_name="i")(x)
    assert len(out.sharding.device_set) == 8 == jax.device_count()
    assert_same(out, jax.pmap(normalise, axis_name="i")(x))


@pytest.mark.parametrize("mode", ["idle", "context"])
def test_shard_map_output_sharding_matches(mode):
    x = jax.device_put(f32(16, 2), NamedSharding(mesh8(), P("x")))
    w = jnp.asarray(f32(2))
    fn = functools.partial(jo.shard_map, mesh=mesh8(), in_specs=(P("x"), P()), out_specs=P("x"))
    with active(mode):
        out = jo.jit(fn(shard_body_two))(x, w)
    expected = jax.jit(
        jax.shard_map(shard_body_two, mesh=mesh8(), in_specs=(P("x"), P()), out_specs=P("x"))
    )(x, w)
    assert out.sharding == expected.sharding
    assert_same(out, expected)


@functools.cache
def _raw_pmap_error_repeats() -> bool:
    """JAX 0.8.1 raises a ValueError for a 9-row pmap on 8 devices the first time and
    ``StoreException: Store empty`` on every later call (its pmap caches a failed trace):
    where raw JAX does not repeat its own error, there is nothing to compare against."""
    fresh = functools.partial(g)  # a function that JAX has not seen yet
    probe = lambda: JAX.pmap(fresh)(jnp.ones((9, 2)))
    return len(set(_parity.error_messages([probe, probe]))) == 1


def transform_errors(api):
    """What each misuse of a transform raises."""
    too_many_devices = [lambda: api.pmap(g)(jnp.ones((9, 2)))]  # more than 8 devices
    return _parity.error_messages(
        [
            lambda: api.grad(g)(jnp.ones(3)),  # non-scalar output
            lambda: api.jit(power, static_argnums=1)(jnp.ones(2), jnp.ones(2)),  # unhashable
            lambda: api.vmap(g2)(jnp.ones(3), jnp.ones(4)),  # inconsistent sizes
            lambda: api.vmap(in_axes=0),  # missing function
            lambda: api.jit(3),  # not callable
            lambda: api.jvp(g, (jnp.ones(2),), (jnp.ones(3),)),
            *(too_many_devices if _raw_pmap_error_repeats() else []),
        ]
    )


@pytest.mark.parametrize("mode", _parity.ALL_MODES)
def test_transform_errors_are_jax_errors(mode):
    """Misuse of a neutral transform raises what JAX raises, with JAX's message."""
    expected = _parity.check_errors_in_mode(transform_errors, mode)
    assert None not in expected


# --- hypothesis: random shapes and axes ------------------------------------------------


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    data=st.data(),
    passthrough=st.booleans(),
)
def test_vmap_random_shapes_and_axes(shape, data, passthrough):
    in_axis = data.draw(st.integers(-len(shape), len(shape) - 1), label="in_axis")
    out_axis = data.draw(st.integers(0, len(shape) - 1), label="out_axis")
    x = f32(*shape)
    expected = str(jax.make_jaxpr(jax.vmap(g, in_axes=in_axis, out_axes=out_axis))(x))
    with active("context" if passthrough else "idle"):
        assert str(jax.make_jaxpr(jo.vmap(g, in_axes=in_axis, out_axes=out_axis))(x)) == expected


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    shape=st.lists(st.integers(1, 3), min_size=0, max_size=3),
    argnums=st.sampled_from([0, 1, (0,), (1, 0), (0, 1)]),
    has_aux=st.booleans(),
    passthrough=st.booleans(),
)
def test_grad_random_shapes_argnums_aux(shape, argnums, has_aux, passthrough):
    x, y = f32(*shape), f32(*shape, offset=0.7)

    def loss(a, b):
        value = jnp.sum(jnp.sin(a) * b**2)
        return (value, {"a": a}) if has_aux else value

    def build(api):
        return jax.make_jaxpr(api.grad(loss, argnums=argnums, has_aux=has_aux))(x, y)

    expected = str(build(JAX))
    with active("context" if passthrough else "idle"):
        assert str(build(jo)) == expected
