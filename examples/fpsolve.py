"""A small fixed-point solver library, written only against jaxoverride's neutral API.

It stands for any third-party solver: it calls ``jit``, ``while_loop``, ``scan`` and
``jacfwd`` internally and knows nothing of Haiku, NNX or parameter creation. Adapters
make it work with stateful models inside ``f`` without changing a line here.

Solves ``z = f(z, args)`` for an array ``z`` of any shape, by

* ``"forward"``: plain iteration ``z <- f(z)`` in a ``while_loop``;
* ``"anderson"``: Anderson acceleration (type II) with a memory of ``m`` iterates;
* ``"newton"``: Newton's method on ``g(z) = f(z) - z``, with the Jacobian from ``jacfwd``;
* ``"unrolled"``: exactly ``max_iter`` forward steps in a ``scan``, differentiable in
  reverse mode (for training deep-equilibrium layers by backpropagation).

The other methods are differentiated *implicitly* by default: ``closure_convert`` hoists
whatever ``f`` closes over (model parameters included), and a ``custom_vjp`` solves the
adjoint fixed point ``u = z_bar + u df/dz`` at ``z*`` with the same method, so reverse
mode never differentiates through the loop (the implicit function theorem gives the
exact derivative of the fixed point).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp

import jaxoverride as jo
from jaxoverride import lax as jlax

Array = Any
FixedPointMap = Callable[[Array, Any], Array]
METHODS = ("forward", "anderson", "newton", "unrolled")


class Solution(NamedTuple):
    """The result of ``fixed_point``."""

    value: Array  # the fixed point z*
    iterations: Array  # steps taken
    residual: Array  # ||f(z*) - z*||, relative to max(1, ||z*||)


class _Settings(NamedTuple):
    """The solver's options (see ``fixed_point``); hashable, so a static argument."""

    method: str
    tol: float
    max_iter: int
    m: int
    beta: float
    ridge: float


def _residual(z: Array, fz: Array) -> Array:
    return jnp.linalg.norm((fz - z).ravel()) / jnp.maximum(1.0, jnp.linalg.norm(z.ravel()))


def _forward(f: FixedPointMap, z0: Array, args: Any, tol: float, max_iter: int) -> Solution:
    def cond(state):
        _, residual, i = state
        return (residual > tol) & (i < max_iter)

    def body(state):
        z, _, i = state
        fz = f(z, args)
        return fz, _residual(z, fz), i + 1

    z, residual, i = jlax.while_loop(cond, body, (z0, jnp.asarray(jnp.inf, z0.dtype), 0))
    return Solution(z, i, residual)


def _anderson(f: FixedPointMap, z0: Array, args: Any, settings: _Settings) -> Solution:
    _, tol, max_iter, m, beta, ridge = settings
    shape, n = z0.shape, z0.size
    f0 = f(z0, args).ravel()
    xs = jnp.tile(z0.ravel(), (m, 1))
    fs = jnp.tile(f0, (m, 1))

    def cond(state):
        *_, residual, i = state
        return (residual > tol) & (i < max_iter)

    def body(state):
        xs, fs, _, i = state
        gs = fs - xs
        gram = gs @ gs.T
        # Regularise relative to the scale of the residuals, which shrinks as we converge.
        scale = jnp.trace(gram) / m + jnp.finfo(z0.dtype).tiny
        gram = gram + ridge * scale * jnp.eye(m, dtype=z0.dtype)
        # Minimise ||alpha^T G|| subject to sum(alpha) = 1 via the bordered system.
        system = jnp.block(
            [
                [jnp.zeros((1, 1), z0.dtype), jnp.ones((1, m), z0.dtype)],
                [jnp.ones((m, 1), z0.dtype), gram],
            ]
        )
        rhs = jnp.zeros(m + 1, z0.dtype).at[0].set(1.0)
        alpha = jnp.linalg.solve(system, rhs)[1:]
        x_new = beta * (alpha @ fs) + (1.0 - beta) * (alpha @ xs)
        f_new = f(x_new.reshape(shape), args).ravel()
        slot = i % m
        xs = xs.at[slot].set(x_new)
        fs = fs.at[slot].set(f_new)
        return xs, fs, _residual(x_new, f_new), i + 1

    init = (xs, fs, _residual(z0.ravel(), f0), jnp.asarray(0))
    xs, fs, residual, i = jlax.while_loop(cond, body, init)
    del n
    best = (i - 1) % m
    return Solution(fs[best].reshape(shape), i, residual)


def _newton(f: FixedPointMap, z0: Array, args: Any, tol: float, max_iter: int) -> Solution:
    shape = z0.shape

    # Each iteration calls the map three times (the Jacobian, the step, the residual),
    # two of them directly: marked, each call is one evaluation under a declared
    # ``jaxoverride.solve_state`` (one dropout mask per solve, statistics at z*).
    @jo.solver_map
    def g(z_flat):
        return f(z_flat.reshape(shape), args).ravel() - z_flat

    def cond(state):
        _, residual, i = state
        return (residual > tol) & (i < max_iter)

    def body(state):
        z, _, i = state
        jacobian = jo.jacfwd(g)(z)
        z_new = z - jnp.linalg.solve(jacobian, g(z))
        return z_new, _residual(z_new, g(z_new) + z_new), i + 1

    start = z0.ravel()
    z, residual, i = jlax.while_loop(cond, body, (start, _residual(start, g(start) + start), 0))
    return Solution(z.reshape(shape), i, residual)


def _unrolled(f: FixedPointMap, z0: Array, args: Any, max_iter: int) -> Solution:
    def step(z, _):
        return f(z, args), None

    z, _ = jlax.scan(step, z0, length=max_iter)
    return Solution(z, jnp.asarray(max_iter), _residual(z, f(z, args)))


def _solve(f: FixedPointMap, z0: Array, args: Any, settings: _Settings) -> Solution:
    method, tol, max_iter = settings.method, settings.tol, settings.max_iter
    if method == "forward":
        return _forward(f, z0, args, tol, max_iter)
    if method == "anderson":
        return _anderson(f, z0, args, settings)
    if method == "newton":
        return _newton(f, z0, args, tol, max_iter)
    return _unrolled(f, z0, args, max_iter)


_solve_jit = jo.jit(_solve, static_argnames=("f", "settings"))


def _closing(converted: Callable[..., Array], constants: Any) -> FixedPointMap:
    return lambda z, args: converted(z, args, *constants)


@functools.partial(jo.custom_vjp, nondiff_argnums=(0, 1))
def _implicit(
    converted: Callable[..., Array], settings: _Settings, z0: Array, args: Any, constants: Any
) -> Solution:
    return _solve(_closing(converted, constants), z0, args, settings)


def _implicit_fwd(
    converted: Callable[..., Array], settings: _Settings, z0: Array, args: Any, constants: Any
) -> tuple[Solution, Any]:
    solution = _implicit(converted, settings, z0, args, constants)
    return solution, (solution.value, args, constants)


def _implicit_bwd(
    converted: Callable[..., Array], settings: _Settings, residuals: Any, cotangent: Solution
) -> tuple[Any, Any, Any]:
    z, args, constants = residuals
    z_bar = cotangent.value
    _, vjp_z = jo.vjp(lambda z: converted(z, args, *constants), z)
    # The adjoint u solves u = z_bar + u df/dz: a fixed point of a linear map, solved by
    # the same method as the forward problem.
    adjoint = _solve(lambda u, _: vjp_z(u)[0] + z_bar, z_bar, None, settings).value
    _, vjp_rest = jo.vjp(lambda a, c: converted(z, a, *c), args, constants)
    args_bar, constants_bar = vjp_rest(adjoint)
    return jnp.zeros_like(z), args_bar, constants_bar


_implicit.defvjp(_implicit_fwd, _implicit_bwd)


def _solve_implicitly(f: FixedPointMap, z0: Array, args: Any, settings: _Settings) -> Solution:
    converted, constants = jo.closure_convert(f, z0, args)
    return _implicit(converted, settings, z0, args, tuple(constants))


_solve_implicitly_jit = jo.jit(_solve_implicitly, static_argnames=("f", "settings"))


def fixed_point(
    f: FixedPointMap,
    z0: Array,
    args: Any = None,
    *,
    method: str = "anderson",
    tol: float = 1e-5,
    max_iter: int = 200,
    m: int = 5,
    beta: float = 1.0,
    ridge: float = 1e-6,
    jit: bool = True,
    implicit: bool = True,
) -> Solution:
    """Finds ``z`` with ``z = f(z, args)``.

    Args:
      f: the map; called as ``f(z, args)`` and returning an array shaped like ``z``.
        Under ``jit=True`` it is a static argument, so pass the same function object
        each time to reuse the compiled solver.
      z0: the starting point.
      args: an arbitrary pytree passed through to ``f`` (parameters, inputs).
      method: ``"forward"``, ``"anderson"``, ``"newton"`` or ``"unrolled"``.
      tol: stop when the relative residual falls below this.
      max_iter: the iteration limit (the exact step count for ``"unrolled"``).
      m, beta, ridge: Anderson memory, mixing and regularisation.
      jit: compile the solver with ``jaxoverride.jit``.
      implicit: differentiate ``"forward"``, ``"anderson"`` and ``"newton"`` implicitly
        (reverse mode, w.r.t. ``args`` and everything ``f`` closes over). ``False``
        leaves the bare loop: forward mode (``jacfwd``) works through it, reverse mode
        does not. ``"unrolled"`` is always differentiated by backpropagation.

    Returns:
      A ``Solution(value, iterations, residual)``.

    Example:
      >>> import jax.numpy as jnp
      >>> sol = fixed_point(lambda z, a: jnp.cos(z) * a, jnp.zeros(3), 1.0)
      >>> bool(sol.residual < 1e-5), sol.value.round(4).tolist()
      (True, [0.7391, 0.7391, 0.7391])
    """
    if method not in METHODS:
        raise ValueError(f"fixed_point: unknown method {method!r}; choose one of {METHODS}.")
    z0 = jnp.asarray(z0)
    settings = _Settings(method, tol, max_iter, m, beta, ridge)
    if implicit and method != "unrolled":
        solve_implicitly = _solve_implicitly_jit if jit else _solve_implicitly
        return solve_implicitly(f, z0, args, settings)
    solve = _solve_jit if jit else _solve
    return solve(f, z0, args, settings)
