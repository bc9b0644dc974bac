"""Differential parity of the implicit-differentiation names.

``jo.custom_vjp``, ``jo.custom_jvp``, ``jo.closure_convert``, ``jo.make_jaxpr``,
``jaxoverride.lax.custom_root`` and ``jaxoverride.lax.custom_linear_solve``: the same
harness as ``test_parity_lax``, so every case runs through JAX and jaxoverride, idle and
under pass-through overrides, and must give the same outputs, jaxprs and derivatives.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import _parity
import jaxoverride as jo
from _parity import (
    ALL_MODES,
    JAX,
    LOG,
    Case,
    active,
    assert_same,
    error_messages,
    f32,
    fresh_jax_caches_per_module,  # noqa: F401 - an autouse fixture
)
from jaxoverride import _stack


def _sin_times(x, y):
    return jnp.sin(x) * y


def _sin_times_fwd(x, y):
    return _sin_times(x, y), (x, y)


def _sin_times_bwd(residuals, g):
    x, y = residuals
    return jnp.cos(x) * y * g * 1.5, jnp.sin(x) * g  # 1.5: the rule, not autodiff, is used


def custom_vjp_call(api, x, y):
    f = api.custom_vjp(_sin_times)
    f.defvjp(_sin_times_fwd, _sin_times_bwd)
    return f(x, y)


def _apply(fn, x):
    return fn(x) * 2.0


def _apply_fwd(fn, x):
    return _apply(fn, x), x


def _apply_bwd(fn, x, g):
    return (jax.grad(lambda x: jnp.sum(fn(x)))(x) * g * 3.0,)


def custom_vjp_nondiff(api, x):
    f = api.custom_vjp(_apply, nondiff_argnums=(0,))
    f.defvjp(_apply_fwd, _apply_bwd)
    return f(jnp.tanh, x)


def custom_vjp_symbolic_zeros(api, x, y):
    def fwd(x, y):
        return _sin_times(x.value, y.value), (x.value, y.value, y.perturbed)

    def bwd(residuals, g):
        x, y, y_perturbed = residuals
        return jnp.cos(x) * y * g, jnp.sin(x) * g if y_perturbed else None

    f = api.custom_vjp(_sin_times)
    f.defvjp(fwd, bwd, symbolic_zeros=True)
    return f(x, y)


def custom_jvp_call(api, x):
    f = api.custom_jvp(jnp.sin)

    @f.defjvp
    def _(primals, tangents):
        (x,), (t,) = primals, tangents
        return jnp.sin(x), jnp.cos(x) * t * 2.0

    return f(x)


def custom_jvp_defjvps(api, x, y):
    f = api.custom_jvp(_sin_times)
    f.defjvps(lambda t, out, x, y: jnp.cos(x) * y * t, lambda t, out, x, y: jnp.sin(x) * t * 3.0)
    return f(x, y)


def closure_convert_call(api, x, w):
    converted, constants = api.closure_convert(lambda z: jnp.tanh(z * w), x)
    return converted(x, *constants)


def implicit_fixed_point(api, x, w):
    """The implicit-layers pattern: closure_convert, then a custom_vjp with an adjoint loop."""

    def iterate(step, z0):
        body = lambda state: (step(state[0]), state[1] + 1)
        return api.lax.while_loop(lambda state: state[1] < 60, body, (z0, 0))[0]

    def solve(f, z0, *args):
        return iterate(lambda z: f(z, *args), z0)

    def solve_fwd(f, z0, *args):
        z = solve_rule(f, z0, *args)
        return z, (z, args)

    def solve_bwd(f, residuals, z_bar):
        z, args = residuals
        _, vjp_z = jax.vjp(lambda z: f(z, *args), z)
        u = iterate(lambda u: vjp_z(u)[0] + z_bar, z_bar)
        _, vjp_args = jax.vjp(lambda *a: f(z, *a), *args)
        return (jnp.zeros_like(z), *vjp_args(u))

    solve_rule = api.custom_vjp(solve, nondiff_argnums=(0,))
    solve_rule.defvjp(solve_fwd, solve_bwd)
    f = lambda z, x: jnp.tanh(w * z + x) * 0.5
    converted, constants = api.closure_convert(f, x, x)
    return solve_rule(converted, x, x, *constants)


def make_jaxpr_text(api, x):
    return str(api.make_jaxpr(lambda x: jnp.sin(x) * x)(x))


def make_jaxpr_shape(api, x):
    jaxpr, shape = api.make_jaxpr(lambda x: (x * 2, x.sum()), return_shape=True)(x)
    return str(jaxpr), shape


def custom_root_call(api, a):
    def f(x):
        return x**3 - a

    def newton(f, x0):
        step = lambda x, _: (x - f(x) / jax.grad(f)(x), None)
        return jax.lax.scan(step, x0, length=30)[0]

    return api.lax.custom_root(f, jnp.float32(1.0), newton, lambda g, y: y / g(1.0))


def custom_linear_solve_call(api, b, d):
    matvec = lambda x: d * x + 0.1 * jnp.roll(x, 1)

    def solve(matvec, b):
        return jax.lax.fori_loop(0, 60, lambda _, x: (b - 0.1 * jnp.roll(x, 1)) / d, b / d)

    def transpose_solve(vecmat, b):
        return jax.lax.fori_loop(0, 60, lambda _, x: (b - 0.1 * jnp.roll(x, -1)) / d, b / d)

    return api.lax.custom_linear_solve(matvec, b, solve, transpose_solve)


def two_array_case(id: str, fn: Callable[..., Any], size: int, offset: float, uses: str) -> Case:
    """``fn(api, x, y)`` over an x and a y of ``size`` (y's values offset by ``offset``),
    differentiated in both, dispatching through ``uses``."""
    return Case(id, fn, lambda: (f32(size), f32(size, offset=offset)), (uses,), argnums=(0, 1))


CASES = [
    two_array_case("custom_vjp", custom_vjp_call, 3, 0.4, "custom_vjp"),
    Case("custom_vjp-nondiff_argnums", custom_vjp_nondiff, lambda: (f32(4),), ("custom_vjp",)),
    Case(
        "custom_vjp-symbolic_zeros",
        custom_vjp_symbolic_zeros,
        lambda: (f32(3), f32(3, offset=0.2)),
        ("custom_vjp",),
    ),
    Case("custom_jvp-defjvp", custom_jvp_call, lambda: (f32(3),), ("custom_jvp",)),
    Case("custom_jvp-defjvp-fwd", custom_jvp_call, lambda: (f32(3),), ("custom_jvp",), diff="fwd"),
    two_array_case("custom_jvp-defjvps", custom_jvp_defjvps, 2, 1.0, "custom_jvp"),
    two_array_case("closure_convert", closure_convert_call, 3, 0.5, "closure_convert"),
    Case(
        "implicit-fixed-point",
        implicit_fixed_point,
        lambda: (f32(3), jnp.float32(0.4)),
        ("closure_convert", "custom_vjp", "lax.while_loop"),
        argnums=(0, 1),
    ),
    Case("make_jaxpr", make_jaxpr_text, lambda: (f32(3),), ("make_jaxpr",), diff=None, jaxpr=False),
    Case(
        "make_jaxpr-return_shape",
        make_jaxpr_shape,
        lambda: (f32(2, 2),),
        ("make_jaxpr",),
        diff=None,
        jaxpr=False,
    ),
    Case("custom_root", custom_root_call, lambda: (jnp.float32(2.0),), ("lax.custom_root",)),
    two_array_case(
        "custom_linear_solve", custom_linear_solve_call, 4, 3.0, "lax.custom_linear_solve"
    ),
]

test_parity = _parity.parity_tests(CASES)
test_parity_under_adapter = _parity.adapter_parity_tests(CASES)
test_raw_jax_ignores_overrides = _parity.raw_jax_test(CASES)
test_jaxprs_inside_a_scoped_installation = _parity.scoped_jaxprs_test(CASES)


def test_every_new_name_has_a_case():
    new = {"custom_vjp", "custom_jvp", "closure_convert", "make_jaxpr"}
    new |= {"lax.custom_root", "lax.custom_linear_solve"}
    assert {name for case in CASES for name in case.uses} >= new
    assert new <= jo.OVERRIDEABLE


# --- a rule defined once at import, resolved at each call ------------------------------


@jo.custom_vjp
def module_level(x):
    return jnp.sin(x)


module_level.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (jnp.cos(x) * g * 2.0,))


def test_module_level_rule_resolves_the_stack_when_called():
    x = f32(3)
    expected = jax.grad(lambda x: module_level._plain(x).sum())(x)
    with active("context"):
        first = jax.grad(lambda x: module_level(x).sum())(x)
        assert LOG.count("custom_vjp") == 1
        second = jax.grad(lambda x: module_level(x).sum())(x)
        assert LOG.count("custom_vjp") == 1, "a second call with the same stack rebuilt the rule"
    assert_same(first, expected)
    assert_same(second, expected)
    assert_same(module_level(x), jnp.sin(x))


def test_redefining_a_rule_drops_every_build():
    f = jo.custom_vjp(lambda x: x * 2.0)
    f.defvjp(lambda x: (x * 2.0, None), lambda _, g: (g * 2.0,))
    with active("context"):
        assert float(jax.grad(f)(1.0)) == 2.0
        f.defvjp(lambda x: (x * 2.0, None), lambda _, g: (g * 5.0,))
        assert float(jax.grad(f)(1.0)) == 5.0
    assert float(jax.grad(f)(1.0)) == 5.0


# --- the wrapper keeps JAX's API -------------------------------------------------------


@pytest.mark.parametrize("kind", ["custom_vjp", "custom_jvp"])
def test_wrapper_api_matches_jax(kind):
    def documented(x, y=2.0):
        """Documented."""
        return x * y

    ours, theirs = (
        getattr(jo, kind)(documented, nondiff_argnums=(1,)),
        getattr(jax, kind)(documented, nondiff_argnums=(1,)),
    )
    for attribute in (
        "__name__",
        "__qualname__",
        "__doc__",
        "__wrapped__",
        "fun",
        "nondiff_argnums",
    ):
        # JAX's next custom_vjp (flag jax_custom_vjp3) has no fun or nondiff_argnums; ours
        # keeps both (its positions read through jaxoverride._compat).
        if hasattr(theirs, attribute):
            assert getattr(ours, attribute) == getattr(theirs, attribute), attribute
    assert ours.fun is documented and ours.nondiff_argnums == (1,)
    assert inspect.signature(ours) == inspect.signature(theirs) == inspect.signature(documented)
    assert f"jax.{kind}" in type(ours).__doc__


def test_defjvp_is_a_decorator_and_rules_are_readable():
    f = jo.custom_jvp(jnp.sin)

    @f.defjvp
    def rule(primals, tangents):
        return jnp.sin(primals[0]), jnp.cos(primals[0]) * tangents[0]

    assert rule.__name__ == "rule" and f.jvp is rule
    g = jo.custom_vjp(jnp.sin)
    fwd, bwd = (lambda x: (jnp.sin(x), x)), (lambda x, t: (jnp.cos(x) * t,))
    g.defvjp(fwd, bwd)
    assert (g.fwd, g.bwd) == (fwd, bwd)


def test_interpose_rebinds_the_new_names():
    import types

    module = types.ModuleType("uses_custom_rules")
    module.jax = jax
    module.custom_vjp = jax.custom_vjp
    module.closure_convert = jax.closure_convert
    with jo.interpose(module) as handle:
        assert module.jax.custom_vjp is jo.custom_vjp
        assert module.jax.make_jaxpr is jo.make_jaxpr
        assert module.jax.lax.custom_root is jo.lax.custom_root
        assert module.custom_vjp is jo.custom_vjp
        assert module.closure_convert is jo.closure_convert
        assert sorted(handle.rebound["uses_custom_rules"]) == [
            "closure_convert",
            "custom_vjp",
            "jax",
        ]
    assert module.custom_vjp is jax.custom_vjp and module.jax is jax


# --- bad input: clear errors, nothing left behind ---------------------------------------


@pytest.mark.parametrize("mode", ALL_MODES)
def test_a_rule_never_defined_raises_jaxs_error_with_the_fix(mode):
    f = jo.custom_vjp(_sin_times)
    g = jo.custom_jvp(jnp.sin)
    [(vjp_type, vjp_message), (jvp_type, jvp_message)] = error_messages(
        [lambda: jax.custom_vjp(_sin_times)(1.0, 2.0), lambda: jax.custom_jvp(jnp.sin)(1.0)]
    )
    with active(mode):
        with pytest.raises(vjp_type) as vjp_error:
            f(1.0, 2.0)
        with pytest.raises(jvp_type) as jvp_error:
            g(1.0)
    assert vjp_message in str(vjp_error.value) and "f.defvjp(fwd, bwd)" in str(vjp_error.value)
    assert jvp_message in str(jvp_error.value) and "f.defjvp(" in str(jvp_error.value)
    assert _stack.context_snapshot() is _stack.ROOT


def test_bad_definitions_fail_where_they_are_made():
    """JAX accepts these and fails at the first call (``TypeError: the first argument must be
    callable``, an ``IndexError`` from inside its binding); the neutral names refuse them at
    definition, with the same exception type and a message that names the problem."""
    f = jo.custom_vjp(_sin_times)
    with pytest.raises(TypeError, match=r"fwd \(the forward rule\) must be a function, got int"):
        f.defvjp(3, _sin_times_bwd)
    with pytest.raises(TypeError, match=r"bwd \(the backward rule\) must be a function"):
        f.defvjp(_sin_times_fwd, "bwd")
    with pytest.raises(TypeError, match=r"jvp \(the JVP rule\) must be a function"):
        jo.custom_jvp(jnp.sin).defjvp(None)
    with pytest.raises(TypeError, match=r"each jvp \(or None\) must be a function"):
        jo.custom_jvp(_sin_times).defjvps(None, 4)
    with pytest.raises(TypeError, match="the decorated function must be a function"):
        jo.custom_vjp(3)
    with pytest.raises(IndexError, match=r"names position\(s\) \[2\].*takes 2 positional"):
        jo.custom_vjp(_sin_times, nondiff_argnums=(2,))
    with pytest.raises(TypeError, match="must hold ints"):
        jo.custom_jvp(_sin_times, nondiff_argnums=("x",))
    with pytest.raises(TypeError, match="must be a sequence of argument positions"):
        jo.custom_vjp(_sin_times, nondiff_argnums=1)
    # Nothing was defined by the refused calls: the rule is still undefined.
    with pytest.raises(AttributeError, match="No VJP defined"):
        f(1.0, 2.0)
    for bad in ((3, _sin_times_bwd), (_sin_times_fwd, "bwd")):
        raw = jax.custom_vjp(_sin_times)
        raw.defvjp(*bad)  # JAX accepts it here...
        with pytest.raises(TypeError):
            jax.grad(raw)(1.0, 2.0)  # ...and fails only when the rule runs


NOT_AN_ARRAY = object()


def rule_errors(api):
    """What each bad custom rule raises when it runs."""
    bad_bwd = api.custom_vjp(_sin_times)
    bad_bwd.defvjp(_sin_times_fwd, lambda residuals, g: (g,))  # one cotangent for two args
    bad_fwd = api.custom_vjp(_sin_times)
    bad_fwd.defvjp(lambda x, y: _sin_times(x, y), _sin_times_bwd)  # not a pair
    return error_messages(
        [
            lambda: jax.grad(bad_bwd)(1.0, 2.0),
            lambda: jax.grad(bad_fwd)(1.0, 2.0),
            lambda: api.closure_convert(lambda x: x, NOT_AN_ARRAY),
            lambda: api.lax.custom_root(lambda x: x, 1.0, 3, None),
        ]
    )


@pytest.mark.parametrize("mode", ALL_MODES)
def test_errors_inside_the_rules_are_jaxs(mode):
    expected = _parity.check_errors_in_mode(rule_errors, mode)
    assert None not in expected


def test_nondiff_argnames_and_keyword_binding_match_jax():
    def scaled(x, scale):
        return x * scale

    def fwd(x, scale):
        return x * scale, None

    def bwd(scale, _, g):
        return (g * scale * 2.0,)

    def gradient(api):
        f = api.custom_vjp(scaled, nondiff_argnames=("scale",))
        f.defvjp(fwd, bwd)
        return jax.grad(lambda x: f(x, scale=3.0))(1.0)

    expected = gradient(JAX)
    with active("context"):
        actual = gradient(jo)
    assert_same(actual, expected)


def test_the_fix_in_a_refusal_names_a_real_example():
    cases = [
        (lambda: jo.custom_vjp(None), "jaxoverride.custom_vjp(my_function)"),
        (lambda: jo.custom_jvp(None), "jaxoverride.custom_jvp(my_function)"),
        (
            lambda: jo.custom_vjp(_sin_times).defvjp(None, _sin_times_bwd),
            "f.defvjp(my_fwd, my_bwd)",
        ),
        (lambda: jo.custom_jvp(jnp.sin).defjvp(1), "f.defjvp(my_jvp)"),
        (lambda: jo.custom_jvp(_sin_times).defjvps(2, None), "f.defjvps(my_jvp_of_x, None)"),
    ]
    for make, example in cases:
        with pytest.raises(TypeError) as refused:
            make()
        assert f"as in {example}." in str(refused.value)
        assert "my_the" not in str(refused.value) and "my_each" not in str(refused.value)
