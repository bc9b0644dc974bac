"""Malformed custom rules under ``jaxoverride_nnx.track``, where the rule uses the module.

Each case is JAX's own (``custom_api_test.py``'s error-message tests), with the primal
function and its rules reading a tracked Variable. The lifted rule that the adapter builds
must stay invisible: the error is raw JAX's, of JAX's type, naming the user's functions
(not the adapter's ``lifted_*``), showing the user's pytree structures (not the adapter's
state) and the user's argument indices (not shifted past the adapter's state argument).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jaxoverride as jo
import jaxoverride_nnx
from jaxoverride import lax as jlax


def _scan_apply(scan: Any, f: Callable[[Any], Any], x: Any) -> Any:
    y, _ = scan(lambda x, _: (f(x), None), x, None, length=1)
    return y


class Model(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.float32(1.5))


# The primal functions and calls the cases share; each case writes its own malformed rules.


def _squared_times_w(n: Any, w: Callable[[], Any]) -> Any:
    @n.custom_jvp
    def f(x):
        return x**2 * w()

    return f


def _times_w_jvp_through_scan(n: Any, w: Callable[[], Any], rule: Any) -> Callable[[], Any]:
    @n.custom_jvp
    def f(x):
        return x * w()

    f.defjvp(rule)
    x = jnp.float32(1.0)
    return lambda: n.jvp(lambda x: _scan_apply(n.scan, f, x), (x,), (x,))


def _times_w_vjp(n: Any, w: Callable[[], Any], fwd: Any, bwd: Any) -> Any:
    @n.custom_vjp
    def f(x):
        return x * w()

    f.defvjp(fwd, bwd)
    return f


def _grad_through_scan(n: Any, f: Any) -> Callable[[], Any]:
    return lambda: n.grad(lambda x: _scan_apply(n.scan, f, x))(jnp.float32(1.0))


def _jvp_at_two(n: Any, f: Any) -> Callable[[], Any]:
    return lambda: n.jvp(f, (2.0,), (1.0,))


def jvp_inconsistent_pytree_structures(n: Any, w: Callable[[], Any]) -> Callable[[], Any]:
    @n.custom_jvp
    def f(x):
        return (x**2 * w(),)

    @f.defjvp
    def foo_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        return f(x), [2 * x * t, x]

    return _jvp_at_two(n, f)


def jvp_rule_doesnt_return_pair(n: Any, w: Callable[[], Any]) -> Callable[[], Any]:
    f = _squared_times_w(n, w)

    @f.defjvp
    def foo_jvp(primals, tangents):
        return tangents[0] * w()

    return _jvp_at_two(n, f)


def primal_tangent_aval_disagreement(n: Any, w: Callable[[], Any]) -> Callable[[], Any]:
    f = _squared_times_w(n, w)

    @f.defjvp
    def foo_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        return f(x), jnp.reshape(t, (1,))

    return lambda: n.jvp(f, (jnp.float32(2.0),), (jnp.float32(1.0),))


def jvp_primal_out_structure(n: Any, w: Callable[[], Any]) -> Callable[[], Any]:
    def f_jvp(primals, tangents):
        (x,), (xdot,) = primals, tangents
        return (x, x * w()), (xdot, xdot)

    return _times_w_jvp_through_scan(n, w, f_jvp)


def jvp_primal_out_shape(n: Any, w: Callable[[], Any]) -> Callable[[], Any]:
    def f_jvp2(primals, tangents):
        (x,), (xdot,) = primals, tangents
        return jnp.zeros((3, *x.shape), x.dtype) * w(), xdot

    return _times_w_jvp_through_scan(n, w, f_jvp2)


def vjp_inconsistent_pytree_structures(n: Any, w: Callable[[], Any]) -> Callable[[], Any]:
    def foo_fwd(x):
        return x * w(), None

    def foo_bwd(_, g):
        return (g, g)

    f = _times_w_vjp(n, w, foo_fwd, foo_bwd)
    return lambda: n.grad(f)(2.0)


def vjp_bwd_returns_non_tuple(n: Any, w: Callable[[], Any]) -> Callable[[], Any]:
    def foo_fwd(x):
        return x * w(), None

    def foo_bwd(_, g):
        return 2.0 * g

    f = _times_w_vjp(n, w, foo_fwd, foo_bwd)
    return lambda: n.grad(f)(3.0)


def fwd_rule_doesnt_return_pair(n: Any, w: Callable[[], Any]) -> Callable[[], Any]:
    def f_fwd(x):
        return x * w()

    def f_bwd(_, y_bar):
        return (y_bar,)

    f = _times_w_vjp(n, w, f_fwd, f_bwd)
    return lambda: n.grad(f)(1.0)


def fwd_primal_out_structure(n: Any, w: Callable[[], Any]) -> Callable[[], Any]:
    def f_fwd(x):
        return (x, x * w()), None

    def f_bwd(_, y_bar):
        return (y_bar,)

    f = _times_w_vjp(n, w, f_fwd, f_bwd)
    return _grad_through_scan(n, f)


def fwd_primal_out_shape(n: Any, w: Callable[[], Any]) -> Callable[[], Any]:
    def f_fwd2(x):
        return jnp.zeros((3, *x.shape), x.dtype) * w(), None

    def f_bwd2(_, y_bar):
        return (y_bar,)

    f = _times_w_vjp(n, w, f_fwd2, f_bwd2)
    return _grad_through_scan(n, f)


def bwd_rule_shape_mismatch(n: Any, w: Callable[[], Any]) -> Callable[[], Any]:
    @n.custom_vjp
    def foo(x, y):
        return x * w()

    def foo_fwd(x, y):
        return x * w(), None

    def foo_bwd(_, g):
        return jnp.zeros(3), jnp.zeros(3)

    foo.defvjp(foo_fwd, foo_bwd)
    return lambda: n.grad(lambda x, y: foo(x, y * y).sum(), 1)(jnp.ones(3), jnp.ones(4))


CASES = [
    jvp_inconsistent_pytree_structures,
    jvp_rule_doesnt_return_pair,
    primal_tangent_aval_disagreement,
    jvp_primal_out_structure,
    jvp_primal_out_shape,
    vjp_inconsistent_pytree_structures,
    vjp_bwd_returns_non_tuple,
    fwd_rule_doesnt_return_pair,
    fwd_primal_out_structure,
    fwd_primal_out_shape,
    bwd_rule_shape_mismatch,
]
RAW = types.SimpleNamespace(
    custom_vjp=jax.custom_vjp,
    custom_jvp=jax.custom_jvp,
    grad=jax.grad,
    jvp=jax.jvp,
    scan=jax.lax.scan,
)
NEUTRAL = types.SimpleNamespace(
    custom_vjp=jo.custom_vjp, custom_jvp=jo.custom_jvp, grad=jo.grad, jvp=jo.jvp, scan=jlax.scan
)


def _raised(thunk: Callable[[], Any]) -> BaseException:
    with pytest.raises(Exception) as info:
        thunk()
    return info.value


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.__name__)
def test_a_malformed_rule_that_uses_a_tracked_module_raises_jax_s_error(case, jitted):
    model = Model()
    weight = model.w[...]

    def raw_thunk() -> Any:
        thunk = case(RAW, lambda: weight)
        return jax.jit(thunk)() if jitted else thunk()

    expected = _raised(raw_thunk)
    # Not inside jax.checking_leaks(): there JAX's own check of a fwd rule's primal output
    # fails with another error ("Zero(float32[]) ... is not a valid JAX type").
    with jaxoverride_nnx.track(model):
        thunk = case(NEUTRAL, lambda: model.w[...])
        got = _raised(jo.jit(thunk) if jitted else thunk)
    assert type(got) is type(expected)
    assert str(got) == str(expected)
    assert "lifted" not in str(got)
    assert model.w[...] is weight  # nothing written back
