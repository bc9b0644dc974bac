"""A small implicit-layers-style solver library, written only against the neutral API.

It is the shape that JAX's custom-derivatives guide, the implicit-layers tutorial and
optimistix share: ``closure_convert`` hoists what the map closes over, and a
``custom_vjp`` whose backward pass solves the adjoint fixed point ``u = z_bar + u @ df/dz``
with the same loop. It knows nothing of Haiku, NNX or lazy parameters.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

import jaxoverride as jo
from jaxoverride import lax as jlax

TOL = 1e-6
MAX_ITER = 500


def iterate(step: Callable[[Any], Any], z0: Any) -> Any:
    """``z <- step(z)`` until the relative change is below ``TOL`` (or ``MAX_ITER`` steps)."""

    def cond(state: Any) -> Any:
        _, change, i = state
        return (change > TOL) & (i < MAX_ITER)

    def body(state: Any) -> Any:
        z, _, i = state
        new = step(z)
        change = jnp.linalg.norm((new - z).ravel()) / jnp.maximum(1.0, jnp.linalg.norm(z))
        return new, change, i + 1

    start = (z0, jnp.asarray(jnp.inf, jnp.result_type(z0)), 0)
    return jlax.while_loop(cond, body, start)[0]


@functools.partial(jo.custom_vjp, nondiff_argnums=(0,))
def _solve(f: Callable[..., Any], z0: Any, *args: Any) -> Any:
    return iterate(lambda z: f(z, *args), z0)


def _solve_fwd(f: Callable[..., Any], z0: Any, *args: Any) -> tuple[Any, Any]:
    z = _solve(f, z0, *args)
    return z, (z, args)


def _solve_bwd(f: Callable[..., Any], residuals: Any, z_bar: Any) -> tuple[Any, ...]:
    z, args = residuals
    _, vjp_z = jo.vjp(lambda z: f(z, *args), z)
    u = iterate(lambda u: vjp_z(u)[0] + z_bar, z_bar)
    _, vjp_args = jo.vjp(lambda *a: f(z, *a), *args)
    return (jnp.zeros_like(z), *vjp_args(u))


_solve.defvjp(_solve_fwd, _solve_bwd)


def fixed_point(f: Callable[..., Any], z0: Any, *args: Any) -> Any:
    """``z`` with ``z = f(z, *args)``, differentiated implicitly w.r.t. ``args`` and closures."""
    converted, constants = jo.closure_convert(f, z0, *args)
    return _solve(converted, z0, *args, *constants)


def unrolled(f: Callable[..., Any], z0: Any, *args: Any, steps: int = 200) -> Any:
    """The reference: ``steps`` forward iterations in a scan, differentiated by backprop."""
    return jlax.scan(lambda z, _: (f(z, *args), None), z0, length=steps)[0]
