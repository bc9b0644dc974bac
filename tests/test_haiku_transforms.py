"""Neutral transforms and calls inside ``hk.transform`` beyond the matrix: ``linearize``,
keyword options (``has_aux``, ``argnums``, ``in_axes``, ``axis_name``, ``batch_size``,
``static_argnums``, ``policy``, ``operand=``), state and rng carried once per call by the
differentiating transforms, and a ``while_loop`` whose ``cond_fun`` draws rng keys.
"""

from __future__ import annotations

import functools

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxoverride as jo
import jaxoverride_haiku as joh
from jaxoverride import lax as jlax

X = jnp.array([0.5, -1.0, 2.0], jnp.float32)
RNG = jax.random.PRNGKey(3)


def counted(v):
    """Counts its calls; one set of weights however often it is called."""
    count = hk.get_state("count", [], jnp.int32, init=jnp.zeros)
    hk.set_state("count", count + 1)
    w = hk.get_parameter("w", [3, 3], init=hk.initializers.RandomNormal())
    return jnp.tanh(v @ w) + count


def noisy(v):
    """``counted`` plus noise from ``hk.next_rng_key()``."""
    return counted(v) + 0.01 * jax.random.normal(hk.next_rng_key(), v.shape)


def run(program, *args, jit=False):
    """init then apply, returning (params, state, apply output, new state)."""
    model = hk.transform_with_state(program)
    init, apply = (jax.jit(model.init), jax.jit(model.apply)) if jit else (model.init, model.apply)
    with joh.context(), hk.config.context(check_jax_usage=True):
        params, state = init(RNG, *args)
        out, new_state = apply(params, state, RNG, *args)
    return params, state, out, new_state


def explicit(params, state, fn=counted):
    """``fn`` as a pure function of explicit params, state and rng."""
    inner = hk.transform_with_state(fn)
    return lambda v: inner.apply(params, state, RNG, v)


def close(a, b):
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6), a, b)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_linearize(jit) -> None:
    # The matrix covers every other transform; linearize is here, in both modes.
    def program(x):
        out, f_jvp = jo.linearize(noisy, x)
        return out, f_jvp(jnp.ones_like(x))

    params, state, out, new_state = run(program, X, jit=jit)
    ref_out, ref_jvp, ref_state = jax.linearize(explicit(params, state, noisy), X, has_aux=True)
    close(out, (ref_out, ref_jvp(jnp.ones_like(X))))
    assert int(new_state["~"]["count"]) == int(ref_state["~"]["count"]) == 1


@pytest.mark.parametrize(
    "transform",
    [
        lambda f, x: jo.hessian(lambda v: f(v).sum())(x),
        lambda f, x: jo.linearize(f, x)[1](x),
    ],
    ids=["hessian", "linearize"],
)
def test_state_advances_once_per_call_not_per_basis_vector(transform) -> None:
    def program(x):
        return transform(noisy, x), transform(noisy, x)

    _, _, (first, second), new_state = run(program, X)
    assert int(new_state["~"]["count"]) == 2
    close(second, first)  # the count and the noise are constants to the derivatives


def test_grad_options_has_aux_argnums_and_value_and_grad() -> None:
    def loss(w, x):
        y = counted(x * w)
        return (y**2).sum(), y

    def program(x):
        (gw, gx), aux = jo.grad(loss, argnums=(0, 1), has_aux=True)(2.0, x)
        (value, aux2), g = jo.value_and_grad(loss, has_aux=True)(2.0, x)
        return gw, gx, aux, value, aux2, g

    params, state, out, new_state = run(program, X)

    def ref_loss(w, x, st):
        y, new = hk.transform_with_state(counted).apply(params, st, None, x * w)
        return (y**2).sum(), (y, new)

    (gw, gx), (aux, st1) = jax.grad(ref_loss, argnums=(0, 1), has_aux=True)(2.0, X, state)
    (value, (aux2, _)), g = jax.value_and_grad(ref_loss, has_aux=True)(2.0, X, st1)
    close(out, (gw, gx, aux, value, aux2, g))
    assert int(new_state["~"]["count"]) == 2


def test_jvp_and_vjp_with_aux() -> None:
    def f(x):
        y = counted(x)
        return y.sum(), y

    def program(x):
        primal, tangent, aux = jo.jvp(f, (x,), (jnp.ones_like(x),), has_aux=True)
        out, pullback, aux2 = jo.vjp(f, x, has_aux=True)
        return primal, tangent, aux, out, pullback(1.0)[0], aux2

    params, state, out, new_state = run(program, X)
    assert int(new_state["~"]["count"]) == 2
    close(out[2] + 1, out[5])  # the second call saw the count the first one left
    ref_primal, ref_tangent = jax.jvp(
        lambda v: explicit(params, state)(v)[0].sum(), (X,), (jnp.ones_like(X),)
    )
    close((out[0], out[1]), (ref_primal, ref_tangent))


def test_vmap_options_in_axes_axis_name_and_kwargs() -> None:
    def program(xs, scale):
        def f(x, s, *, shift):
            y = counted(x) * s + shift
            return y - jax.lax.pmean(y, "batch")

        return jo.vmap(f, in_axes=(0, None), axis_name="batch")(xs, scale, shift=jnp.ones(2))

    xs = X[None] * jnp.arange(1.0, 3.0)[:, None]
    params, state, out, new_state = run(program, xs, 3.0)
    ref = hk.transform_with_state(
        lambda xs, scale: hk.vmap(
            lambda x, s, shift: (lambda y: y - jax.lax.pmean(y, "batch"))(counted(x) * s + shift),
            in_axes=(0, None, 0),
            axis_name="batch",
            split_rng=False,
        )(xs, scale, jnp.ones(2))
    )
    ref_out, ref_state = ref.apply(params, state, RNG, xs, 3.0)
    close(out, ref_out)
    assert int(new_state["~"]["count"]) == int(ref_state["~"]["count"]) == 1


def test_map_with_batch_size_matches_jax_semantics() -> None:
    xs = X[None] * jnp.arange(1.0, 6.0)[:, None]

    def program(xs):
        return jlax.map(counted, xs, batch_size=2)

    params, state, out, new_state = run(program, xs)
    # Like jax.lax.map: a scan over two batches of two, vmapped, then the remainder, so
    # the count advances once per batch.
    assert int(new_state["~"]["count"]) == 3
    pure = explicit(params, state)
    ref = jnp.stack([pure(x)[0] + i // 2 for i, x in enumerate(xs)])
    close(out, ref)


def test_checkpoint_with_static_argnums_and_policy() -> None:
    def program(x):
        f = jo.checkpoint(
            lambda v, n: counted(v) * n,
            static_argnums=(1,),
            policy=jax.checkpoint_policies.nothing_saveable,
        )
        return jo.grad(lambda v: f(v, 3).sum())(x)

    params, state, out, new_state = run(program, X)
    pure = explicit(params, state)
    ref = jax.grad(lambda v: (pure(v)[0] * 3).sum())(X)
    close(out, ref)
    assert int(new_state["~"]["count"]) == 1


def test_switch_with_operand_keyword_and_out_of_range_index() -> None:
    def program(x):
        branches = [lambda v: -v, counted]
        return (
            jlax.switch(5, branches, operand=x),
            jlax.cond(True, counted, lambda v: v, operand=x),
        )

    params, state, (switched, conditioned), new_state = run(program, X)
    assert int(new_state["~"]["count"]) == 2  # index 5 is clamped to the last branch
    pure = explicit(params, state)
    close(switched, pure(X)[0])
    close(conditioned, pure(X)[0] + 1)


def test_fori_loop_takes_jax_keyword_names_lower_and_upper() -> None:
    # The kit's override once named the implementation below it `lower`, so
    # fori_loop(lower=...) raised "got multiple values for argument 'lower'".
    def program(x):
        return jlax.fori_loop(lower=0, upper=2, body_fun=lambda i, v: counted(v), init_val=x)

    def positional(x):
        return jlax.fori_loop(0, 2, lambda i, v: counted(v), x)

    _, _, out, new_state = run(program, X)
    _, _, expected, expected_state = run(positional, X)
    assert int(new_state["~"]["count"]) == 2
    close(out, expected)
    close(new_state, expected_state)


def test_deprecated_cond_signature_is_recast_like_jax() -> None:
    def program(x):
        return jlax.cond(x[0] > 0, x, counted, x * 2, lambda v: v)

    params, state, out, new_state = run(program, X)
    close(out, explicit(params, state)(X)[0])
    assert int(new_state["~"]["count"]) == 1


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_while_loop_whose_cond_draws_rng_keys(jit) -> None:
    def cond(state):
        return (jax.random.uniform(hk.next_rng_key()) < 0.9) & (state[1] < 20)

    def body(state):
        return noisy(state[0]), state[1] + 1

    def program(x):
        return jlax.while_loop(cond, body, (x, 0))

    params, init_state, (value, trips), new_state = run(program, X, jit=jit)

    def python_loop(x):
        state = (x, 0)
        while cond(state):
            state = body(state)
        return state

    ref_value, ref_trips = hk.transform_with_state(python_loop).apply(params, init_state, RNG, X)[0]
    assert int(trips) == int(ref_trips) > 1
    assert int(new_state["~"]["count"]) == int(trips)
    close(value, ref_value)


def test_hk_while_loop_refuses_what_the_neutral_one_does() -> None:
    model = hk.transform(
        lambda x: hk.while_loop(
            lambda s: jax.random.uniform(hk.next_rng_key()) < 0.5, lambda s: s + 1, x
        )
    )
    params = {}
    with pytest.raises(ValueError, match="does not support"):
        model.apply(params, RNG, X)


def test_transforms_nest_inside_loops_with_modules_built_inside() -> None:
    def program(x):
        def body(c, _):
            jac = jo.jacfwd(lambda v: hk.Linear(3, name="inner")(v))(c)
            return jnp.tanh(jac @ c), None

        return jlax.scan(body, x, length=3)[0]

    params, state, out, _ = run(program, X, jit=True)
    lin = functools.partial(
        hk.transform(lambda v: hk.Linear(3, name="inner")(v)).apply, params, None
    )
    ref = X
    for _ in range(3):
        ref = jnp.tanh(jax.jacfwd(lin)(ref) @ ref)
    close(out, ref)
    close(state["~"]["out"] if "~" in state else out, out)


def _map_by_hand(xs, batch_size):
    """``jax.lax.map``'s structure over the neutral ``scan`` and ``vmap`` (JAX's split)."""
    if batch_size is None:
        return jlax.scan(lambda _, x: ((), counted(x)), (), xs)[1]
    full = xs.shape[0] // batch_size * batch_size
    blocks, rest = xs[:full].reshape(-1, batch_size, *xs.shape[1:]), xs[full:]
    ys = jlax.scan(lambda _, block: ((), jo.vmap(counted)(block)), (), blocks)[1]
    rest_ys = jo.vmap(counted)(rest)
    return jax.lax.concatenate([ys.reshape(-1, *ys.shape[2:]), rest_ys], dimension=0)


@pytest.mark.parametrize("batch_size", [None, 2])
def test_map_traces_to_jax_structure_and_an_identical_eager_call_compiles_once(batch_size):
    xs = X[None] * jnp.arange(1.0, 6.0)[:, None]
    traces = []

    def f(v):
        traces.append(None)
        return counted(v)

    ours = hk.transform_with_state(lambda xs: jlax.map(f, xs, batch_size=batch_size))
    by_hand = hk.transform_with_state(lambda xs: _map_by_hand(xs, batch_size))
    compiles = []

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    with joh.context():
        params, state = ours.init(RNG, xs)
        for phase, args in [("init", (RNG, xs)), ("apply", (params, state, RNG, xs))]:
            traced = jax.make_jaxpr(getattr(ours, phase))(*args)
            assert str(traced) == str(jax.make_jaxpr(getattr(by_hand, phase))(*args)), phase
        out, new_state = ours.apply(params, state, RNG, xs)
        del traces[:]
        jax.monitoring.register_event_duration_secs_listener(listen)
        try:
            again, again_state = ours.apply(params, state, RNG, xs)
        finally:
            jax.monitoring.unregister_event_duration_listener(listen)
    assert compiles == []
    # The scan's body is not traced again; the remainder's vmap runs eagerly, as jax.vmap.
    assert len(traces) == (0 if batch_size is None else 1)
    close((again, again_state), (out, new_state))
    assert int(new_state["~"]["count"]) == (5 if batch_size is None else 3)
