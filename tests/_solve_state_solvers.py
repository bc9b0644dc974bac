"""The solvers that ``jaxoverride.solve_state``'s tests run a stateful map through.

Each runner takes the map ``f(z)`` (a closure over the model: it may draw rng keys and
write state) and ``z0``, and returns ``(z_star, steps)``. The fpsolve runners call the
example library (neutral API); jaxopt's runs interposed (``_libraries.interposed``). The
Equinox family (optimistix, diffrax) holds import-time ``eqx.filter_jit`` objects, so
their tests run in a fresh interpreter with ``jo.interpose_on_import`` (see
``_libraries.FreshScript``); ``optimistix_fixed_point`` and ``diffrax_node`` are written
for such a script, after that interposition.

``masks_seen()`` counts the distinct masks a map drew: the map calls ``record(mask)``,
a host callback, once per evaluation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import _examples  # noqa: F401  (puts examples/ on the path)
import fpsolve
import jaxoverride as jo

Map = Callable[[jax.Array], jax.Array]

FPSOLVE_METHODS = ("forward", "anderson", "newton")

_seen: list[bytes] = []


def record(mask: jax.Array) -> None:
    """Records ``mask`` (any array) from inside a traced map, once per evaluation."""
    jax.debug.callback(lambda m: _seen.append(np.asarray(m).tobytes()), mask)


@contextmanager
def masks_seen() -> Iterator[list[bytes]]:
    """The masks recorded inside the block, in order (a list filled as they arrive)."""
    start = len(_seen)
    seen: list[bytes] = []
    try:
        yield seen
    finally:
        jax.effects_barrier()
        seen.extend(_seen[start:])
        del _seen[start:]


def fpsolve_run(method: str, implicit: bool) -> Callable[[Map, jax.Array], tuple[Any, Any]]:
    """The fpsolve runner: ``method`` in ``FPSOLVE_METHODS``, implicit or not."""

    def run(f: Map, z0: jax.Array) -> tuple[Any, Any]:
        solution = fpsolve.fixed_point(
            lambda z, _: f(z), z0, None, method=method, implicit=implicit, tol=1e-6
        )
        return solution.value, solution.iterations

    return run


def jaxopt_run(implicit_diff: bool) -> Callable[[Map, jax.Array], tuple[Any, Any]]:
    """jaxopt's ``FixedPointIteration`` (run it inside ``_libraries.interposed("jaxopt")``)."""

    def run(f: Map, z0: jax.Array) -> tuple[Any, Any]:
        import jaxopt

        solver = jaxopt.FixedPointIteration(
            lambda z: f(z), maxiter=200, tol=1e-6, implicit_diff=implicit_diff
        )
        z, state = solver.run(z0)
        return z, state.iter_num

    return run


def jaxopt_converted_run(f: Map, z0: jax.Array) -> tuple[Any, Any]:
    """jaxopt's ``FixedPointIteration(implicit_diff=True)`` on the map converted first by
    ``jaxoverride.closure_convert``, its closed-over parameters passed to ``run()``: the
    fix that the refusal of a closed-over parameter names (jaxopt's implicit
    differentiation gives gradients for ``run()``'s arguments only)."""
    import jaxopt

    converted, constants = jo.closure_convert(f, z0)
    solver = jaxopt.FixedPointIteration(
        lambda z, *c: converted(z, *c), maxiter=200, tol=1e-6, implicit_diff=True
    )
    z, state = solver.run(z0, *constants)
    return z, state.iter_num


def optimistix_fixed_point(f: Map, z0: jax.Array) -> tuple[Any, Any]:
    """optimistix's ``fixed_point`` with ``FixedPointIteration`` (in an interposed script)."""
    import optimistix as optx

    solver = optx.FixedPointIteration(rtol=1e-6, atol=1e-6)
    solution = optx.fixed_point(lambda y, _: f(y), solver, z0, max_steps=200)
    return solution.value, solution.stats["num_steps"]


def diffrax_node(vector_field: Map, y0: jax.Array, adjoint: str = "default") -> tuple[Any, Any]:
    """A neural ODE ``dy/dt = vector_field(y)`` on [0, 1] with Tsit5 and adaptive steps;
    ``adjoint`` is ``"default"`` (diffrax's ``RecursiveCheckpointAdjoint``) or
    ``"direct"`` (``DirectAdjoint``). Returns ``(y1, accepted_steps)``."""
    import diffrax

    adjoints = {"default": diffrax.RecursiveCheckpointAdjoint(), "direct": diffrax.DirectAdjoint()}
    solution = diffrax.diffeqsolve(
        diffrax.ODETerm(lambda t, y, args: vector_field(y)),
        diffrax.Tsit5(),
        t0=0.0,
        t1=1.0,
        dt0=0.1,
        y0=y0,
        stepsize_controller=diffrax.PIDController(rtol=1e-5, atol=1e-5),
        adjoint=adjoints[adjoint],
        max_steps=4096,
    )
    return solution.ys[-1], solution.stats["num_accepted_steps"]


def relative_residual(f_fixed: Map, z: jax.Array) -> float:
    """``||f(z) - z|| / max(1, ||z||)`` for a map with its rng and state fixed."""
    fz = f_fixed(z)
    return float(jnp.linalg.norm(fz - z) / jnp.maximum(1.0, jnp.linalg.norm(z)))


UPSTREAM_CALLBACK_LEAK = (
    "upstream, not jaxoverride: from jax 0.12, jax.checking_leaks() reports a JaxprTrace "
    "leak when a jax.debug.callback runs inside a function JAX linearizes for a custom "
    "rule (its effect handles keep a tracer), in raw JAX too: jax.grad of a "
    "jax.lax.custom_root whose f holds a debug callback raises it on jax 0.12.0.1 and not "
    "on 0.10.2"
)
"""Why ``checking_leaks_linearized`` checks nothing from jax 0.12 on."""


def checking_leaks_linearized() -> contextlib.AbstractContextManager[Any]:
    """``jax.checking_leaks()`` for a gradient through a custom rule whose map records its
    mask with a host callback; nothing from jax 0.12 on (``UPSTREAM_CALLBACK_LEAK``)."""
    if jax.__version_info__ >= (0, 12):
        return contextlib.nullcontext()
    return jax.checking_leaks()


DIRECT_ADJOINT_GRAD_BEFORE_JAX_010 = pytest.mark.xfail(
    tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 10),
    strict=False,  # the oldest set only; passes on jax 0.10.2 and 0.12
    reason=(
        "open (issue 29) on jax 0.8.1 only: diffrax's DirectAdjoint under a declaration, "
        "jax.jit(jax.grad) fails inside JAX (an AssertionError, never a silent result), "
        "under the Linen and NNX adapters alike"
    ),
)
"""The oldest set's ``jit(grad)`` through ``DirectAdjoint`` under a declaration."""
