"""The first hour: every claim that the README and ``docs/troubleshooting.md`` make about
what a newcomer's first mistake raises, checked for Haiku, Flax Linen and Flax NNX
(issue 31). Each test quotes the claim it checks."""

from __future__ import annotations

import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxoverride as jo
import jaxoverride_haiku
import jaxoverride_linen
import jaxoverride_nnx
from _fresh import MISSING_ADAPTER_MESSAGE, run_source
from jaxoverride import lax as jlax
from jaxoverride.errors import MissingAdapterError

X = jnp.ones((1, 2))


def fixed_point(f, z0):  # the README's library solver
    return jlax.fori_loop(0, 20, lambda _, z: f(z), z0)


# Built at import time, outside every framework scope, as a library builds it.
solve = jo.jit(fixed_point, static_argnums=0)


# -- "a neutral function inside a Haiku transform, a bound Linen module or over NNX
#     Variables with no adapter active ... raise jaxoverride.errors.MissingAdapterError
#     with the call that fixes it" (README) ------------------------------------------------


def _haiku_forward(x):
    layer = hk.Linear(2)  # its parameters are created in the solver's loop
    return solve(lambda z: jnp.tanh(layer(z) + x), jnp.zeros_like(x))


def test_haiku_neutral_call_with_no_adapter_raises_with_the_fix():
    """README: "a neutral function inside a Haiku transform ... with no adapter active ...
    raise[s] jaxoverride.errors.MissingAdapterError with the call that fixes it";
    troubleshooting: "including a jo.jit built at import time, whose trace is checked"."""
    with pytest.raises(MissingAdapterError, match=r"jaxoverride_haiku\.install\(\)"):
        hk.transform(_haiku_forward).init(jax.random.PRNGKey(0), X)
    with jaxoverride_haiku.context():  # the fix it names
        params = hk.transform(_haiku_forward).init(jax.random.PRNGKey(0), X)
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(params))


class _LinenDeq(nn.Module):
    @nn.compact
    def __call__(self, x):
        layer = nn.Dense(2, name="layer")
        return solve(lambda z: jnp.tanh(layer(z) + x), jnp.zeros_like(x))


def test_linen_neutral_call_with_no_adapter_raises_with_the_fix():
    """README: "a neutral function inside ... a bound Linen module ... with no adapter
    active ... raise[s] jaxoverride.errors.MissingAdapterError with the call that fixes it";
    troubleshooting: "the same inside a bound Linen module (init, apply)"."""
    with pytest.raises(MissingAdapterError, match=r"jaxoverride_linen\.install\(\)"):
        _LinenDeq().init(jax.random.PRNGKey(0), X)
    with jaxoverride_linen.context():  # the fix it names
        variables = _LinenDeq().init(jax.random.PRNGKey(0), X)
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(variables))


class _Counted(nn.Module):
    @nn.compact
    def __call__(self, x):
        count = self.variable("counters", "steps", lambda: jnp.zeros((), jnp.int32))

        def step(_, z):
            count.value = count.value + 1  # a state write under the loop's trace
            return z

        return jlax.fori_loop(0, 3, step, x)


def test_linen_state_write_at_apply_with_no_adapter_raises_with_the_fix():
    """troubleshooting: "Flax Linen | the same inside a bound Linen module (init, apply)":
    a write at apply, not only a creation at init."""
    with jaxoverride_linen.context():
        variables = _Counted().init(jax.random.PRNGKey(0), X)
    with pytest.raises(MissingAdapterError, match=r"jaxoverride_linen\.install\(\)"):
        _Counted().apply(variables, X, mutable=["counters"])


def test_nnx_write_to_captured_variables_with_no_adapter_raises_with_the_fix():
    """README: "a neutral function ... over NNX Variables with no adapter active ...
    raise[s] ... MissingAdapterError with the call that fixes it"; troubleshooting: "a write
    to a captured Variable (Flax's bare TraceContextError)"."""
    counter = nnx.Variable(jnp.array(0))

    def step(z, _):
        counter[...] += 1
        return z, None

    with jax.checking_leaks(), pytest.raises(MissingAdapterError) as info:
        jlax.scan(step, 1.0, length=3)
    assert "`with jaxoverride_nnx.track(counter):`" in str(info.value)
    assert int(counter[...]) == 0
    with jax.checking_leaks(), jaxoverride_nnx.track(counter):  # the fix it names
        jlax.scan(step, 1.0, length=3)
    assert int(counter[...]) == 3


# -- "a forgotten or wrong track" (README) ------------------------------------------------


def test_nnx_forgotten_track_raises_instead_of_baking_the_weights_in():
    """README: "a forgotten ... track ... raise[s] ... MissingAdapterError"; troubleshooting:
    "jo.jit over captured modules (weights baked in), also one built at import time,
    before the module existed"."""
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    with jax.checking_leaks(), pytest.raises(MissingAdapterError) as info:
        jo.jit(lambda x: model(x))(X)
    assert "`with jaxoverride_nnx.track(model):`" in str(info.value)


# Built at import time, before the module it calls exists (a global bound later).
late_model: nnx.Linear | None = None
apply_late = jo.jit(lambda x: late_model(x))  # type: ignore[misc]


def test_nnx_forgotten_track_of_a_jit_built_before_the_module_existed_raises():
    """troubleshooting: "jo.jit over captured modules (weights baked in), also one built at
    import time, before the module existed"."""
    global late_model
    late_model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    try:
        with jax.checking_leaks(), pytest.raises(MissingAdapterError) as info:
            apply_late(X)
        assert "`with jaxoverride_nnx.track(late_model):`" in str(info.value)
        with jaxoverride_nnx.track(late_model):  # the fix it names
            before = apply_late(X)
            late_model.bias[...] = late_model.bias[...] + 1.0
            np.testing.assert_allclose(apply_late(X), before + 1.0, rtol=1e-6)
    finally:
        late_model = None


def test_nnx_forgotten_track_under_grad_raises_instead_of_a_zero_gradient():
    """troubleshooting: "jo.grad and friends of a function that captures a module, with
    respect to NNX state (zero gradients)"."""
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    with jax.checking_leaks(), pytest.raises(MissingAdapterError, match="silently zero"):
        jo.grad(lambda m: model(X).sum())(model)


def test_nnx_wrong_track_raises_naming_both_modules():
    """README: "a ... wrong track ... raise[s] ... MissingAdapterError with the call that
    fixes it"; troubleshooting: "under track(m1), a captured m2 that is not tracked"."""
    tracked = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    forgotten = nnx.Linear(2, 2, rngs=nnx.Rngs(1))
    with (
        jax.checking_leaks(),
        jaxoverride_nnx.track(tracked),
        pytest.raises(MissingAdapterError) as info,
    ):
        jo.jit(lambda x: forgotten(x))(X)
    assert "`with jaxoverride_nnx.track(tracked, forgotten):`" in str(info.value)


def _solve_twice(track_with: list[nnx.Module], model: nnx.Linear) -> tuple[jax.Array, ...]:
    """The README's solver pattern, the same read-only closure twice, the weights changed
    in between."""
    f = lambda z: jnp.tanh(model(z))
    with jaxoverride_nnx.track(*track_with):
        first = solve(f, jnp.zeros((1, 2)))
        model.bias[...] = model.bias[...] + 1.0
        second = solve(f, jnp.zeros((1, 2)))
    return first, second


@pytest.mark.parametrize("wrong", [False, True], ids=["no-track", "track-other"])
def test_nnx_static_argument_closure_without_the_right_track_raises(wrong):
    """README: "a forgotten or wrong track ... raise[s] ... MissingAdapterError", in the
    README's own pattern: solve = jo.jit(fixed_point, static_argnums=0), called twice with
    the same read-only closure over an NNX module whose weights changed in between."""
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    other = nnx.Linear(2, 2, rngs=nnx.Rngs(1))
    with pytest.raises(MissingAdapterError):
        _solve_twice([other] if wrong else [], model)


def test_nnx_static_argument_closure_under_the_right_track_is_fresh():
    """The fix the static-argument errors name: tracking the module gives the new result."""
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    first, second = _solve_twice([model], model)
    assert not np.allclose(first, second)


# -- "(under track) a raw jax.jit that would bake the weights in" (README) -----------------


def test_nnx_raw_jit_under_track_raises_instead_of_baking_the_weights_in():
    """README: "(under track) a raw jax.jit that would bake the weights in ... raise[s]
    jaxoverride.errors.MissingAdapterError with the call that fixes it"."""
    raw = jax.jit(lambda f, x: f(x), static_argnums=0)  # a library's raw module-level jit
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    with jaxoverride_nnx.track(model), pytest.raises(MissingAdapterError) as info:
        raw(lambda x: model(x), X)
    message = str(info.value)
    assert "the tracked Variable `Linear." in message
    assert "interpose_on_import" in message


# -- "What raw JAX gets right without an adapter still runs as JAX" (troubleshooting) ------


def test_what_raw_jax_gets_right_runs_with_no_adapter():
    """troubleshooting: "a loop that only reads Haiku or Linen parameters, jo.vmap or
    jo.grad with respect to inputs over a captured NNX module" run as JAX."""

    def haiku_read(x):
        layer = hk.Linear(2)
        layer(x)  # created outside the loop
        return jlax.fori_loop(0, 3, lambda _, z: layer(z), x)

    model = hk.transform(haiku_read)
    params = model.init(jax.random.PRNGKey(0), X)
    model.apply(params, None, X)

    class LinenRead(nn.Module):
        @nn.compact
        def __call__(self, x):
            layer = nn.Dense(2)
            layer(x)
            return jlax.fori_loop(0, 3, lambda _, z: layer(z), x)

    variables = LinenRead().init(jax.random.PRNGKey(0), X)
    LinenRead().apply(variables, X)

    linear = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    with jax.checking_leaks():
        jo.vmap(lambda x: linear(x))(jnp.ones((3, 2)))
        jo.grad(lambda x: linear(x).sum())(X)


# -- "a solver library imported before jo.interpose_on_import" (README) --------------------

_NEVER_INTERPOSED = {
    "haiku": """
        import haiku as hk
        import jaxoverride_haiku

        def forward(x):
            layer = hk.Linear(2, w_init=hk.initializers.RandomNormal(0.1))
            return optx.fixed_point(lambda z, _: jnp.tanh(layer(z) + x), solver,
                                    jnp.zeros(2), throw=False).value

        with jaxoverride_haiku.context():
            run = lambda: hk.transform(forward).init(jax.random.PRNGKey(0), jnp.ones(2))
            expect(run)
    """,
    "linen": """
        import flax.linen as nn
        import jaxoverride_linen

        class Deq(nn.Module):
            @nn.compact
            def __call__(self, x):
                layer = nn.Dense(2)
                return optx.fixed_point(lambda z, _: jnp.tanh(layer(z) + x), solver,
                                        jnp.zeros(2), throw=False).value

        with jaxoverride_linen.context():
            expect(lambda: Deq().init(jax.random.PRNGKey(0), jnp.ones(2)))
    """,
    "nnx": """
        from flax import nnx
        import jaxoverride_nnx

        model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        with jaxoverride_nnx.track(model):
            expect(lambda: optx.fixed_point(lambda z, _: jnp.tanh(model(z)), solver,
                                            jnp.zeros(2), throw=False))
    """,
}

_PROLOGUE = (
    """
import jax
import jax.numpy as jnp
import optimistix as optx  # imported before any interpose_on_import: never interposed
import jaxoverride as jo

solver = optx.FixedPointIteration(rtol=1e-6, atol=1e-6)
"""
    + MISSING_ADAPTER_MESSAGE
    + """

def expect(run):
    message = missing_adapter_message(run, "no MissingAdapterError")
    assert message.startswith("optimistix.fixed_point is a transform"), message
    assert "jaxoverride.interpose_on_import('equinox', 'lineax', 'optimistix')" in message
    print("RAISED")
"""
)


@pytest.mark.slow
@pytest.mark.parametrize("framework", sorted(_NEVER_INTERPOSED))
def test_a_solver_library_imported_before_interpose_on_import_raises_with_the_fix(framework):
    """README: "a solver library imported before jo.interpose_on_import ... raise[s]
    jaxoverride.errors.MissingAdapterError with the call that fixes it"; troubleshooting:
    "Any, with its adapter active | a solver library that was never interposed"."""
    import textwrap

    source = _PROLOGUE + textwrap.dedent(_NEVER_INTERPOSED[framework])
    out = run_source(source)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("RAISED"), out.stdout
