"""The Equinox family (optimistix, lineax, diffrax), unmodified, inside Flax Linen modules.

Run in a fresh interpreter by ``tests/test_linen_libraries.py``, because import order
matters: ``jo.interpose_on_import`` is called *before* equinox, optimistix, lineax and
diffrax are imported (by ``tests/_equinox_common.py``, with the cases), so that the
``eqx.filter_jit`` they build at import holds a neutral ``jax.jit``.

``python tests/_equinox_linen.py CASE [CASE ...]`` prints one JSON object: for each case,
what the test asserts on (parameter shapes, tracer leaks, largest differences against the
same library run on the explicit parameters with raw JAX, and the refusals of a variable
write and an rng draw inside the callback). The cases ``diffrax_115`` and ``flax_2887``
are the programs of diffrax issue #115 and flax issue #2887, as their reporters wrote them.

Each other case is one library call ``solve(cell, x)``, where ``cell`` is the model's only
layer: an ``nn.Dense`` inside Linen, ``z @ kernel + bias`` on the explicit parameters.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jaxoverride as jo
import jaxoverride_linen
from _equinox_common import (  # importing it interposes the libraries, then imports them
    CASES,
    RNG,
    N,
    Solve,
    X,
    differences_from_explicit,
    diffrax,
    max_diff,
    refusal,
    report,
    tracers,
)
from _libraries import UPSTREAM_LEAK_CASES, leak_check, tracers_alive_after_clearing_caches

Cell = Callable[[jax.Array], jax.Array]
# The cases run when no names are given: least squares is in the Haiku suite only.
LINEN_CASES = [name for name in CASES if name != "least_squares_gauss_newton"]


class Model(nn.Module):
    """One ``nn.Dense`` named ``cell``, called by the library; ``extra`` wraps the call."""

    solve: Solve
    with_bias: bool
    extra: str = ""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dense = nn.Dense(
            N, use_bias=self.with_bias, kernel_init=nn.initializers.normal(0.3), name="cell"
        )
        cell: Cell = dense
        if self.extra == "write":
            # Created once per call (Linen refuses a second ``self.variable`` of one name),
            # written in the callback, which the library calls many times.
            calls = self.variable("counters", "calls", lambda: jnp.zeros((), jnp.int32))

            def cell(z: jax.Array) -> jax.Array:
                calls.value += 1
                return dense(z)

        elif self.extra == "draw":

            def cell(z: jax.Array) -> jax.Array:
                return dense(z) + 0.0 * jax.random.normal(self.make_rng("noise"), z.shape)

        elif self.extra == "write_outside":
            calls = self.variable("counters", "calls", lambda: jnp.zeros((), jnp.int32))
            calls.value += 1
        return self.solve(cell, x)


def _explicit(params: Any, with_bias: bool) -> Cell:
    """``nn.Dense`` on the explicit parameters."""

    def cell(z: jax.Array) -> jax.Array:
        out = z @ params["cell"]["kernel"]
        return out + params["cell"]["bias"] if with_bias else out

    return cell


def _shapes(tree: Any) -> Any:
    return jax.tree.map(lambda v: list(np.shape(v)), tree)


def _unadapted(run: Callable[[], Any]) -> dict[str, Any]:
    """The program without the adapter: ``raw`` with the missing-adapter check off (what
    the reporter saw), ``unadapted`` with it on (jaxoverride names the missing adapter)."""
    before = jo.set_adapter_check(False)
    try:
        raw = refusal(run)
    finally:
        jo.set_adapter_check(before)
    return {"raw": raw, "unadapted": refusal(run)}


def _leaks(name: str, before: int) -> dict[str, Any]:
    """Whether ``jax.checking_leaks()`` ran on the eager calls, and how many more tracers are
    alive after them than ``before`` (the raw programs of the issues leak theirs first)."""
    alive = tracers_alive_after_clearing_caches() - before
    return {"checking_leaks": name not in UPSTREAM_LEAK_CASES, "tracers_alive": alive}


def run_case(name: str) -> dict[str, Any]:
    solve, with_bias = CASES[name]
    model = Model(solve, with_bias)
    direct = nn.Dense(N, use_bias=with_bias)
    result: dict[str, Any] = {}
    # Eager calls under checking_leaks; jitted ones keep the library's callbacks (and so the
    # bound module) in JAX's caches, which the check would flag: their outputs are counted.
    before = tracers_alive_after_clearing_caches()
    with leak_check(name), jaxoverride_linen.context():
        variables = model.init(RNG, X)
        out = model.apply(variables, X)
    result |= _leaks(name, before)
    with jaxoverride_linen.context():
        try:
            jitted_variables = jax.jit(model.init)(RNG, X)
            result["jit_init"] = max_diff(variables, jitted_variables)
        except Exception as error:  # reported: the test names the cases where it fails
            jitted_variables = variables
            result["jit_init"] = f"{type(error).__name__}: {str(error)[:300]}"
        result["params"] = _shapes(variables)
        result["direct_params"] = _shapes({"params": {"cell": direct.init(RNG, X)["params"]}})
        result["init_output"] = max_diff(
            model.init_with_output(RNG, X)[0], model.apply(variables, X)
        )

        def loss(v: Any, x: jax.Array) -> jax.Array:
            return jnp.sum(model.apply(v, x) ** 2)

        jitted = jax.jit(model.apply)(variables, X)
        grads = jax.grad(loss, argnums=(0, 1))(variables, X)
        jitted_grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(variables, X)

        writer, drawer = Model(solve, with_bias, "write"), Model(solve, with_bias, "draw")
        counters = {"counters": {"calls": jnp.zeros((), jnp.int32)}}
        rngs = {"params": RNG, "noise": RNG}
        result["write_at_init"] = refusal(lambda: writer.init(RNG, X))
        result["write_at_apply"] = refusal(
            lambda: writer.apply({**variables, **counters}, X, mutable=["counters"])
        )
        result["write_under_jit"] = refusal(
            lambda: jax.jit(lambda v: writer.apply(v, X, mutable=["counters"]))(
                {**variables, **counters}
            )
        )
        result["draw_at_init"] = refusal(lambda: drawer.init(rngs, X))
        result["draw_at_apply"] = refusal(lambda: drawer.apply(variables, X, rngs={"noise": RNG}))
        after_refusals = model.apply(variables, X)

        outside = Model(solve, with_bias, "write_outside")
        outside_variables = outside.init(RNG, X)
        outside_out, state = outside.apply(outside_variables, X, mutable=["counters"])
        result["write_outside_calls"] = int(state["counters"]["calls"])

    jaxoverride_linen.install()
    try:
        installed_variables = model.init(RNG, X)
        installed = jax.jit(model.apply)(variables, X)
    finally:
        jaxoverride_linen.uninstall()
    result["installed_params"] = max_diff(installed_variables, variables)

    params = variables["params"]

    def reference_loss(v: Any, x: jax.Array) -> jax.Array:
        return jnp.sum(solve(_explicit(v["params"], with_bias), x) ** 2)

    expected = solve(_explicit(params, with_bias), X)
    expected_grads = jax.grad(reference_loss, argnums=(0, 1))(variables, X)
    outputs = (out, jitted, installed, after_refusals, outside_out)
    result |= differences_from_explicit(expected, expected_grads, outputs, (grads, jitted_grads))
    result["tracers"] = tracers((variables, jitted_variables, out, jitted, grads, jitted_grads))
    return result


# -- diffrax issue #115 (ameya98's program) -------------------------------------------------


class NeuralODE115(nn.Module):
    derivative_net: nn.Module

    @nn.compact
    def __call__(self, coords: jax.Array) -> jax.Array:
        def f(t: Any, y: jax.Array, args: Any) -> jax.Array:
            return self.derivative_net(y)

        term = diffrax.ODETerm(f)
        solver = diffrax.Dopri5()
        solution = diffrax.diffeqsolve(term, solver, t0=0, t1=1, dt0=0.1, y0=coords)
        return solution.ys


def run_diffrax_115() -> dict[str, Any]:
    coords = jnp.ones((1, 4))
    model = NeuralODE115(derivative_net=nn.Dense(4))
    rng = jax.random.PRNGKey(0)
    result: dict[str, Any] = _unadapted(lambda: jax.jit(model.init)(rng, coords))
    jaxoverride_linen.install()
    try:
        params = jax.jit(model.init)(rng, coords)  # the reporter's line
        before = tracers_alive_after_clearing_caches()
        with leak_check("diffrax_115"):
            eager = model.init(rng, coords)
            ys = model.apply(params, coords)
        result |= _leaks("diffrax_115", before)
        grads = jax.jit(jax.grad(lambda p: jnp.sum(model.apply(p, coords) ** 2)))(params)
    finally:
        jaxoverride_linen.uninstall()
    dense = params["params"]["derivative_net"]

    def explicit(p: Any) -> jax.Array:
        f = lambda t, y, args: y @ p["kernel"] + p["bias"]
        term = diffrax.ODETerm(f)
        return diffrax.diffeqsolve(term, diffrax.Dopri5(), t0=0, t1=1, dt0=0.1, y0=coords).ys

    expected_grads = jax.grad(lambda p: jnp.sum(explicit(p) ** 2))(dense)
    result.update(
        params=_shapes(params),
        eager_init=max_diff(eager, params),
        apply=max_diff(ys, explicit(dense)),
        grad=max_diff(grads["params"]["derivative_net"], expected_grads),
        tracers=tracers((params, eager, ys, grads)),
    )
    return result


# -- flax issue #2887 (PhilipVinc's program) ------------------------------------------------


class NeuralODE2887(nn.Module):
    hidden_dims: int = (4,)  # type: ignore[assignment]  # as the reporter wrote it
    solver: Any = diffrax.Euler()

    def setup(self) -> None:
        self.ode_term = nn.Dense(features=1)

    def __call__(self, x: jax.Array) -> Any:
        def _odefun(t: Any, y: jax.Array, args: Any) -> jax.Array:
            return self.ode_term(y)

        term = diffrax.ODETerm(_odefun)
        solution = diffrax.diffeqsolve(term, self.solver, t0=0, t1=1, dt0=0.1, y0=x)
        return solution


def run_flax_2887() -> dict[str, Any]:
    node = NeuralODE2887()
    x = jnp.ones(1)
    key = jax.random.PRNGKey(1)
    result: dict[str, Any] = _unadapted(lambda: node.init(key, x))
    before = tracers_alive_after_clearing_caches()
    with leak_check("flax_2887"), jaxoverride_linen.context():
        pars = node.init(key, x)  # the reporter's line
        solution = node.apply(pars, x)
    result |= _leaks("flax_2887", before)
    with jaxoverride_linen.context():
        jitted = jax.jit(node.init)(key, x)
        jitted_solution = jax.jit(node.apply)(pars, x)
    dense = pars["params"]["ode_term"]
    f = lambda t, y, args: y @ dense["kernel"] + dense["bias"]
    expected = diffrax.diffeqsolve(diffrax.ODETerm(f), diffrax.Euler(), t0=0, t1=1, dt0=0.1, y0=x)
    result.update(
        params=_shapes(pars),
        jit_init=max_diff(pars, jitted),
        apply=max_diff(solution.ys, expected.ys),
        jit_apply=max_diff(jitted_solution.ys, expected.ys),
        tracers=tracers((pars, jitted, solution.ys, jitted_solution.ys)),
    )
    return result


PROGRAMS = {"diffrax_115": run_diffrax_115, "flax_2887": run_flax_2887}


def run(name: str) -> dict[str, Any]:
    """One of ``PROGRAMS``, or ``run_case(name)``."""
    return PROGRAMS[name]() if name in PROGRAMS else run_case(name)


if __name__ == "__main__":
    report(sys.argv[1:] or [*LINEN_CASES, *PROGRAMS], run)
