"""The NNX adapter against JAX's custom-derivative suite and misuse: round 3 of the
conformance work (issue 21). Each test fails on the adapter before the fix."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxoverride as jo
import jaxoverride_nnx
from _nnx_models import identity_with_jvp

# -- track scopes and install ---------------------------------------------------------


def test_track_scopes_exited_out_of_order_are_refused_and_change_nothing():
    v1, v2, v3 = (nnx.Variable(jnp.zeros(())) for _ in range(3))
    first, second = jaxoverride_nnx.track(v1), jaxoverride_nnx.track(v2)
    first.__enter__()
    second.__enter__()
    with pytest.raises(RuntimeError, match="reverse order of entry"):
        first.__exit__(None, None, None)
    # Nothing changed: both are still tracked, and they exit in order.
    assert [v for _, v in jaxoverride_nnx.tracked_variables()] == [v1, v2]
    second.__exit__(None, None, None)
    assert [v for _, v in jaxoverride_nnx.tracked_variables()] == [v1]
    first.__exit__(None, None, None)
    assert jaxoverride_nnx.tracked_variables() == []
    with jaxoverride_nnx.track(v3):  # a later scope tracks only its own module
        assert [v for _, v in jaxoverride_nnx.tracked_variables()] == [v3]
    assert not jo.current_stack().layers


def test_install_twice_returns_the_same_handle():
    try:
        first = jaxoverride_nnx.install()
        assert jaxoverride_nnx.install() is first
    finally:
        assert jaxoverride_nnx.uninstall()
    assert not jaxoverride_nnx.uninstall()


# -- custom rules: optimize_remat, compile-time evaluation, JAX's errors ---------------


class Unused(nnx.Module):
    """A tracked module that the code under test never touches."""

    def __init__(self):
        self.w = nnx.Param(jnp.ones((2, 3)))
        self.b = nnx.Param(jnp.zeros(3))


UNUSED = Unused()  # held strongly: ``track`` keeps its modules by weak reference


class Scale(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.array(3.0))


def _remat_rule(api, scale=None):
    @api.custom_vjp
    def f(x):
        return jnp.sin(x) * (1.0 if scale is None else scale.w[...])

    def f_fwd(x):
        return f(x), jnp.cos(x)

    def f_bwd(cos_x, g):
        return (g * cos_x * (1.0 if scale is None else scale.w[...]),)

    f.defvjp(f_fwd, f_bwd, optimize_remat=True)
    return f


def test_optimize_remat_works_under_track_as_in_jax():
    x = jnp.float32(0.5)
    expected = jax.grad(_remat_rule(jax))(x)
    with jaxoverride_nnx.track(UNUSED):
        np.testing.assert_allclose(jo.grad(_remat_rule(jo))(x), expected)
    scale = Scale()
    with jaxoverride_nnx.track(scale):  # the rule reads a tracked, undifferentiated Variable
        got = jo.grad(_remat_rule(jo, scale))(x)
    np.testing.assert_allclose(got, 3.0 * expected, rtol=1e-6)


def _compile_time_rule(api):
    seen = []

    @api.custom_jvp
    def f(x):
        seen.append(bool(x == 0.0))  # concrete where JAX gives concrete values
        return x

    @f.defjvp
    def f_jvp(primals, tangents):
        return primals[0], tangents[0]

    @api.jit
    def g():
        with jax.ensure_compile_time_eval():
            return f(0.0)

    return g, seen


def test_ensure_compile_time_eval_gives_a_custom_jvp_concrete_values():
    raw, raw_seen = _compile_time_rule(jax)
    try:
        want = float(raw())
    except jax.errors.TracerBoolConversionError:  # JAX 0.8 traces the rule here too
        g, _ = _compile_time_rule(jo)
        with jaxoverride_nnx.track(UNUSED), pytest.raises(jax.errors.TracerBoolConversionError):
            g()
        return
    g, seen = _compile_time_rule(jo)
    with jax.checking_leaks(), jaxoverride_nnx.track(UNUSED):
        assert float(g()) == want == 0.0
    assert seen == raw_seen == [True]


def _error(call):
    try:
        call()
    except Exception as error:
        return type(error), str(error).split("\n\nThe preceding stack trace")[0]
    raise AssertionError("no error")


def _jvp_not_a_pair(api):
    @api.custom_jvp
    def f(x):
        return x**2

    @f.defjvp
    def foo_jvp(primals, tangents):
        return tangents[0]

    return lambda: api.jvp(f, (2.0,), (1.0,))


def _jvp_trees_differ(api):
    @api.custom_jvp
    def f(x):
        return (x**2,)

    @f.defjvp
    def foo_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        return f(x), [2 * x * t, x]

    return lambda: api.jvp(f, (2.0,), (1.0,))


def _jvp_primal_type(api):
    def f_jvp(primals, tangents):
        (x,), (xdot,) = primals, tangents
        return (x, x), (xdot, xdot)

    f = identity_with_jvp(api.custom_jvp, f_jvp)

    def scan_apply(x):
        return api.lax.scan(lambda c, _: (f(c), None), x, None, length=1)[0]

    return lambda: api.jvp(scan_apply, (jnp.float32(1.0),), (jnp.float32(1.0),))


def _fwd_primal_type(api):
    @api.custom_vjp
    def f(x):
        return x

    f.defvjp(lambda x: ((x, x), None), lambda _, g: (g,))

    def scan_apply(x):
        return api.lax.scan(lambda c, _: (f(c), None), x, None, length=1)[0]

    return lambda: api.grad(scan_apply)(jnp.float32(1.0))


def _bwd_shape(api):
    @api.custom_vjp
    def foo(x, y):
        return x

    foo.defvjp(lambda x, y: (x, None), lambda _, g: (jnp.zeros(3), jnp.zeros(3)))
    return lambda: api.grad(lambda x, y: foo(x, y * y).sum(), 1)(jnp.ones(3), jnp.ones(4))


def _unresolved_kwargs(api):
    @api.custom_jvp
    def f(x, y):
        return x + y

    f.defjvp(lambda primals, tangents: (f(*primals), tangents[0]))
    return lambda: f(1.0, z=2.0)


def _missing_argument(api):
    @api.custom_vjp
    def f(x, y, *, z=None):
        return x + y

    f.defvjp(lambda x, y, z=None: (f(x, y), None), lambda _, g: (g, g))
    return lambda: f(0.5)


def _keyword_only_argument(api):
    @api.custom_jvp
    def f(x, y, *, z=None):
        return x + y

    f.defjvp(lambda primals, tangents: (f(*primals), tangents[0]))
    return lambda: f(0.5, 1.0, z=1.0)


@pytest.mark.parametrize(
    "program",
    [
        _jvp_not_a_pair,
        _jvp_trees_differ,
        _jvp_primal_type,
        _fwd_primal_type,
        _bwd_shape,
        _unresolved_kwargs,
        _missing_argument,
        _keyword_only_argument,
    ],
)
def test_errors_about_malformed_rules_are_jaxs_about_the_users_functions(program):
    expected = _error(program(jax))
    with jaxoverride_nnx.track(UNUSED):
        assert _error(program(jo)) == expected


# -- a module that a function never touches stays out of its jaxpr ---------------------


def _jaxpr(fn, *args):
    # The neutral make_jaxpr: a raw one around a neutral call that carries tracked values
    # is refused under track (JAX's jit cache would keep them as constants).
    return str(jo.make_jaxpr(fn)(*args))


def _custom_vjp(api):
    @api.custom_vjp
    def f(x):
        return jnp.sin(x)

    f.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (c * g,))
    return f


def _custom_jvp(api):
    @api.custom_jvp
    def f(x):
        return jnp.sin(x)

    f.defjvp(lambda p, t: (jnp.sin(p[0]), jnp.cos(p[0]) * t[0]))
    return f


PROGRAMS = {
    "jit": lambda api, x: api.jit(lambda y: y * 2.0)(x),
    "scan": lambda api, x: api.lax.scan(lambda c, y: (c + y, c * y), 0.0, x),
    "while_loop": lambda api, x: api.lax.while_loop(
        lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2.0), (0, x)
    ),
    "fori_loop": lambda api, x: api.lax.fori_loop(0, 3, lambda i, c: c * 2.0, x),
    "cond": lambda api, x: api.lax.cond(x[0] > 0, jnp.sin, jnp.cos, x),
    "switch": lambda api, x: api.lax.switch(1, [jnp.sin, jnp.cos], x),
    "map": lambda api, x: api.lax.map(jnp.sin, x),
    "map-batched": lambda api, x: api.lax.map(jnp.sin, x, batch_size=2),
    "vmap": lambda api, x: api.vmap(jnp.sin)(x),
    "grad": lambda api, x: api.grad(lambda y: jnp.sum(jnp.sin(y)))(x),
    "checkpoint": lambda api, x: api.checkpoint(jnp.sin)(x),
    "custom_vjp": lambda api, x: api.grad(lambda y: jnp.sum(_custom_vjp(api)(y)))(x),
    "custom_jvp": lambda api, x: api.jvp(_custom_jvp(api), (x,), (x,)),
}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_an_untouched_tracked_module_leaves_the_jaxpr_exactly_jaxs(name):
    program, x = PROGRAMS[name], jnp.arange(1.0, 4.0)
    expected = _jaxpr(lambda y: program(jax, y), x)
    with jaxoverride_nnx.track(UNUSED):
        assert _jaxpr(lambda y: program(jo, y), x) == expected
        # JAX's caches keep working: the same call again gives the same program.
        assert _jaxpr(lambda y: program(jo, y), x) == expected


class Counter(nnx.Module):
    def __init__(self):
        self.count = nnx.Variable(jnp.array(0))
        self.w = nnx.Param(jnp.array(2.0))

    def __call__(self, x):
        self.count[...] += 1
        return x * self.w[...]


def test_only_the_touched_module_is_threaded():
    scale, counter, unused = Scale(), Counter(), Unused()

    def program(x):
        return jo.lax.scan(lambda c, _: (c * scale.w[...], None), x, None, length=3)[0]

    with jaxoverride_nnx.track(scale):
        alone = _jaxpr(program, 1.0)
    with jaxoverride_nnx.track(scale, unused):
        assert _jaxpr(program, 1.0) == alone
        assert float(program(1.0)) == 27.0
    with jaxoverride_nnx.track(counter, unused):
        out = jo.lax.scan(lambda c, _: (counter(c), None), 1.0, None, length=3)[0]
    assert float(out) == 8.0
    assert int(counter.count[...]) == 3


class Holder:
    """Reaches the module only through an attribute: no closure names it."""

    def __init__(self, module):
        self.module = module


@pytest.mark.parametrize("kind", ["jit", "scan", "cond", "custom_jvp"])
def test_a_module_reached_indirectly_is_found_and_threaded(kind):
    model = Counter()
    holder = Holder(model)

    @jo.custom_jvp
    def rule(x):
        return holder.module(x)

    rule.defjvp(lambda p, t: (rule(p[0]), t[0] * 2.0))
    calls = {
        "jit": lambda x: jo.jit(lambda y: holder.module(y))(x),
        "scan": lambda x: jo.lax.scan(lambda c, _: (holder.module(c), None), x, None, length=2)[0],
        "cond": lambda x: jo.lax.cond(True, lambda y: holder.module(y), lambda y: y, x),
        "custom_jvp": lambda x: rule(x),
    }
    with jax.checking_leaks(), jaxoverride_nnx.track(model, UNUSED):
        out = calls[kind](jnp.float32(1.5))
        model.w[...] = jnp.array(5.0)  # never stale
        again = calls[kind](jnp.float32(1.5))
    steps = 2 if kind == "scan" else 1
    assert float(out) == 1.5 * 2.0**steps
    assert float(again) == 1.5 * 5.0**steps
    assert int(model.count[...]) == 2 * steps
