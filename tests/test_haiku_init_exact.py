"""Init-exact control flow: at init every loop and branch creates every parameter that apply
uses, and returns what apply returns for the same params, state and rng. Zero-trip loops
create their parameters and return ``init_val``. ``eval_shape`` keeps what it created.

Each program stores the value it computed in state (``hk.set_state("out", ...)``); init
returns the first value set, so ``init_state["~"]["out"]`` is what init computed.
"""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxoverride as jo
import jaxoverride_haiku as joh
from jaxoverride import lax as jlax

X = jnp.array([0.5, -1.0, 2.0], jnp.float32)
RNG = jax.random.PRNGKey(7)


def layer(v):
    return jnp.tanh(hk.Linear(3)(v))


def noisy(v):
    scale = hk.get_parameter("scale", v.shape, init=jnp.ones)
    return v * scale + 0.1 * jax.random.normal(hk.next_rng_key(), v.shape)


def counted(v):
    count = hk.get_state("count", [], jnp.int32, init=jnp.zeros)
    hk.set_state("count", count + 1)
    return layer(v) + count


# name -> (program with trips, program with zero trips (None: not a loop), zero-trip output)
LOOPS = {
    "scan": (
        lambda x: jlax.scan(lambda c, k: (counted(c) * k, noisy(c)), x, jnp.arange(1.0, 4.0)),
        lambda x: jlax.scan(lambda c, k: (counted(c) * k, noisy(c)), x, jnp.zeros(0)),
        lambda x: (x, jnp.zeros((0, 3))),
    ),
    "scan_reverse": (
        lambda x: jlax.scan(
            lambda c, k: (counted(c) * k, c), x, jnp.arange(1.0, 4.0), reverse=True
        ),
        None,
        None,
    ),
    "while_loop": (
        lambda x: jlax.while_loop(
            lambda s: s[1] < 3, lambda s: (noisy(counted(s[0])), s[1] + 1), (x, 0)
        ),
        lambda x: jlax.while_loop(
            lambda s: s[1] < 0, lambda s: (noisy(counted(s[0])), s[1] + 1), (x, 0)
        ),
        lambda x: (x, 0),
    ),
    "fori_loop": (
        lambda x: jlax.fori_loop(0, 3, lambda i, c: noisy(counted(c)) * i, x),
        lambda x: jlax.fori_loop(2, 2, lambda i, c: noisy(counted(c)) * i, x),
        lambda x: x,
    ),
    "fori_loop_traced_bounds": (
        lambda x: jlax.fori_loop(0, jnp.int32(3), lambda i, c: noisy(counted(c)), x),
        lambda x: jlax.fori_loop(0, jnp.int32(0), lambda i, c: noisy(counted(c)), x),
        lambda x: x,
    ),
    "map": (
        lambda x: jlax.map(lambda v: noisy(counted(v)), x[None] * jnp.arange(4.0)[:, None]),
        lambda x: jlax.map(lambda v: noisy(counted(v)), jnp.zeros((0, 3))),
        lambda x: jnp.zeros((0, 3)),
    ),
    "cond": (
        lambda x: jlax.cond(x[0] > 0, lambda v: noisy(counted(v)), lambda v: layer(v) * 2, x),
        None,
        None,
    ),
    "switch": (
        lambda x: jlax.switch(1, [layer, lambda v: noisy(counted(v)), lambda v: -layer(v)], x),
        None,
        None,
    ),
}


def _stored(program):
    def f(x):
        out = program(x)
        hk.set_state("out", out)
        return out

    return hk.transform_with_state(f)


def _init_apply(model, jit: bool):
    init, apply = (jax.jit(model.init), jax.jit(model.apply)) if jit else (model.init, model.apply)
    with joh.context(), jax.checking_leaks(), hk.config.context(check_jax_usage=True):
        params, state = init(RNG, X)
        out, new_state = apply(params, state, RNG, X)
    return params, state, out, new_state


def _close(a, b):
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6), a, b)


@pytest.mark.parametrize("name", ["scan_reverse", "fori_loop_traced_bounds", "switch"])
def test_init_returns_what_apply_returns(name: str) -> None:
    # test_haiku_matrix checks this for every control-flow function, for each kind of module
    # separately, eagerly and under jax.jit; here modules, state and rng share one body.
    params, state, out, _ = _init_apply(_stored(LOOPS[name][0]), jit=False)
    _close(state["~"]["out"], out)
    assert "linear" in params  # and apply found every parameter it uses
    assert int(state["~"]["count"]) == 0  # init returns the state as it was before the loop


@pytest.mark.parametrize("name", [n for n, (_, zero, _) in LOOPS.items() if zero is not None])
def test_zero_trip_loops_create_parameters_and_return_init_val(name: str) -> None:
    _, zero, expected = LOOPS[name]
    params, state, out, new_state = _init_apply(_stored(zero), jit=False)
    # Every parameter and state entry of the body, as if the loop had run.
    assert jax.tree.map(jnp.shape, params) == {
        "linear": {"w": (3, 3), "b": (3,)},
        "~": {"scale": (3,)},
    }
    assert set(state["~"]) == {"count", "out"}
    _close(state["~"]["out"], expected(X))  # init returns init_val
    _close(out, expected(X))  # and so does apply
    assert int(new_state["~"]["count"]) == 0  # the body never ran at apply


def test_hk_scan_cannot_do_what_the_neutral_scan_does() -> None:
    def program(scan):
        return lambda x: scan(lambda c, _: (layer(c), None), x, jnp.zeros(2))[0]

    with pytest.raises(AssertionError, match="New parameters were created"):
        hk.transform(program(hk.scan)).init(RNG, X)
    with pytest.raises(ValueError, match="does not support initialization"):
        hk.transform(lambda x: hk.while_loop(lambda c: False, layer, x)).init(RNG, X)
    with joh.context():
        params = hk.transform(program(jlax.scan)).init(RNG, X)
    assert sorted(params) == ["linear"]


def test_cond_branches_creating_different_parameters() -> None:
    def program(x):
        return jlax.cond(
            x[0] > 0,
            lambda v: hk.Linear(3, name="a")(v),
            lambda v: hk.nets.MLP([4, 3], name="b")(v),
            x,
        )

    with joh.context():
        params, init_state, out, _ = _init_apply(_stored(program), jit=False)
    assert sorted(params) == ["a", "b/~/linear_0", "b/~/linear_1"]
    _close(init_state["~"]["out"], out)
    _close(out, hk.transform(lambda x: hk.Linear(3, name="a")(x)).apply(params, None, X))
    with pytest.raises(TypeError, match="same pytree structure"):
        hk.transform_with_state(
            lambda x: hk.cond(
                x[0] > 0,
                lambda v: hk.Linear(3, name="a")(v),
                lambda v: hk.nets.MLP([4, 3], name="b")(v),
                x,
            )
        ).init(RNG, X)


def test_eval_shape_keeps_the_parameters_created_inside() -> None:
    def program(evaluate):
        return lambda x: evaluate(lambda v: hk.nets.MLP([5, 3])(v), x).shape

    with joh.context():
        params = hk.transform(program(jo.eval_shape)).init(RNG, X)
    assert sorted(params) == ["mlp/~/linear_0", "mlp/~/linear_1"]
    assert hk.transform(program(hk.eval_shape)).init(RNG, X) == {}  # hk drops them


def test_batch_norm_in_a_scan_matches_hk_scan_at_apply() -> None:
    def program(scan):
        def f(x):
            norm = hk.BatchNorm(True, True, 0.9)
            xs = x[None, None] * jnp.arange(1.0, 4.0)[:, None, None]
            return scan(lambda c, v: (c + norm(v, is_training=True).sum(), c), 0.0, xs)

        return f

    params, state, out, new_state = _init_apply(_stored(program(jlax.scan)), jit=False)
    ref_out, ref_state = hk.transform_with_state(program(hk.scan)).apply(params, state, RNG, X)
    _close(out, ref_out)
    for name in ("batch_norm/~/mean_ema", "batch_norm/~/var_ema"):
        _close(new_state[name], ref_state[name])
    _close(state["~"]["out"], out)


def test_nested_loops_inside_jit_are_init_exact() -> None:
    def program(x):
        def body(c, _):
            inner = jlax.while_loop(
                lambda s: s[1] < 2, lambda s: (counted(s[0]), s[1] + 1), (c, 0)
            )[0]
            return jlax.fori_loop(0, 2, lambda i, h: noisy(h), inner), None

        return jo.jit(lambda x: jlax.scan(body, x, length=2)[0])(x)

    params, state, out, new_state = _init_apply(_stored(program), jit=True)
    _close(state["~"]["out"], out)
    assert int(new_state["~"]["count"]) == 4
    assert sorted(params) == ["linear", "~"]


def test_parameters_created_in_creation_passes_get_distinct_keys() -> None:
    def program(x):
        a = jlax.scan(lambda c, _: (hk.Linear(3, name="a")(c), None), x, length=2)[0]
        b = jlax.scan(lambda c, _: (hk.Linear(3, name="b")(c), None), x, length=2)[0]
        return a + b + hk.Linear(3, name="c")(x)

    params = hk.transform(program)
    with joh.context():
        params = params.init(RNG, X)
    ws = [np.asarray(params[name]["w"]) for name in "abc"]
    assert not np.allclose(ws[0], ws[1])
    assert not np.allclose(ws[0], ws[2]) and not np.allclose(ws[1], ws[2])


def test_a_failed_creation_pass_leaves_the_frame_as_it_was() -> None:
    def program(x):
        def body(c, _):
            hk.get_state("half_made", [], init=jnp.zeros)
            hk.Linear(3)(c)
            raise ValueError("boom")

        with pytest.raises(ValueError, match="boom"):
            jlax.scan(body, x, length=2)
        return hk.Linear(3)(x)  # named "linear" again: the failed pass left no name behind

    with joh.context():
        params, state = hk.transform_with_state(program).init(RNG, X)
    assert sorted(params) == ["linear"]
    assert state == {}
    np.testing.assert_allclose(
        hk.transform(lambda x: hk.Linear(3)(x)).init(RNG, X)["linear"]["w"], params["linear"]["w"]
    )
