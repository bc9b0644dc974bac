"""The implicit-differentiation names under ``jaxoverride_dag.context()``: JAX's own.

The DAG adapter does not override ``custom_vjp``, ``custom_jvp``, ``closure_convert``,
``make_jaxpr``, ``lax.custom_root`` or ``lax.custom_linear_solve``: a custom rule's
arguments are flattened by JAX, exactly as without the adapter (``docs/dag.md`` says so).
These tests pin that down: the same results, jaxprs and errors as JAX.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import _implicit_solver as solver
import jaxoverride as jo
import jaxoverride_dag as dag
from _parity import error_messages

NAMES = ("custom_vjp", "custom_jvp", "closure_convert", "make_jaxpr", "lax.custom_root",
         "lax.custom_linear_solve")  # fmt: skip
JAX_OBJECTS = (jax.custom_vjp, jax.custom_jvp, jax.closure_convert, jax.make_jaxpr,
               jax.lax.custom_root, jax.lax.custom_linear_solve)  # fmt: skip


def test_the_names_resolve_to_jax_under_the_dag_context():
    with dag.context():
        assert [jo.resolve(name) for name in NAMES] == list(JAX_OBJECTS)


def _tied(w):
    """One array passed twice to a custom rule: JAX sees two arguments."""
    f = jo.custom_vjp(lambda a, b: jnp.sum(a * b))
    f.defvjp(lambda a, b: (jnp.sum(a * b), (a, b)), lambda r, g: (r[1] * g, r[0] * g))
    return f(w, w)


def test_shared_arrays_in_a_rule_behave_as_in_jax():
    w = jnp.arange(3.0)
    expected = jax.grad(_tied)(w)
    expected_jaxpr = str(jax.make_jaxpr(jax.grad(_tied))(w))
    with dag.context():
        np.testing.assert_array_equal(jo.grad(_tied)(w), expected)
        assert str(jax.make_jaxpr(jo.grad(_tied))(w)) == expected_jaxpr


def test_the_implicit_solver_under_dag_equals_raw_jax():
    weights = {"w": jnp.eye(3) * 0.4, "tied": None}
    weights["tied"] = weights["w"]

    def loss(weights, x):
        f = lambda z, x: jnp.tanh(weights["w"] @ z + weights["tied"] @ z * 0.1 + x)
        return jnp.sum(solver.fixed_point(f, jnp.zeros(3), x) ** 2)

    x = jnp.linspace(-1.0, 1.0, 3)
    expected = jax.grad(loss)(weights, x)
    with dag.context():
        actual = jo.jit(jo.grad(loss))(weights, x)
    assert actual["w"] is actual["tied"], "jo.grad under DAG keeps the tie in its output"
    np.testing.assert_allclose(actual["w"], expected["w"] + expected["tied"], rtol=1e-5)


def test_a_non_array_rule_argument_fails_as_in_jax():
    def call(api):
        f = api.custom_vjp(lambda fn, x: fn(x))
        f.defvjp(lambda fn, x: (fn(x), None), lambda _, g: (None, g))
        return f(jnp.sin, jnp.ones(2))

    [expected] = error_messages([lambda: call(jax)])
    with dag.context():
        [actual] = error_messages([lambda: call(jo)])
    assert expected is not None and actual == expected


@pytest.mark.parametrize("name", ["custom_root", "custom_linear_solve"])
def test_custom_solves_under_dag_equal_jax(name):
    b = jnp.array([1.0, 2.0, 3.0])
    solve = lambda matvec, b: b / 2.0

    def run(api):
        if name == "custom_root":
            return api.lax.custom_root(lambda x: 2.0 * x - b, b, solve, solve)
        return api.lax.custom_linear_solve(lambda x: 2.0 * x, b, solve, symmetric=True)

    expected = run(jax)
    with dag.context():
        np.testing.assert_array_equal(run(jo), expected)
