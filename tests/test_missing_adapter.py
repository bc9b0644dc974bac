"""The missing-adapter check: each silent failure of a forgotten adapter now raises, with the fix.

Haiku, Flax Linen (plain ``flax.linen``: the check needs no Linen adapter) and Flax NNX;
what the program may rightly do without an adapter still runs as JAX; the escape hatch;
and the idle path: a process that never imports a framework never imports one for the
check, and ``jo.jit`` built outside every framework scope keeps JAX's own dispatch.
"""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import errors as flax_errors, linen as nn, nnx
from jax.core import Tracer

import jaxoverride as jo
import jaxoverride_haiku
import jaxoverride_nnx
from _fresh import ROOT, run_source as _run
from jaxoverride import _detect, _stack, lax as jlax
from jaxoverride.errors import JaxoverrideError, MissingAdapterError

X = jnp.ones((1, 2))
HATCH = "jaxoverride.set_adapter_check(False)"


def _tracers(tree: object) -> list[object]:
    return [leaf for leaf in jax.tree_util.tree_leaves(tree) if isinstance(leaf, Tracer)]


# -- Haiku ---------------------------------------------------------------------------------


def _haiku_loop(x: jax.Array) -> jax.Array:
    def body(carry: tuple[int, jax.Array]) -> tuple[int, jax.Array]:
        step, h = carry
        return step + 1, hk.Linear(2, name="inner")(h)

    return jlax.while_loop(lambda carry: carry[0] < 2, body, (0, x))[1]


def test_haiku_while_loop_without_the_adapter_raises_with_the_fix():
    model = hk.transform(_haiku_loop)
    with pytest.raises(MissingAdapterError) as info:
        model.init(jax.random.PRNGKey(0), X)
    message = str(info.value)
    assert "Haiku" in message and "jaxoverride.lax.while_loop" in message
    assert "jaxoverride_haiku.install()" in message and HATCH in message
    assert isinstance(info.value, JaxoverrideError)
    assert _stack.idle and _stack.context_snapshot() is _stack.ROOT


def test_haiku_with_the_adapter_gives_arrays():
    model = hk.transform(_haiku_loop)
    with jaxoverride_haiku.context():
        params = model.init(jax.random.PRNGKey(0), X)
    assert jax.tree_util.tree_leaves(params) and not _tracers(params)


def test_haiku_escape_hatch_restores_the_old_behaviour():
    model = hk.transform(_haiku_loop)
    previous = jo.set_adapter_check(False)
    try:
        params = model.init(jax.random.PRNGKey(0), X)
    finally:
        jo.set_adapter_check(previous)
    assert previous is True
    assert len(_tracers(params)) == 2  # what the check exists to prevent


def test_haiku_jit_built_inside_the_transform_is_checked():
    def forward(x: jax.Array) -> jax.Array:
        return jo.jit(lambda h: hk.Linear(2, name="inner")(h))(x)

    with pytest.raises(MissingAdapterError, match=r"jaxoverride\.jit met Haiku"):
        hk.transform(forward).init(jax.random.PRNGKey(0), X)


def test_haiku_read_only_loop_without_the_adapter_runs_as_jax():
    """A loop that only reads parameters is right without the adapter: no error."""

    def forward(x: jax.Array) -> jax.Array:
        layer = hk.Linear(2, name="outer")
        layer(x)  # creates the parameters outside the loop
        return jlax.scan(lambda c, _: (layer(c), None), x, length=2)[0]

    model = hk.transform(forward)
    params = model.init(jax.random.PRNGKey(0), X)
    assert not _tracers(params)
    w, b = params["outer"]["w"], params["outer"]["b"]
    np.testing.assert_allclose(model.apply(params, None, X), (X @ w + b) @ w + b, rtol=1e-6)


def test_haiku_check_raises_only_for_the_scope_it_meets():
    """Outside hk.transform, Haiku being imported changes nothing."""
    f = jo.jit(lambda x: x + 1)
    state = f.__dict__["_jaxoverride_state"]
    assert state.check is None and f.func is state.plain  # JAX's own dispatch
    assert float(jlax.while_loop(lambda c: c < 3, lambda c: c + 1, 0)) == 3


# -- Flax Linen (no Linen adapter needed for the check) --------------------------------------


class _LinenLoop(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        def body(carry: tuple[int, jax.Array]) -> tuple[int, jax.Array]:
            step, h = carry
            return step + 1, nn.Dense(2, name="inner")(h)

        return jlax.while_loop(lambda carry: carry[0] < 2, body, (0, x))[1]


class _LinenReads(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dense = nn.Dense(2)
        dense(x)  # parameters are created outside the loop
        return jlax.scan(lambda c, _: (dense(c), None), x, length=2)[0]


def test_linen_while_loop_without_an_adapter_raises_with_the_fix():
    with pytest.raises(MissingAdapterError) as info:
        _LinenLoop().init(jax.random.PRNGKey(0), X)
    message = str(info.value)
    assert "Flax Linen" in message and "jaxoverride_linen.install()" in message
    assert HATCH in message


def test_linen_escape_hatch_shows_the_silent_failure():
    previous = jo.set_adapter_check(False)
    try:
        variables = _LinenLoop().init(jax.random.PRNGKey(0), X)
    finally:
        jo.set_adapter_check(previous)
    assert len(_tracers(variables)) == 2


def test_linen_read_only_loop_runs_as_jax():
    variables = _LinenReads().init(jax.random.PRNGKey(0), X)
    assert not _tracers(variables)
    out = _LinenReads().apply(variables, X)
    kernel = variables["params"]["Dense_0"]["kernel"]
    bias = variables["params"]["Dense_0"]["bias"]
    np.testing.assert_allclose(out, ((X @ kernel + bias) @ kernel + bias), rtol=1e-6)


# -- Flax NNX ------------------------------------------------------------------------------


class _Model(nnx.Module):
    def __init__(self, layer: nnx.Linear):
        self.layer = layer

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.layer(x)


def _nnx_setup() -> tuple[nnx.Linear, _Model]:
    layer = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    return layer, _Model(layer)


def test_nnx_grad_of_captured_module_raises_instead_of_zero_gradients():
    layer, model = _nnx_setup()

    def loss(_: nnx.Linear) -> jax.Array:
        return model(X).sum()

    with jax.checking_leaks(), pytest.raises(MissingAdapterError) as info:
        jo.grad(loss)(layer)
    message = str(info.value)
    assert "silently zero" in message and "jaxoverride_nnx.track(model)" in message
    assert HATCH in message
    # Under track the same call is right: d(sum(x @ W + b))/dW = 1 for x = ones.
    with jaxoverride_nnx.track(model):
        grads = jo.grad(loss)(layer)
    np.testing.assert_allclose(grads.kernel[...], np.ones((2, 2)))
    np.testing.assert_allclose(grads.bias[...], np.ones(2))


def test_nnx_jit_of_captured_module_raises_instead_of_baking_weights():
    _, model = _nnx_setup()
    with pytest.raises(MissingAdapterError, match="bake their current weights") as info:
        jo.jit(lambda: model(X))()
    assert "jaxoverride_nnx.track(model)" in str(info.value)


def test_nnx_write_without_track_names_track_not_the_bare_error():
    count = nnx.Variable(jnp.array(0))

    def bump(carry: int, _: None) -> tuple[int, None]:
        count[...] += 1
        return carry, None

    with pytest.raises(MissingAdapterError) as info:
        jlax.scan(bump, 0, length=3)
    assert "jaxoverride_nnx.track(count)" in str(info.value)
    assert isinstance(info.value.__cause__, flax_errors.TraceContextError)
    assert isinstance(info.value, flax_errors.TraceContextError)  # old handlers still catch it
    assert int(count[...]) == 0


def test_nnx_tracking_the_wrong_module_raises():
    _, first = _nnx_setup()
    _, second = _nnx_setup()
    with jaxoverride_nnx.track(first), pytest.raises(MissingAdapterError) as info:
        jo.jit(lambda: second(X))()
    message = str(info.value)
    assert "`second`" in message and "track it too" in message
    # Tracking both is right, and reads the current weights on every call.
    jitted = jo.jit(lambda: second(X))
    with jaxoverride_nnx.track(first, second):
        before = jitted()
        second.layer.bias[...] = second.layer.bias[...] + 1.0
        after = jitted()
    np.testing.assert_allclose(after, before + 1.0, rtol=1e-6)


def test_nnx_what_raw_jax_gets_right_is_left_alone():
    _, model = _nnx_setup()
    xs = jnp.ones((3, 1, 2))
    np.testing.assert_allclose(jo.vmap(lambda x: model(x))(xs), jax.vmap(lambda x: model(x))(xs))
    np.testing.assert_allclose(
        jo.grad(lambda x: model(x).sum())(X), jax.grad(lambda x: model(x).sum())(X)
    )


def test_nnx_escape_hatch():
    layer, model = _nnx_setup()
    previous = jo.set_adapter_check(False)
    try:
        grads = jo.grad(lambda _: model(X).sum())(layer)
    finally:
        jo.set_adapter_check(previous)
    assert not np.any(grads.kernel[...])  # the silent zero the check prevents


def test_set_adapter_check_rejects_non_booleans():
    with pytest.raises(TypeError, match="True or False"):
        jo.set_adapter_check("off")  # type: ignore[arg-type]


# -- import state: fresh interpreters --------------------------------------------------------


def test_a_process_without_frameworks_imports_none_and_keeps_jax_dispatch():
    result = _run(
        """
        import sys
        import jax, jax.numpy as jnp
        import jaxoverride as jo
        from jaxoverride import _detect, lax as jlax
        f = jo.jit(lambda x: x + 1)
        f(jnp.ones(2))
        jlax.scan(lambda c, x: (c + x, None), 0.0, jnp.ones(3))
        state = f.__dict__["_jaxoverride_state"]
        assert state.check is None and f.func is state.plain
        assert not _detect.watching()
        loaded = [m for m in ("haiku", "flax", "flax.linen", "flax.nnx") if m in sys.modules]
        assert not loaded, loaded
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"


def test_importing_flax_nnx_does_not_import_haiku_or_linen_for_the_check():
    result = _run(
        """
        import sys
        import jax.numpy as jnp
        import jaxoverride as jo
        from jaxoverride import lax as jlax
        import flax.nnx
        before = {m for m in ("haiku", "flax.linen") if m in sys.modules}
        jlax.scan(lambda c, x: (c + x, None), 0.0, jnp.ones(3))
        jo.jit(lambda x: x)(1.0)
        after = {m for m in ("haiku", "flax.linen") if m in sys.modules}
        assert after == before, (before, after)
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_environment_variable_turns_the_check_off():
    source = """
        import jax, jax.numpy as jnp, haiku as hk
        import jaxoverride as jo
        from jaxoverride import lax as jlax
        def f(x):
            body = lambda c: (c[0] + 1, hk.Linear(2)(c[1]))
            return jlax.while_loop(lambda c: c[0] < 2, body, (0, x))[1]
        try:
            params = hk.transform(f).init(jax.random.PRNGKey(0), jnp.ones((1, 2)))
        except jo.errors.MissingAdapterError:
            print("raised")
        else:
            print("silent", jo.set_adapter_check(True))
        """
    off = _run(source, JAXOVERRIDE_ADAPTER_CHECK="0")
    on = _run(source)
    assert off.returncode == 0 and on.returncode == 0, off.stderr[-2000:] + on.stderr[-2000:]
    assert off.stdout.strip() == "silent False"
    assert on.stdout.strip() == "raised"


def test_detect_module_reads_frameworks_only_from_sys_modules():
    """The check never imports a framework: its probes name modules, and read sys.modules."""
    source = (ROOT / "src" / "jaxoverride" / "_frameworks.py").read_text()
    source += (ROOT / "src" / "jaxoverride" / "_detect.py").read_text()
    for framework in ("haiku", "flax"):
        assert f"import {framework}" not in source and f"from {framework}" not in source
    assert {"haiku", "linen", "nnx"} <= set(_detect.frameworks())  # others may register
