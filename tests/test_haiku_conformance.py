"""Shapes from Haiku's own ``stateful_test.py`` that the adapter must pass like ``hk.*``.

An ``int32`` parameter (non-differentiable) inside every transform override, applied
under an outer ``jax.grad``: it must reach ``hk.get_parameter`` as an array, as with
``hk.remat``/``hk.grad`` (Haiku's ``test_create_module_inside_remat``, 4 variants).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxoverride as jo
import jaxoverride_haiku as joh

X = jnp.float32(3)


class SquareModule(hk.Module):
    """Haiku's test module: ``x ** p`` with an ``int32`` parameter ``p = 2``."""

    def __call__(self, x: Any) -> Any:
        assert x.ndim == 0
        p = hk.get_parameter("p", [], jnp.int32, init=lambda *_: jnp.array(2))
        y = x**p
        hk.set_state("y", y)
        return y


@pytest.mark.parametrize("inline", [False, True], ids=["outer_remat", "inline_remat"])
@pytest.mark.parametrize("jax_remat", [False, True], ids=["grad", "remat_of_grad"])
@pytest.mark.parametrize("name", ["checkpoint", "remat"])
def test_create_module_inside_remat(name, jax_remat, inline):
    remat = getattr(jo, name)
    log: list[str] = []

    def forward(x: Any) -> Any:
        def create_and_use_layer(x: Any) -> Any:
            m = SquareModule(name="layer")
            log.append(m.module_name)
            return m(x)

        layer = create_and_use_layer if inline else remat(create_and_use_layer)
        for _ in range(2):
            x = remat(layer)(x) if inline else layer(x)
        return x

    with joh.context(), jax.checking_leaks():
        f = hk.transform_with_state(forward)
        params, state = f.init(None, X)
        assert log[:2] == ["layer", "layer_1"]
        grad_fn = jax.grad(lambda x: f.apply(params, state, None, x)[0])
        if jax_remat:
            grad_fn = jax.remat(grad_fn)
        for _ in range(3):
            np.testing.assert_allclose(grad_fn(X), 4 * X**3)


# name -> the transform applied to a scalar function `h`, returning a scalar function.
TRANSFORMS: dict[str, Callable[[Callable[[Any], Any]], Callable[[Any], Any]]] = {
    "checkpoint": lambda h: jo.checkpoint(h),
    "remat": lambda h: jo.remat(h),
    "grad": lambda h: jo.grad(h),
    "value_and_grad": lambda h: lambda x: sum(jo.value_and_grad(h)(x)),
    "jacfwd": lambda h: jo.jacfwd(h),
    "jacrev": lambda h: jo.jacrev(h),
    "hessian": lambda h: jo.hessian(h),
    "jvp": lambda h: lambda x: jo.jvp(h, (x,), (x,))[1],
    "vjp": lambda h: lambda x: jo.vjp(h, x)[1](x)[0],
    "linearize": lambda h: lambda x: jo.linearize(h, x)[1](x),
}


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_int_parameter_passes_through_every_transform_under_grad(name):
    def square(x: Any) -> Any:
        return SquareModule(name="layer")(x)

    def raw(x: Any) -> Any:
        return x**2

    def program(x: Any) -> Any:
        return TRANSFORMS[name](square)(x)

    with joh.context(), jax.checking_leaks():
        f = hk.transform_with_state(program)
        params, state = f.init(None, X)
        assert params["layer"]["p"].dtype == jnp.int32
        got = jax.grad(lambda x: f.apply(params, state, None, x)[0])(X)
    expected = jax.grad(lambda x: TRANSFORMS[name](raw)(x))(X)
    np.testing.assert_allclose(got, expected, rtol=1e-6)


@pytest.mark.parametrize("static_argnums", [1, (1,), -1])
def test_checkpoint_static_argnums_still_name_the_users_arguments(static_argnums):
    # The adapter passes the Haiku state as an extra first argument; static_argnums
    # must keep naming the user's own arguments.
    def layer(x: Any, n: int) -> Any:
        for _ in range(n):
            x = SquareModule()(x)
        return x

    with joh.context():
        f = hk.transform_with_state(
            lambda x: jo.checkpoint(layer, static_argnums=static_argnums)(x, 2)
        )
        params, state = f.init(None, X)
        got = jax.grad(lambda x: f.apply(params, state, None, x)[0])(X)
    np.testing.assert_allclose(got, jax.grad(lambda x: (x**2) ** 2)(X))
