"""Outside a transform the adapter is invisible; inside, misuse gets errors that say what to
do, and a failure leaves Haiku's frame (params, state, names) as it was."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from haiku._src.base import JaxUsageError

import jaxoverride as jo
import jaxoverride_haiku as joh
from jaxoverride import lax as jlax

X = jnp.array([0.5, -1.0, 2.0], jnp.float32)
RNG = jax.random.PRNGKey(0)


def test_missing_haiku_names_the_extra_to_install() -> None:
    script = textwrap.dedent("""
        import sys
        sys.modules["haiku"] = None  # as if dm-haiku were not installed
        try:
            import jaxoverride_haiku
        except ImportError as error:
            print(error)
    """)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout
    assert "jaxoverride_haiku needs dm-haiku: pip install 'jaxoverride[haiku]'" in out


def _sin(x):
    return jnp.sin(x) * 2


# Each neutral function, called outside any transform: (api) -> (function of x).
OUTSIDE = {
    "jit": lambda api: lambda x: api.jit(_sin)(x),
    "vmap": lambda api: lambda x: api.vmap(_sin)(x[None]),
    "grad": lambda api: lambda x: api.grad(lambda v: _sin(v).sum())(x),
    "value_and_grad": lambda api: lambda x: api.value_and_grad(lambda v: _sin(v).sum())(x),
    "jacfwd": lambda api: lambda x: api.jacfwd(_sin)(x),
    "jacrev": lambda api: lambda x: api.jacrev(_sin)(x),
    "hessian": lambda api: lambda x: api.hessian(lambda v: _sin(v).sum())(x),
    "jvp": lambda api: lambda x: api.jvp(_sin, (x,), (x,)),
    "vjp": lambda api: lambda x: api.vjp(_sin, x)[1](x),
    "linearize": lambda api: lambda x: api.linearize(_sin, x)[1](x),
    "checkpoint": lambda api: lambda x: api.checkpoint(_sin)(x),
    "remat": lambda api: lambda x: api.remat(_sin)(x),
    "eval_shape": lambda api: lambda x: x + api.eval_shape(_sin, x).shape[0],
    "scan": lambda api: lambda x: api.lax.scan(lambda c, v: (c + v, c), 0.0, x),
    "while_loop": lambda api: (
        lambda x: api.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2), (0, x))
    ),
    "fori_loop": lambda api: lambda x: api.lax.fori_loop(0, 3, lambda i, c: c * i, x),
    "cond": lambda api: lambda x: api.lax.cond(x[0] > 0, _sin, jnp.cos, x),
    "switch": lambda api: lambda x: api.lax.switch(1, [_sin, jnp.cos], x),
    "map": lambda api: lambda x: api.lax.map(_sin, x),
}


@pytest.mark.parametrize("name", list(OUTSIDE))
def test_outside_a_transform_every_neutral_function_is_jax(name: str) -> None:
    raw = OUTSIDE[name](jax)
    with joh.context():
        ours = OUTSIDE[name](jo)
        assert str(jax.make_jaxpr(ours)(X)) == str(jax.make_jaxpr(raw)(X))
        jax.tree.map(np.testing.assert_array_equal, ours(X), raw(X))


def test_parameters_created_only_when_traced_are_created_at_init() -> None:
    # Init traces the body once, as apply does, and creates parameters inside that trace:
    # a body that creates a parameter only when traced works (a creation pass missed it).
    def body(c, _):
        if isinstance(c, jax.core.Tracer):
            c = c * hk.get_parameter("late", [3], init=jnp.ones)
        return c, None

    model = hk.transform(lambda x: jlax.scan(body, x, length=2)[0])
    with joh.context(), jax.checking_leaks():
        params = model.init(RNG, X)
        out = model.apply(params, RNG, X)
    assert jax.tree.map(jnp.shape, params) == {"~": {"late": (3,)}}
    np.testing.assert_allclose(out, X)


def test_state_missing_at_apply_is_named() -> None:
    def program(x):
        def body(c, _):
            n = hk.get_state("n", [], jnp.int32, init=jnp.zeros)
            hk.set_state("n", n + 1)
            return c + n, None

        return jlax.scan(body, x, length=2)[0]

    model = hk.transform_with_state(program)
    with joh.context():
        params, state = model.init(RNG, X)
        with pytest.raises(ValueError, match=r"Haiku state ~/n was first created inside"):
            model.apply(params, {}, RNG, X)
        out, _ = model.apply(params, state, RNG, X)
    np.testing.assert_allclose(out, X + 1)


def test_vmap_state_that_depends_on_the_mapped_axis() -> None:
    model = hk.transform_with_state(lambda xs: jo.vmap(lambda x: hk.set_state("s", x))(xs))
    with joh.context(), pytest.raises(ValueError, match="depends on the mapped axis"):
        model.init(RNG, X[None])


def test_a_failure_at_apply_leaves_names_params_and_state_as_they_were() -> None:
    def program(x):
        hk.set_state("before", jnp.ones(()))

        def body(c, _):
            hk.set_state("before", jnp.zeros(()))
            hk.Linear(3)(c)
            raise RuntimeError("inside the trace")

        with pytest.raises(RuntimeError, match="inside the trace"):
            jlax.scan(body, x, length=2)
        # The failed trace named nothing: this is `linear`, and the state is untouched.
        return hk.Linear(3)(x), hk.get_state("before")

    model = hk.transform_with_state(program)
    with joh.context():
        params, state = model.init(RNG, X)
        (out, before), _ = model.apply(params, state, RNG, X)
    assert sorted(params) == ["linear"]
    assert float(before) == 1.0
    np.testing.assert_allclose(out, hk.transform(lambda x: hk.Linear(3)(x)).apply(params, None, X))


def test_raw_jax_inside_a_transform_is_left_to_jax() -> None:
    # Haiku state is unusable inside a raw jax.jit: neutral calls there are JAX's own, and
    # Haiku itself reports the misuse when a module is used.
    def program(x):
        return jax.jit(lambda v: jlax.scan(lambda c, _: (hk.Linear(3)(c), None), v, length=2)[0])(x)

    with joh.context(), hk.config.context(check_jax_usage=True):
        with pytest.raises(JaxUsageError):
            hk.transform(program).init(RNG, X)


def test_errors_from_jax_pass_through_unchanged() -> None:
    program = lambda x: jlax.cond(x[0] > 0, lambda v: v, lambda v: v[:2], x)
    with (
        joh.context(),
        pytest.raises(TypeError, match="cond branches must have equal output types"),
    ):
        hk.transform(program).init(RNG, X)
