"""Haiku init traces each loop body and each distinct branch once, as apply and JAX do.

The counts follow Haiku's own ``stateful_test.py`` (``test_cond_traces_branches_with_same_id_once``,
``test_switch_traces_cases_with_same_id_once``): a witness list records each call of a
branch; the adapter's count must equal ``jax.lax``'s, at init and at apply.
"""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxoverride_haiku as joh
from jaxoverride import lax as jlax


def _init_and_apply(fun):
    model = hk.transform(fun)
    with joh.context(), jax.checking_leaks():
        params = model.init(jax.random.PRNGKey(0), jnp.ones(3))
        out = model.apply(params, jax.random.PRNGKey(1), jnp.ones(3))
    return params, out


def test_cond_traces_branches_with_same_id_once_at_init_and_apply() -> None:
    witness: list[None] = []

    def f(x):
        witness.append(None)
        return x**2

    counts = []

    def program(x):
        del witness[:]
        jlax.cond(False, f, f, 0)
        counts.append(len(witness))
        return x

    _init_and_apply(program)
    del witness[:]
    jax.lax.cond(False, f, f, 0)
    assert counts == [len(witness)] * 2 == [1, 1]


@pytest.mark.parametrize("n", [1, 2, 4])
def test_switch_traces_cases_with_same_id_once_at_init_and_apply(n: int) -> None:
    calls = {"f": 0, "g": 0}

    def f(x):
        calls["f"] += 1
        return x**2

    def g(x):
        calls["g"] += 1
        return x**2

    seen = []

    def program(x):
        calls.update(f=0, g=0)
        jlax.switch(0, [f, g] * n, 2)
        seen.append(dict(calls))
        return x

    _init_and_apply(program)
    assert seen == [{"f": 1, "g": 1}] * 2


@pytest.mark.parametrize("jit", [False, True])
def test_a_loop_body_that_creates_parameters_is_traced_as_often_at_init_as_at_apply(
    jit: bool,
) -> None:
    traces: list[str] = []

    def body(carry):
        z, i = carry
        traces.append("body")
        return jnp.tanh(hk.Linear(3)(z)), i + 1

    def forward(x):
        return jlax.while_loop(lambda c: c[1] < 3, body, (x, 0))[0]

    model = hk.transform(forward)
    init = jax.jit(model.init) if jit else model.init
    apply = jax.jit(model.apply) if jit else model.apply
    with joh.context(), jax.checking_leaks():
        params = init(jax.random.PRNGKey(0), jnp.ones(3))
        at_init = len(traces)
        out = apply(params, None, jnp.ones(3))
    at_apply = len(traces) - at_init
    assert at_init == at_apply >= 1
    # Created once, under the name Haiku gives it outside the loop, from the init key.
    assert jax.tree.map(jnp.shape, params) == {"linear": {"w": (3, 3), "b": (3,)}}
    z = jnp.ones(3)
    for _ in range(3):
        z = jnp.tanh(z @ params["linear"]["w"] + params["linear"]["b"])
    np.testing.assert_allclose(out, z, rtol=1e-5)


def test_init_output_equals_apply_output_with_parameters_made_inside_branches() -> None:
    outputs = []

    def forward(x):
        out = jlax.cond(x[0] > 0, lambda v: hk.Linear(3, name="a")(v), lambda v: -v, x)
        outputs.append(out)
        return out

    model = hk.transform(forward)
    with joh.context():
        params = model.init(jax.random.PRNGKey(0), jnp.ones(3))
        out = model.apply(params, None, jnp.ones(3))
    assert sorted(params) == ["a"]
    np.testing.assert_allclose(outputs[0], out, rtol=1e-6)
