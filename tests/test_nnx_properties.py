"""Random nestings of neutral control flow agree with eager Python, step for step.

Hypothesis draws small programs: a tree of ``call`` (run the tracked model once),
``scan``/``fori``/``while`` loops of a few steps and ``cond`` on a data-dependent
predicate, optionally wrapped in ``jaxoverride.jit``. Each program runs once through
the neutral functions under ``track`` and once as plain Python on an identical model;
the output and every Variable (the counter, the RNG stream, the running average) must
agree, so every nesting threads the state exactly as often as eager execution would.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from hypothesis import HealthCheck, given, settings, strategies as st

import jaxoverride as jo
import jaxoverride_nnx
from _nnx_models import assert_close, assert_same_state
from jaxoverride import lax as jlax


class Stateful(nnx.Module):
    """A counter, an RNG stream and a running average, all updated on every call."""

    def __init__(self):
        self.count = nnx.Variable(jnp.array(0))
        self.rngs = nnx.Rngs(noise=0)
        self.average = nnx.Variable(jnp.zeros(2))

    def __call__(self, x: jax.Array) -> jax.Array:
        self.count[...] += 1
        noise = jax.random.uniform(self.rngs.noise(), (2,))
        self.average[...] = 0.5 * self.average[...] + 0.5 * x
        return jnp.tanh(x + noise + 0.1 * self.count[...])


leaf = st.just(("call",))
programs = st.recursive(
    leaf,
    lambda inner: st.one_of(
        st.tuples(st.sampled_from(["scan", "fori", "while"]), st.integers(0, 2), inner),
        st.tuples(st.just("cond"), inner, inner),
        st.tuples(st.just("jit"), inner),
    ),
    max_leaves=4,
)


def run_neutral(program: Any, model: Stateful, x: jax.Array) -> jax.Array:
    kind = program[0]
    if kind == "call":
        return model(x)
    if kind == "scan":
        _, steps, body = program
        out, _ = jlax.scan(lambda c, _: (run_neutral(body, model, c), None), x, length=steps)
        return out
    if kind == "fori":
        _, steps, body = program
        return jlax.fori_loop(0, steps, lambda i, c: run_neutral(body, model, c), x)
    if kind == "while":
        _, steps, body = program
        value, _ = jlax.while_loop(
            lambda s: s[1] < steps, lambda s: (run_neutral(body, model, s[0]), s[1] + 1), (x, 0)
        )
        return value
    if kind == "cond":
        _, yes, no = program
        return jlax.cond(
            x.sum() > 0,
            lambda c: run_neutral(yes, model, c),
            lambda c: run_neutral(no, model, c),
            x,
        )
    _, body = program
    return jo.jit(lambda c: run_neutral(body, model, c))(x)


def run_python(program: Any, model: Stateful, x: jax.Array) -> jax.Array:
    kind = program[0]
    if kind == "call":
        return model(x)
    if kind in ("scan", "fori", "while"):
        _, steps, body = program
        for _ in range(steps):
            x = run_python(body, model, x)
        return x
    if kind == "cond":
        _, yes, no = program
        return run_python(yes if float(x.sum()) > 0 else no, model, x)
    return run_python(program[1], model, x)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=programs, sign=st.sampled_from([1.0, -1.0]))
def test_random_nestings_match_eager_python(program, sign):
    x = sign * jnp.array([0.3, 0.2])
    ours, reference = Stateful(), Stateful()
    with jax.checking_leaks(), jaxoverride_nnx.track(ours):
        out = run_neutral(program, ours, x)
    expected = run_python(program, reference, x)
    assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert_same_state(ours, reference)
    assert int(ours.count[...]) == int(reference.count[...])
    assert np.asarray(ours.count[...]).dtype == np.asarray(reference.count[...]).dtype
