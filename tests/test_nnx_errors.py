"""Misuse gets an error that says what happened in NNX terms, and leaves nothing behind."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import errors as flax_errors, nnx

import jaxoverride as jo
import jaxoverride_nnx
from _nnx_models import Counter
from jaxoverride import lax as jlax
from jaxoverride_nnx import LevelError, StructureChangeError, UntrackedModuleError

X = jnp.arange(3.0)

tracked = Counter()
stranger = Counter(seed=5)

NEUTRAL_CALLS = {
    "jit": lambda f: jo.jit(f)(X),
    "scan": lambda f: jlax.scan(lambda c, _: (f(c), None), X, length=2),
    "while_loop": lambda f: jlax.while_loop(lambda c: c.sum() < 100.0, f, X),
    "cond": lambda f: jlax.cond(True, f, lambda x: x, X),
    "grad": lambda f: jo.grad(lambda x: f(x).sum())(X),
    "vmap": lambda f: jo.vmap(f)(jnp.ones((2, 3))),
    "jacfwd": lambda f: jo.jacfwd(f)(X),
    "checkpoint": lambda f: jo.checkpoint(f)(X),
}


def _state(model: nnx.Module) -> list[np.ndarray]:
    return [np.asarray(v) for v in jax.tree_util.tree_leaves(nnx.state(model))]


@pytest.mark.parametrize("name", list(NEUTRAL_CALLS))
def test_untracked_module_mutated_inside_says_track_it(name):
    before = _state(stranger)
    with jaxoverride_nnx.track(tracked), pytest.raises(UntrackedModuleError) as info:
        NEUTRAL_CALLS[name](lambda x: tracked(x) + stranger(x))
    message = str(info.value)
    assert "Track it" in message and "track(stranger)" in message
    assert "stranger.count" in message and "Counter" in message
    assert type(info.value) is not flax_errors.TraceContextError  # not the bare error
    assert isinstance(info.value, flax_errors.TraceContextError)  # but still catchable as one
    assert all(np.array_equal(a, b) for a, b in zip(before, _state(stranger), strict=True))


def test_untracked_module_under_context_alone_says_track_it():
    with jaxoverride_nnx.context(), pytest.raises(UntrackedModuleError, match="Track it"):
        jlax.scan(lambda c, _: (stranger(c), None), X, length=2)


def test_new_variable_inside_a_trace_is_a_structure_change():
    model = Counter()

    def grow(c, _):
        model.extra = nnx.Variable(c)
        return c, None

    with jaxoverride_nnx.track(model), pytest.raises(StructureChangeError) as info:
        jlax.scan(grow, X, length=2)
    assert "'extra'" in str(info.value) and "tracked Counter" in str(info.value)
    assert not hasattr(model, "extra")


def test_variable_shape_or_dtype_change_inside_a_trace_is_a_structure_change():
    model = Counter()

    def reshape(x):
        model.w.set_value(jnp.ones((2, 3)))
        return x

    def retype(c, _):
        model.count.set_value(c.astype(jnp.float32).sum())
        return c, None

    with jaxoverride_nnx.track(model):
        with pytest.raises(
            StructureChangeError, match=r"Counter\.w.*float32\[3\].*float32\[2, 3\]"
        ):
            jo.jit(reshape)(X)
        with pytest.raises(StructureChangeError, match=r"Counter\.count.*int32"):
            jlax.scan(retype, X, length=2)
    assert model.w[...].shape == (3,) and int(model.count[...]) == 0


def test_batched_write_under_vmap_names_the_variable():
    model = Counter()

    def per_example(x):
        model.count[...] += x.astype(jnp.int32)
        return x

    with jaxoverride_nnx.track(model), pytest.raises(StructureChangeError) as info:
        jo.vmap(per_example)(jnp.arange(3))
    assert "Counter.count" in str(info.value) and "mapped axis" in str(info.value)
    assert int(model.count[...]) == 0


def test_tracked_module_mutated_inside_a_raw_jax_transform():
    model = Counter()
    with jaxoverride_nnx.track(model), pytest.raises(LevelError, match="raw jax"):
        jo.jit(lambda x: jax.jit(lambda y: model(y))(x))(X)


def test_track_rejects_non_modules():
    with pytest.raises(TypeError, match="expects NNX modules"):
        jaxoverride_nnx.track(Counter(), jnp.ones(3))


def test_track_inside_traced_code_is_refused():
    model = Counter()

    def body(x):
        with jaxoverride_nnx.track(Counter()):
            return model(x)

    with jaxoverride_nnx.track(model), pytest.raises(RuntimeError, match="inside traced code"):
        jo.jit(body)(X)


def test_modules_must_be_broadcast_under_vmap():
    model = Counter()
    with jaxoverride_nnx.context(), pytest.raises(ValueError, match="in_axes=None"):
        jo.vmap(lambda m, x: m(x))(model, jnp.ones((2, 3)))


def test_module_in_scan_xs_is_refused():
    with jaxoverride_nnx.context(), pytest.raises(TypeError, match="in xs"):
        jlax.scan(lambda c, m: (c, None), 0.0, Counter())


def test_carry_must_keep_its_modules():
    a, b = Counter(), Counter()
    with jaxoverride_nnx.track(), pytest.raises(StructureChangeError, match="carry"):
        jlax.scan(lambda m, _: (b, None), a, length=2)


def test_missing_flax_names_the_extra():
    code = (
        "import sys; sys.modules['flax'] = None\n"
        "try:\n    import jaxoverride_nnx\n"
        "except ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert "pip install 'jaxoverride[nnx]'" in out
