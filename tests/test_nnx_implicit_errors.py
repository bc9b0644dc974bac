"""Bad input to the implicit-differentiation names under ``jaxoverride_nnx.track``.

Each misuse is run eagerly, inside ``jo.jit`` and inside ``jo.grad`` with respect to the
tracked module, and must raise a clear error (what was wrong and the fix) and leave every
Variable as it was: the same value object, no read hook left behind, and the override
stack as before; the module then works as usual.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jaxoverride as jo
import jaxoverride_nnx
from jaxoverride import lax as jlax
from jaxoverride_nnx import ClosedOverDifferentiationError, PureFunctionWriteError
from jaxoverride_nnx._stale_reads import check_read


class Model(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.array([0.5, -0.25]))
        self.calls = nnx.Variable(jnp.array(0))

    def __call__(self, x):
        self.calls[...] += 1
        return jnp.tanh(x * self.w[...])


def _sin_vjp(fwd=None, bwd=None):
    f = jo.custom_vjp(jnp.sin)
    f.defvjp(fwd or (lambda x: (jnp.sin(x), x)), bwd or (lambda x, g: (jnp.cos(x) * g,)))
    return f


def undefined_vjp(model, x):
    return jo.custom_vjp(jnp.sin)(x)


def undefined_jvp(model, x):
    return jo.custom_jvp(jnp.sin)(x)


def wrong_nondiff_argnums(model, x):
    return jo.custom_vjp(lambda f, x: f(x), nondiff_argnums=(2,))


def non_callable_fwd(model, x):
    jo.custom_vjp(jnp.sin).defvjp(3.0, lambda x, g: (g,))  # pyright: ignore[reportArgumentType]


def non_callable_jvp(model, x):
    jo.custom_jvp(jnp.sin).defjvp(None)  # pyright: ignore[reportArgumentType]


def non_callable_solve(model, x):
    solve: Any = "anderson"  # a method name where the function belongs
    return jlax.custom_root(lambda z: z - x, x, solve, lambda g, y: y)


def write_in_bwd(model, x):
    def bwd(x, g):
        model(x)
        return (jnp.cos(x) * g,)

    return jo.grad(lambda x: _sin_vjp(bwd=bwd)(x).sum())(x)


def write_in_custom_root(model, x):
    solve = lambda g, z: jlax.fori_loop(0, 5, lambda _, z: z + g(z), z)
    return jlax.custom_root(lambda z: model(z) - z, x, solve, lambda g, y: y / g(1.0))


def closed_over_read_vjp(model, x):
    fwd = lambda x: (jnp.sin(x) * model.w[...], x)
    return jo.grad(lambda m: _sin_vjp(fwd=fwd)(x).sum())(model)


def closed_over_read_jvp(model, x):
    f = jo.custom_jvp(lambda x: x * model.w[...])
    f.defjvp(lambda p, t: (p[0] * model.w[...], t[0] * model.w[...]))
    return jo.grad(lambda m: f(x).sum())(model)


CASES = {
    undefined_vjp: (AttributeError, r"No VJP defined.*f\.defvjp\(fwd, bwd\)"),
    undefined_jvp: (AttributeError, r"No JVP defined.*f\.defjvp\(f_jvp\)"),
    wrong_nondiff_argnums: (IndexError, r"nondiff_argnums \(2,\).*takes 2 positional.*from 0"),
    non_callable_fwd: (TypeError, r"fwd \(the forward rule\) must be a function, got float"),
    non_callable_jvp: (TypeError, r"jvp \(the JVP rule\) must be a function, got NoneType"),
    non_callable_solve: (TypeError, r"must be callable"),  # JAX's own error, as raw JAX
    write_in_bwd: (PureFunctionWriteError, r"bwd.*wrote.*`Model.calls`.*left as it was"),
    write_in_custom_root: (PureFunctionWriteError, r"custom_root: f .*`Model.calls`.*pure jaxpr"),
    closed_over_read_vjp: (
        ClosedOverDifferentiationError,
        r"custom_vjp.*`Model.w`.*closure_convert",
    ),
    closed_over_read_jvp: (
        ClosedOverDifferentiationError,
        r"custom_jvp.*`Model.w`.*closure_convert",
    ),
}


def _scalar(out):
    """Whatever a case returns, as a scalar that depends on it (0 for nothing)."""
    return sum((0.0 * jnp.sum(leaf) for leaf in jax.tree.leaves(out)), jnp.zeros(()))


WAYS = {
    "eager": lambda case, model, x: case(model, x),
    "jit": lambda case, model, x: jo.jit(lambda x: _scalar(case(model, x)))(x),
    "grad": lambda case, model, x: jo.grad(lambda m: _scalar(case(m, x)) + m.w[...].sum())(model),
}


@pytest.mark.parametrize("way", list(WAYS))
@pytest.mark.parametrize("case", list(CASES), ids=lambda case: case.__name__)
def test_bad_input_is_refused_clearly_and_every_variable_is_left_as_it_was(case, way):
    error, message = CASES[case]
    model = Model()
    x = jnp.array([0.3, -0.6])
    variables = (model.w, model.calls)
    with jaxoverride_nnx.track(model), jax.checking_leaks():
        stack = jo.current_stack()
        values = [variable.get_raw_value() for variable in variables]
        with pytest.raises(error, match=message):
            WAYS[way](case, model, x)
        assert jo.current_stack() == stack
        for variable, value in zip(variables, values, strict=True):
            assert variable.get_raw_value() is value
            # The rule's refusing hook is gone; track's own read check stays until exit.
            assert variable._var_metadata.get("on_get_value") is check_read
        jo.jit(model)(x)  # still tracked, still writable
        assert int(model.calls[...]) == 1
    assert int(model.calls[...]) == 1
    assert not any("on_get_value" in variable._var_metadata for variable in variables)
