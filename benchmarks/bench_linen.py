"""Flax Linen adapter: solvers inside ``nn.Module``, against Linen's own and raw JAX.

All rows time compiled, cache-hit calls, with ``jaxoverride_linen.install()`` active.

* ``DEQ apply``: ``jax.jit(model.apply)`` of a Linen DEQ whose fixed point is found by
  ``examples/fpsolve.py`` (forward iteration), against the same model written by hand
  with ``nn.while_loop`` (target <= 1.05x);
* ``DEQ grad, implicit``: ``jax.jit(jax.grad(loss))`` w.r.t. the Linen params, fpsolve's
  implicit gradient (Anderson), against the explicit-parameter twin on raw JAX (the same
  fpsolve call on ``(W, U, b)``; target <= 1.05x);
* ``optimistix`` / ``diffrax``: ``jax.jit(jax.grad(loss))`` of a Linen module calling
  ``optimistix.fixed_point`` / ``diffrax.diffeqsolve`` on an ``nn.Dense``, against the same
  library call on explicit parameters (target <= 1.05x);
* ``jax.jit(model.init)``: the fpsolve DEQ's compiled init against the ``nn.while_loop``
  model's (target <= 1.5x: init also runs the creation pass's step);
* ``jo.jit dispatch``: ``jo.jit`` outside any Linen module with ``install()`` active,
  against ``jax.jit`` (target <= 1.05x).

The Equinox family is interposed on import (``jo.interpose_on_import``), so this suite
must be the first to import equinox in its process: ``benchmarks.run`` runs each suite in
its own process.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

import jaxoverride as jo
from benchmarks._harness import Row, at_most, interleaved, main, ratio_rows

jo.interpose_on_import("equinox", "optimistix", "lineax", "diffrax")

import diffrax  # noqa: E402
import flax.linen as nn  # noqa: E402
import optimistix as optx  # noqa: E402

import jaxoverride_linen  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from fpsolve import fixed_point  # noqa: E402

SUITE = "linen"
N, D = 32, 8
TOL, MAX_ITER = 1e-5, 200


def _residual(z: jax.Array, fz: jax.Array) -> jax.Array:
    return jnp.linalg.norm(fz - z) / jnp.maximum(1.0, jnp.linalg.norm(z))


class _DEQCell(nn.Module):
    """The layers and the map ``z -> tanh(z W + x U + b)`` of both DEQs below."""

    def setup(self) -> None:
        self.recurrent = nn.Dense(N, kernel_init=nn.initializers.normal(0.3 / N**0.5))
        self.injection = nn.Dense(N, use_bias=False)

    def cell(self, z: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.tanh(self.recurrent(z) + self.injection(x))


class FpsolveDEQ(_DEQCell):
    """``z* = tanh(z* W + x U + b)`` through the neutral solver."""

    method: str = "forward"

    def __call__(self, x: jax.Array) -> jax.Array:
        z0 = jnp.zeros(N)
        return fixed_point(self.cell, z0, x, method=self.method, tol=TOL, max_iter=MAX_ITER).value


class WhileLoopDEQ(_DEQCell):
    """The same forward iteration written by hand with Linen's ``nn.while_loop``."""

    def __call__(self, x: jax.Array) -> jax.Array:
        def cond(module: Any, carry: Any) -> jax.Array:
            _, residual, i = carry
            return (residual > TOL) & (i < MAX_ITER)

        def body(module: Any, carry: Any) -> Any:
            z, _, i = carry
            fz = module.cell(z, x)
            return fz, _residual(z, fz), i + 1

        if self.is_initializing():  # nn.while_loop creates no variables
            self.cell(jnp.zeros(N), x)
        carry = (jnp.zeros(N), jnp.asarray(jnp.inf), 0)
        return nn.while_loop(cond, body, self, carry)[0]


def _explicit_map(z: jax.Array, args: Any) -> jax.Array:
    (W, b, U), x = args
    return jnp.tanh(z @ W + b + x @ U)


def _deq(quick: bool) -> list[Row]:
    x = jax.random.normal(jax.random.key(1), (D,))
    number, rounds = (10, 5) if quick else (100, 25)
    ours, theirs = FpsolveDEQ(), WhileLoopDEQ()
    variables = ours.init(jax.random.key(0), x)
    apply_ours, apply_theirs = jax.jit(ours.apply), jax.jit(theirs.apply)
    init_ours, init_theirs = jax.jit(ours.init), jax.jit(theirs.init)
    key = jax.random.key(0)
    measured = {  # case: (fpsolve in Linen, nn.while_loop, target ratio)
        "DEQ apply, compiled (forward iteration)": (
            lambda: apply_ours(variables, x),
            lambda: apply_theirs(variables, x),
            1.05,
        ),
        "jax.jit(model.init), DEQ": (lambda: init_ours(key, x), lambda: init_theirs(key, x), 1.5),
    }
    rows = []
    for case, (fpsolve, while_loop, limit) in measured.items():
        samples = interleaved(
            {"fpsolve in Linen": fpsolve, "nn.while_loop": while_loop},
            number=number,
            rounds=rounds,
        )
        rows += ratio_rows(
            SUITE, case, samples, "nn.while_loop", {"fpsolve in Linen": at_most(limit)}
        )

    implicit = FpsolveDEQ("anderson")
    params = variables["params"]
    explicit = (
        (params["recurrent"]["kernel"], params["recurrent"]["bias"]),
        params["injection"]["kernel"],
    )

    def loss_linen(p: Any) -> jax.Array:
        return jnp.sum(implicit.apply({"params": p}, x) ** 2)

    def loss_explicit(p: Any) -> jax.Array:
        (W, b), U = p
        z = fixed_point(_explicit_map, jnp.zeros(N), ((W, b, U), x), tol=TOL, max_iter=MAX_ITER)
        return jnp.sum(z.value**2)

    grad_linen, grad_explicit = jax.jit(jax.grad(loss_linen)), jax.jit(jax.grad(loss_explicit))
    rows += ratio_rows(
        SUITE,
        "DEQ jax.jit(jax.grad), implicit (Anderson)",
        interleaved(
            {
                "fpsolve in Linen": lambda: grad_linen(params),
                "explicit params, raw JAX": lambda: grad_explicit(explicit),
            },
            number=number,
            rounds=rounds,
        ),
        "explicit params, raw JAX",
        {"fpsolve in Linen": at_most(1.05)},
    )
    return rows


def _optimistix_solve(cell: Any, x: jax.Array) -> jax.Array:
    solver = optx.FixedPointIteration(rtol=1e-6, atol=1e-6)
    fun = lambda z, args: jnp.tanh(cell(z) + x)
    return optx.fixed_point(fun, solver, jnp.zeros(N), max_steps=100).value


def _diffrax_solve(cell: Any, x: jax.Array) -> jax.Array:
    term = diffrax.ODETerm(lambda t, y, args: jnp.tanh(cell(y) + x) - y)
    return diffrax.diffeqsolve(term, diffrax.Tsit5(), 0.0, 1.0, 0.1, jnp.zeros(N)).ys[-1]


class LibraryModel(nn.Module):
    solve: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dense = nn.Dense(N, kernel_init=nn.initializers.normal(0.3 / N**0.5), name="cell")
        return self.solve(dense, x)


def _libraries(quick: bool) -> list[Row]:
    x = jax.random.normal(jax.random.key(1), (N,))
    number, rounds = (10, 5) if quick else (50, 25)
    rows = []
    for library, solve in (("optimistix.fixed_point", _optimistix_solve),
                           ("diffrax.diffeqsolve", _diffrax_solve)):  # fmt: skip
        model = LibraryModel(solve)
        params = model.init(jax.random.key(0), x)["params"]

        def explicit_cell(p: Any) -> Any:
            return lambda z: z @ p["cell"]["kernel"] + p["cell"]["bias"]

        def loss_linen(p: Any, model: LibraryModel = model) -> jax.Array:
            return jnp.sum(model.apply({"params": p}, x) ** 2)

        def loss_explicit(p: Any, solve: Any = solve) -> jax.Array:
            return jnp.sum(solve(explicit_cell(p), x) ** 2)

        grad_linen = jax.jit(jax.grad(loss_linen))
        grad_explicit = jax.jit(jax.grad(loss_explicit))
        rows += ratio_rows(
            SUITE,
            f"{library} in Linen, jax.jit(jax.grad)",
            interleaved(
                {
                    "Linen module": lambda g=grad_linen, p=params: g(p),
                    "explicit params, raw JAX": lambda g=grad_explicit, p=params: g(p),
                },
                number=number,
                rounds=rounds,
            ),
            "explicit params, raw JAX",
            {"Linen module": at_most(1.05)},
        )
    return rows


def _add_one(x: jax.Array) -> jax.Array:
    return x + 1


def _dispatch(quick: bool) -> list[Row]:
    rounds, number = (9, 2000) if quick else (31, 5000)
    x = jnp.ones((8,), jnp.float32)
    ours, theirs = jo.jit(_add_one), jax.jit(_add_one)
    return ratio_rows(
        SUITE,
        "jo.jit dispatch outside Linen, install() active",
        interleaved(
            {"jax.jit": lambda: theirs(x), "jo.jit": lambda: ours(x)},
            number=number,
            rounds=rounds,
        ),
        "jax.jit",
        {"jo.jit": at_most(1.05)},
        "predicate: Linen's module stack is empty; call not blocked on",
    )


def run(quick: bool) -> list[Row]:
    """Every measurement of the Linen suite, with the adapter installed."""
    jaxoverride_linen.install()
    try:
        return _dispatch(quick) + _deq(quick) + _libraries(quick)
    finally:
        jaxoverride_linen.uninstall()


if __name__ == "__main__":
    main(run)
