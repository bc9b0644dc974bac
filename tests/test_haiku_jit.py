"""``jaxoverride.jit`` inside ``hk.transform``: no caching footgun, and no needless retraces.

Haiku's private ``stateful.jit`` caches on its arguments only: one wrapper called twice
retraces at init (new params), naming the second module ``linear_1``, but hits its cache
at apply and reuses ``linear``, silently. The adapter keys its cache on the naming
situation (interned by content) and replays where the trace left the name counters.
"""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from haiku._src import stateful

import jaxoverride as jo
import jaxoverride_haiku as joh
from jaxoverride import lax as jlax

X = jnp.array([0.5, -1.0, 2.0], jnp.float32)
RNG = jax.random.PRNGKey(0)


class Traces:
    """Counts how often a function is traced (Python-executed)."""

    def __init__(self, fun):
        self.fun = fun
        self.count = 0

    def __call__(self, *args, **kwargs):
        self.count += 1
        return self.fun(*args, **kwargs)


def twice(jit):
    layer_fn = Traces(lambda x: hk.Linear(3)(x))
    jitted = jit(layer_fn)

    def f(x):
        return jitted(x) + 2 * jitted(x) + hk.Linear(3)(x)

    return hk.transform(f), layer_fn


def reference(x):
    return hk.Linear(3)(x) + 2 * hk.Linear(3)(x) + hk.Linear(3)(x)


def test_footgun_is_real_with_haikus_private_jit() -> None:
    def f(x):
        jitted = stateful.jit(lambda x: hk.Linear(3)(x))
        return jitted(x) + 2 * jitted(x)

    model = hk.transform(f)
    params = model.init(RNG, X)
    assert sorted(params) == ["linear", "linear_1"]
    ref = hk.transform(lambda x: hk.Linear(3)(x) + 2 * hk.Linear(3)(x)).apply(params, None, X)
    # The second call replays the first trace and uses `linear` twice: silently wrong.
    assert not np.allclose(model.apply(params, None, X), ref)


@pytest.mark.parametrize("outer_jit", [False, True])
def test_one_wrapper_called_twice_builds_distinct_modules_at_init_and_apply(outer_jit) -> None:
    model, _ = twice(jo.jit)
    init, apply = (jax.jit(model.init), jax.jit(model.apply)) if outer_jit else model
    with joh.context(), jax.checking_leaks(), hk.config.context(check_jax_usage=True):
        params = init(RNG, X)
        out = apply(params, None, X)
    assert sorted(params) == ["linear", "linear_1", "linear_2"]
    np.testing.assert_allclose(out, hk.transform(reference).apply(params, None, X), rtol=1e-6)


def test_no_retrace_where_the_state_structure_allows() -> None:
    model, traced = twice(jo.jit)
    with joh.context():
        params = model.init(RNG, X)
        assert traced.count == 2  # a new module each call: two naming situations
        model.apply(params, None, X)
        assert traced.count == 4  # apply: params frozen, a different situation from init
        for _ in range(3):
            model.apply(params, None, X)
        model.apply(jax.tree.map(lambda p: p + 1, params), None, X)  # new values, same types
        assert traced.count == 4


def test_module_built_outside_is_traced_once_per_structure() -> None:
    traced = Traces(lambda layer, x: layer(x))
    jitted = jo.jit(traced, static_argnums=0)

    def f(x):
        layer = hk.Linear(3)
        return jitted(layer, x) + jitted(layer, x)

    model = hk.transform(f)
    with joh.context():
        params = model.init(RNG, X)
        out = model.apply(params, None, X)
    # init: the first call creates params, so the second sees a new structure; apply: the
    # second call is a cache hit (a new `layer` object per apply is a new static argument).
    assert traced.count == 3
    np.testing.assert_allclose(
        out, 2 * hk.transform(lambda x: hk.Linear(3)(x)).apply(params, None, X), rtol=1e-6
    )


def test_cache_hit_replays_module_names() -> None:
    jitted = jo.jit(lambda x: hk.nets.MLP([4, 3])(x))

    def f(x):
        a = jitted(x)
        b = jitted(x)
        return a + b, hk.Linear(2)(x)  # the next module after the jitted ones

    model = hk.transform(f)
    with joh.context():
        params = model.init(RNG, X)
        model.apply(params, None, X)
        out, after = model.apply(params, None, X)  # every jitted call a cache hit now
    assert sorted(params) == [
        "linear",
        "mlp/~/linear_0",
        "mlp/~/linear_1",
        "mlp_1/~/linear_0",
        "mlp_1/~/linear_1",
    ]
    ref = hk.transform(lambda x: (hk.nets.MLP([4, 3])(x) + hk.nets.MLP([4, 3])(x), hk.Linear(2)(x)))
    ref_out, ref_after = ref.apply(params, None, X)
    np.testing.assert_allclose(out, ref_out, rtol=1e-6)
    np.testing.assert_allclose(after, ref_after, rtol=1e-6)


def test_submodules_of_the_enclosing_module_are_replayed_on_a_cache_hit() -> None:
    class Outer(hk.Module):
        def __call__(self, x):
            return jitted(x)

    jitted = jo.jit(lambda x: hk.Linear(3)(x))

    def f(x):
        outer = Outer()
        outer(x)
        return sorted(outer.params_dict())

    model = hk.transform(f)
    with joh.context():
        params = model.init(RNG, X)
        first = model.apply(params, None, X)
        second = model.apply(params, None, X)  # cache hit: no trace reports the submodule
    assert first == second == ["outer/linear/b", "outer/linear/w"]


def test_state_and_rng_under_jit_match_no_jit() -> None:
    def body(x):
        count = hk.get_state("count", [], jnp.int32, init=jnp.zeros)
        hk.set_state("count", count + 1)
        return x + jax.random.normal(hk.next_rng_key(), x.shape) + count

    jitted = jo.jit(body)
    model = hk.transform_with_state(lambda x: jitted(jitted(x)))
    ref = hk.transform_with_state(lambda x: body(body(x)))
    with joh.context():
        params, state = model.init(RNG, X)
        out, new_state = model.apply(params, state, RNG, X)
    ref_out, ref_state = ref.apply(params, state, RNG, X)
    np.testing.assert_allclose(out, ref_out, rtol=1e-6)
    assert int(new_state["~"]["count"]) == int(ref_state["~"]["count"]) == 2


def test_custom_getter_is_part_of_the_key() -> None:
    jitted = jo.jit(lambda x: hk.get_parameter("w", [3], init=jnp.ones) * x)

    def doubled(next_getter, value, context):
        return next_getter(2 * value)

    def f(x):
        plain = jitted(x)
        with hk.custom_getter(doubled):
            return plain, jitted(x)

    model = hk.transform(f)
    with joh.context():
        params = model.init(RNG, X)
        plain, twice_as_much = model.apply(params, None, X)
    np.testing.assert_allclose(twice_as_much, 2 * plain)


def test_static_argnames_given_positionally_and_donation() -> None:
    @jo.jit
    def unused(x):  # a second wrapper, to show wrappers do not interfere
        return x

    def solve(f, x, steps):
        return jlax.fori_loop(0, steps, lambda i, h: f(h), x)

    jitted = jo.jit(solve, static_argnames=("f", "steps"), donate_argnums=(1,))

    def model_fn(x):
        layer = hk.Linear(3)
        f = lambda h: jnp.tanh(layer(h))
        return jitted(f, unused(x), 3)

    model = hk.transform(model_fn)
    ref = hk.transform(lambda x: jlax.fori_loop(0, 3, lambda i, h: jnp.tanh(hk.Linear(3)(h)), x))
    with joh.context():
        params = model.init(RNG, X)
        out = model.apply(params, None, X)
        ref_out = ref.apply(params, None, X)
    np.testing.assert_allclose(out, ref_out, rtol=1e-6)


def test_nesting_while_in_scan_in_jit_and_jit_in_jacfwd() -> None:
    def inner(h):
        return jlax.while_loop(
            lambda s: s[1] < 2, lambda s: (jnp.tanh(hk.Linear(3)(s[0])), s[1] + 1), (h, 0)
        )[0]

    def f(x):
        carry, _ = jo.jit(lambda x: jlax.scan(lambda c, _: (inner(c), None), x, length=2))(x)
        return carry, jo.jacfwd(jo.jit(lambda v: jnp.tanh(hk.Linear(3, name="lin")(v))))(x)

    def ref(x):
        h = x
        layer = hk.Linear(3)
        for _ in range(4):
            h = jnp.tanh(layer(h))
        lin = hk.Linear(3, name="lin")
        return h, jax.jacfwd(lambda v: jnp.tanh(lin(v)))(x)

    model = hk.transform(f)
    with joh.context(), jax.checking_leaks():
        params = jax.jit(model.init)(RNG, X)
        out = jax.jit(model.apply)(params, None, X)
    assert sorted(params) == ["lin", "linear"]
    ref_out = hk.transform(ref).apply(params, None, X)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), out, ref_out)


def test_outside_a_transform_it_is_jax_jit() -> None:
    f = lambda x: jnp.sin(x) * 2
    with joh.context():
        jitted = jo.jit(f)
        assert str(jax.make_jaxpr(jitted)(X)) == str(jax.make_jaxpr(jax.jit(f))(X))
        assert jitted.lower(X).as_text() == jax.jit(f).lower(X).as_text()
        np.testing.assert_array_equal(jitted(X), jax.jit(f)(X))


def test_inside_a_raw_jax_jit_the_adapter_steps_aside() -> None:
    seen = []

    def f(x):
        seen.append(joh.state_usable())
        return jax.jit(lambda v: (seen.append(joh.state_usable()), jo.jit(jnp.sin)(v))[1])(x)

    with joh.context():
        out = hk.transform(f).apply({}, None, X)
    assert seen == [True, False]
    np.testing.assert_array_equal(out, jnp.sin(X))
