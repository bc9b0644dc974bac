"""Implicit differentiation: the neutral custom rules, and a DEQ trained through a solver.

* ``jo.custom_vjp`` / ``jo.closure_convert`` with nothing active, against JAX's: an eager
  call of a ``custom_vjp`` function on a small array, and a ``closure_convert`` of a map
  that closes over an array (target <= 1.05x each).
* Haiku: ``jax.jit(jax.grad(loss))`` of a deep-equilibrium layer whose fixed point is
  found by ``examples/fpsolve.py`` (forward iteration, implicit gradient) inside
  ``hk.transform`` under ``jaxoverride_haiku``, against the same DEQ on raw JAX with the
  weights passed explicitly (target <= 1.05x, compiled cache-hit calls).
* Information: init against apply of the Haiku DEQ, eager and trace only: the cost of
  the creation passes that init runs before the implicit solver traces the map.
* NNX: ``jo.jit(jo.grad(loss))`` of the same DEQ as an ``nnx.Module`` under
  ``jaxoverride_nnx.track``, against the explicit version (target <= 1.3x).
* Information: time and peak temporary memory (XLA's memory analysis of the compiled
  gradient) of the implicit gradient against backpropagation through 200 unrolled steps.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

import jaxoverride as jo
from benchmarks._harness import Row, at_most, interleaved, main, ratio_rows

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from fpsolve import fixed_point

SUITE = "implicit"
N, BATCH = 16, 8


def _rules(quick: bool) -> list[Row]:
    x = jnp.linspace(-1.0, 1.0, 4)
    rows = []

    def sin_fwd(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        return jnp.sin(x), x

    def sin_bwd(x: jax.Array, g: jax.Array) -> tuple[jax.Array]:
        return (jnp.cos(x) * g,)

    functions = {}
    for label, kind in (("jo.custom_vjp", jo.custom_vjp), ("jax.custom_vjp", jax.custom_vjp)):
        f = kind(jnp.sin)
        f.defvjp(sin_fwd, sin_bwd)
        functions[label] = f
    samples = interleaved(
        {label: (lambda f=f: f(x)) for label, f in functions.items()},
        number=50 if quick else 400,
        rounds=5 if quick else 25,
    )
    rows += ratio_rows(
        SUITE, "custom_vjp call, nothing active", samples, "jax.custom_vjp",
        {"jo.custom_vjp": at_most(1.05)},
    )  # fmt: skip
    w = jnp.ones(4) * 0.5
    samples = interleaved(
        {
            "jo.closure_convert": lambda: jo.closure_convert(lambda z: jnp.tanh(z * w), x),
            "jax.closure_convert": lambda: jax.closure_convert(lambda z: jnp.tanh(z * w), x),
        },
        number=20 if quick else 100,
        rounds=5 if quick else 25,
    )
    rows += ratio_rows(
        SUITE, "closure_convert, nothing active", samples, "jax.closure_convert",
        {"jo.closure_convert": at_most(1.05)},
    )  # fmt: skip
    return rows


def _problem() -> tuple[dict[str, jax.Array], jax.Array]:
    kw, ku, kx = jax.random.split(jax.random.PRNGKey(0), 3)
    weights = {
        "w": jax.random.normal(kw, (N, N)) * (0.5 / N**0.5),
        "u": jax.random.normal(ku, (N, N)) * (1.0 / N**0.5),
        "b": jnp.zeros(N),
    }
    return weights, jax.random.normal(kx, (BATCH, N))


def _explicit_loss(weights: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    def f(z: jax.Array, p: Any) -> jax.Array:
        weights, x = p
        return jnp.tanh(z @ weights["w"] + x @ weights["u"] + weights["b"])

    return jnp.sum(fixed_point(f, jnp.zeros_like(x), (weights, x), method="forward").value ** 2)


def _timed_pair(
    case: str, ours: str, fn: Callable[[], Any], reference: Callable[[], Any], limit: float,
    quick: bool,
) -> list[Row]:  # fmt: skip
    samples = interleaved(
        {ours: fn, "explicit weights, raw JAX": reference},
        number=20 if quick else 100,
        rounds=5 if quick else 25,
    )
    return ratio_rows(SUITE, case, samples, "explicit weights, raw JAX", {ours: at_most(limit)})


def _haiku_deq() -> Any:
    """The DEQ in ``hk.transform``, its parameters (the problem's weights) and its input."""
    import haiku as hk

    weights, x = _problem()

    def forward(x: jax.Array) -> jax.Array:
        recurrent = hk.Linear(N, name="recurrent")
        injection = hk.Linear(N, with_bias=False, name="injection")
        f = lambda z, x: jnp.tanh(recurrent(z) + injection(x))
        return jnp.sum(fixed_point(f, jnp.zeros_like(x), x, method="forward").value ** 2)

    params = {
        "recurrent": {"w": weights["w"], "b": weights["b"]},
        "injection": {"w": weights["u"]},
    }
    return hk.transform(forward), params, weights, x


def _haiku(quick: bool) -> list[Row]:
    import jaxoverride_haiku as joh

    model, params, weights, x = _haiku_deq()
    with joh.context():
        grad = jax.jit(jax.grad(lambda p, x: model.apply(p, None, x)))
        block_ours = lambda: grad(params, x)
        explicit = jax.jit(jax.grad(_explicit_loss))
        block_ours()
        return _timed_pair(
            "DEQ jax.jit(jax.grad) in hk.transform", "haiku + fpsolve (implicit)",
            block_ours, lambda: explicit(weights, x), 1.05, quick,
        )  # fmt: skip


def _haiku_init(quick: bool) -> list[Row]:
    """Information: what init's creation passes cost. Eager calls (each traces the solver
    again: its map is a new function per call) and the trace alone (``jax.jit(...).lower``,
    no compilation), init against apply of the same DEQ."""
    import jaxoverride_haiku as joh

    model, params, _, x = _haiku_deq()
    key = jax.random.PRNGKey(0)
    rows = []
    with joh.context():
        eager = interleaved(
            {"init": lambda: model.init(key, x), "apply": lambda: model.apply(params, None, x)},
            number=1 if quick else 3,
            rounds=3 if quick else 9,
            warmup=1,
        )
        rows += ratio_rows(
            SUITE, "Haiku DEQ init vs apply, eager", eager, "apply",
            note="creation pass of the implicit fpsolve (closure_convert + custom_vjp) at init",
        )  # fmt: skip
        # A new function per call: jax.jit caches the trace of a function it has seen.
        init = lambda: jax.jit(lambda k, x: model.init(k, x)).lower(key, x)
        apply = lambda: jax.jit(lambda p, x: model.apply(p, None, x)).lower(params, x)
        traced = interleaved(
            {"init": init, "apply": apply},
            number=1 if quick else 3,
            rounds=3 if quick else 9,
            warmup=1,
        )
        rows += ratio_rows(
            SUITE, "Haiku DEQ init vs apply, trace only", traced, "apply",
            note="jax.jit(...).lower: tracing with the creation pass, no compilation",
        )  # fmt: skip
    return rows


def _nnx(quick: bool) -> list[Row]:
    from flax import nnx

    import jaxoverride_nnx

    weights, x = _problem()

    class DEQ(nnx.Module):
        def __init__(self) -> None:
            self.recurrent = nnx.Linear(N, N, rngs=nnx.Rngs(0))
            self.injection = nnx.Linear(N, N, use_bias=False, rngs=nnx.Rngs(1))
            self.recurrent.kernel[...] = weights["w"]
            self.injection.kernel[...] = weights["u"]

        def __call__(self, x: jax.Array) -> jax.Array:
            f = lambda z, x: jnp.tanh(self.recurrent(z) + self.injection(x))
            solution = fixed_point(f, jnp.zeros_like(x), x, method="forward")
            return jnp.sum(solution.value**2)

    model = DEQ()
    explicit = jax.jit(jax.grad(_explicit_loss))
    with jaxoverride_nnx.track(model):
        grad = jo.jit(lambda x: jo.grad(lambda m: m(x))(model))
        grad(x)
        return _timed_pair(
            "DEQ jo.jit(jo.grad) under nnx track", "nnx + fpsolve (implicit)",
            lambda: grad(x), lambda: explicit(weights, x), 1.3, quick,
        )  # fmt: skip


def _implicit_against_unrolled(quick: bool) -> list[Row]:
    weights, x = _problem()

    def unrolled_loss(weights: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        def f(z: jax.Array, p: Any) -> jax.Array:
            weights, x = p
            return jnp.tanh(z @ weights["w"] + x @ weights["u"] + weights["b"])

        solution = fixed_point(f, jnp.zeros_like(x), (weights, x), method="unrolled", max_iter=200)
        return jnp.sum(solution.value**2)

    implicit = jax.jit(jax.grad(_explicit_loss))
    unrolled = jax.jit(jax.grad(unrolled_loss))
    samples = interleaved(
        {"implicit (forward, adjoint)": lambda: implicit(weights, x),
         "unrolled 200 steps": lambda: unrolled(weights, x)},
        number=10 if quick else 50,
        rounds=5 if quick else 15,
    )  # fmt: skip

    def temp_bytes(fn: Callable[..., Any]) -> int:
        analysis = fn.lower(weights, x).compile().memory_analysis()
        return int(getattr(analysis, "temp_size_in_bytes", 0))

    memory = f"peak temporary memory {temp_bytes(implicit) / 1024:.0f} KiB implicit vs "
    memory += f"{temp_bytes(unrolled) / 1024:.0f} KiB unrolled (XLA memory analysis)"
    return ratio_rows(
        SUITE, "DEQ gradient, 200-step solve", samples, "unrolled 200 steps", note=memory
    )


def _guarded(case: str, measure: Callable[[bool], list[Row]], quick: bool) -> list[Row]:
    try:
        return measure(quick)
    except Exception as error:  # a suite must report, not crash, when a case cannot run
        first_line = next(iter(str(error).splitlines()), "(no message)")  # an assert has none
        why = f"{type(error).__name__}: {first_line[:160]}"
        return [Row(SUITE, case, "-", "-", float("nan"), float("nan"), float("nan"),
                    note=f"not measured: {why}")]  # fmt: skip


def run(quick: bool) -> list[Row]:
    """Every measurement of the implicit-differentiation suite."""
    rows = _rules(quick)
    rows += _guarded("DEQ jax.jit(jax.grad) in hk.transform", _haiku, quick)
    rows += _guarded("Haiku DEQ init vs apply", _haiku_init, quick)
    rows += _guarded("DEQ jo.jit(jo.grad) under nnx track", _nnx, quick)
    rows += _implicit_against_unrolled(quick)
    return rows


if __name__ == "__main__":
    main(run)
