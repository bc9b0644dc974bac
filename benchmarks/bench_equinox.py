"""The Equinox family (optimistix, diffrax), unmodified, inside ``hk.transform``.

The suite calls ``jo.interpose_on_import("equinox", "optimistix", "diffrax")`` before it
imports them (``benchmarks.run`` runs each suite in its own process), then measures
compiled cache-hit calls of ``jax.jit(jax.grad(loss))`` with respect to the Haiku
parameters, under ``jaxoverride_haiku.context()``, against the same library call on the
parameters passed explicitly (raw JAX; target <= 1.05x each):

* a deep-equilibrium layer whose fixed point ``optimistix.fixed_point`` finds with
  ``FixedPointIteration`` (implicit gradient through optimistix's ``ImplicitAdjoint``);
* a neural ODE (an MLP vector field) integrated by ``diffrax.diffeqsolve`` with ``Tsit5``
  and its default ``RecursiveCheckpointAdjoint``.

Both gradients are checked against the explicit ones before timing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxoverride as jo
from benchmarks._harness import Row, at_most, interleaved, main, ratio_rows

SUITE = "equinox"
N, BATCH, HIDDEN = 16, 8, 32
BASELINE = "explicit params, raw JAX"


def _import_libraries() -> tuple[Any, Any]:
    # Before the first import: eqx.filter_jit builds its jax.jit when optimistix is imported.
    jo.interpose_on_import("equinox", "optimistix", "diffrax")
    import diffrax
    import optimistix

    return optimistix, diffrax


optx, diffrax = _import_libraries()


def _linear(bundle: dict[str, jax.Array]) -> Callable[[jax.Array], jax.Array]:
    """``hk.Linear`` on explicit parameters, op for op, so both sides compile the same ops."""

    def apply(x: jax.Array) -> jax.Array:
        out = jnp.dot(x, bundle["w"])
        return out + jnp.broadcast_to(bundle["b"], out.shape)

    return apply


def _deq(linear: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    solver = optx.FixedPointIteration(rtol=1e-5, atol=1e-5)
    fn = lambda z, x: jnp.tanh(linear(z) + x)
    return optx.fixed_point(fn, solver, jnp.zeros_like(x), args=x, max_steps=200).value


def _ode(vector_field: Callable[[jax.Array], jax.Array], y0: jax.Array) -> jax.Array:
    term = diffrax.ODETerm(lambda t, y, args: vector_field(y))
    return diffrax.diffeqsolve(term, diffrax.Tsit5(), 0.0, 1.0, 0.1, y0).ys[-1]


def _compare(
    case: str, ours: str, model_loss: Callable[..., Any], explicit_loss: Callable[..., Any],
    params: Any, x: jax.Array, quick: bool,
) -> list[Row]:  # fmt: skip
    import jaxoverride_haiku as joh

    with joh.context():
        grad = jax.jit(jax.grad(model_loss))
        explicit = jax.jit(jax.grad(explicit_loss))
        got, want = grad(params, x), explicit(params, x)
        check = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
        jax.tree.map(check, got, want)
        samples = interleaved(
            {ours: lambda: grad(params, x), BASELINE: lambda: explicit(params, x)},
            number=10 if quick else 50,
            rounds=5 if quick else 25,
        )
    return ratio_rows(SUITE, case, samples, BASELINE, {ours: at_most(1.05)})


def _fixed_point(quick: bool) -> list[Row]:
    import haiku as hk

    import jaxoverride_haiku as joh

    x = jax.random.normal(jax.random.PRNGKey(1), (BATCH, N))
    init = hk.initializers.RandomNormal(0.5 / N**0.5)
    model = hk.without_apply_rng(
        hk.transform(lambda x: _deq(hk.Linear(N, w_init=init, name="cell"), x))
    )

    def explicit_loss(params: Any, x: jax.Array) -> jax.Array:
        return jnp.sum(_deq(_linear(params["cell"]), x) ** 2)

    with joh.context():
        params = model.init(jax.random.PRNGKey(0), x)
    return _compare(
        "optimistix.fixed_point jax.jit(jax.grad) in hk.transform", "haiku + optimistix",
        lambda p, x: jnp.sum(model.apply(p, x) ** 2), explicit_loss, params, x, quick,
    )  # fmt: skip


def _neural_ode(quick: bool) -> list[Row]:
    import haiku as hk

    import jaxoverride_haiku as joh

    y0 = jax.random.normal(jax.random.PRNGKey(1), (N,))
    mlp = lambda: hk.nets.MLP([HIDDEN, N], activation=jnp.tanh, name="field")
    model = hk.without_apply_rng(hk.transform(lambda y0: _ode(mlp(), y0)))
    with joh.context():
        params = model.init(jax.random.PRNGKey(0), y0)

    def explicit_loss(params: Any, y0: jax.Array) -> jax.Array:
        first, second = _linear(params["field/~/linear_0"]), _linear(params["field/~/linear_1"])
        field = lambda y: second(jnp.tanh(first(y)))
        return jnp.sum(_ode(field, y0) ** 2)

    return _compare(
        "diffrax neural ODE jax.jit(jax.grad) in hk.transform", "haiku + diffrax",
        lambda p, y0: jnp.sum(model.apply(p, y0) ** 2), explicit_loss, params, y0, quick,
    )  # fmt: skip


def _guarded(case: str, measure: Callable[[bool], list[Row]], quick: bool) -> list[Row]:
    try:
        return measure(quick)
    except Exception as error:  # a suite must report, not crash, when a case cannot run
        first_line = next(iter(str(error).splitlines()), "(no message)")  # an assert has none
        why = f"{type(error).__name__}: {first_line[:160]}"
        return [Row(SUITE, case, "-", "-", float("nan"), float("nan"), float("nan"),
                    note=f"not measured: {why}")]  # fmt: skip


def run(quick: bool) -> list[Row]:
    """Every measurement of the Equinox-family suite."""
    rows = _guarded("optimistix.fixed_point jax.jit(jax.grad) in hk.transform", _fixed_point, quick)
    rows += _guarded("diffrax neural ODE jax.jit(jax.grad) in hk.transform", _neural_ode, quick)
    return rows


if __name__ == "__main__":
    main(run)
