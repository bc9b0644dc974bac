"""Every adapter's ``jit`` keeps JAX's jitted-function API, over what the adapter runs.

``lower``, ``trace``, ``eval_shape``, ``clear_cache``, ``_cache_size`` and ``__wrapped__``
of ``jaxoverride.jit(f)`` under each adapter. Where the adapter has nothing to do (no
state, no sharing) each must give exactly what ``jax.jit(f)``'s gives. Where it threads
state (Haiku inside ``hk.transform``, NNX under ``track``) the lowered computation is the
one a call runs: the state is among its arguments, and compiling it reproduces the call.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import pickle
import weakref
from collections.abc import Iterator
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from haiku._src import stateful

import jaxoverride as jo
import jaxoverride_debug as jd
import jaxoverride_haiku as joh
import jaxoverride_nnx
import jaxoverride_plain as plain
from _nnx_models import Counter
from _parity import ADAPTER_MODES, MODES, active, assert_same, counting_compiles
from jaxoverride_nnx import _tracked

X = jnp.array([0.5, -1.0, 2.0], jnp.float32)


class Traces:
    """A function that counts how often JAX traces it (its Python body runs)."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, x: jax.Array) -> jax.Array:
        self.count += 1
        return jnp.sin(x) * 2.0 + jnp.sum(x)


@contextlib.contextmanager
def in_mode(mode: str) -> Iterator[None]:
    if mode == "debug":
        with jd.trace(log=lambda call: None):
            yield
    elif mode == "plain_init":
        with plain.context(), plain.init_context():
            yield
    else:
        with active(mode):
            yield


# Under ``track`` even an unrelated module's Variables are arguments of what ``jit`` runs
# (the adapter cannot know that ``f`` never reads them): see the NNX test below.
STATELESS_MODES = (*MODES, *(m for m in ADAPTER_MODES if m != "nnx_track"), "plain_init", "debug")


@pytest.mark.parametrize("mode", STATELESS_MODES)
def test_jit_api_is_jax_jits_where_the_adapter_has_nothing_to_do(mode):
    reference_fun = Traces()
    reference = jax.jit(reference_fun)
    fun = Traces()
    with in_mode(mode), jax.checking_leaks():
        jitted: Any = jo.jit(fun)
        lowered = jitted.lower(X)
        compiled_out = lowered.compile()(X)
        traced = jitted.trace(X)
        shape = jitted.eval_shape(X)
        out = jitted(X)
        again = jitted(X)
        traces_before_clear, size_before_clear = fun.count, jitted._cache_size()
        jitted.clear_cache()
        size_after_clear = jitted._cache_size()
        after_clear = jitted(X)
        assert jitted.__wrapped__ is fun
    assert lowered.as_text() == reference.lower(X).as_text()
    assert str(traced.jaxpr) == str(reference.trace(X).jaxpr)
    assert_same(shape, reference.eval_shape(X))
    for result in (compiled_out, out, again, after_clear):
        assert_same(result, reference(X))
    # At init each staging and call runs ``fun`` eagerly once first (the creation pass).
    creations = 5 if mode == "plain_init" else 0
    assert reference_fun.count == 1
    assert traces_before_clear == 1 + creations  # lower, trace and call share one trace
    assert (size_before_clear, size_after_clear) == (1, 0)
    # clear_cache made the next call trace and compile again.
    assert fun.count == 2 + creations + (mode == "plain_init")


def test_clear_cache_reaches_the_builds_of_every_stack():
    fun = Traces()
    jitted: Any = jo.jit(fun)
    jitted(X)
    with plain.context():
        jitted(X)
        assert fun.count == 2  # one build per stack
    jitted.clear_cache()  # idle: clears the plain jax.jit and the plain context's build
    jitted(X)
    with plain.context():
        jitted(X)
    assert fun.count == 4


def test_plain_init_creates_parameters_before_staging():
    params: dict[str, jax.Array] = {}

    def f(x):
        if plain.is_initializing():
            params.setdefault("w", jnp.full(x.shape, 3.0, x.dtype))
        return params["w"] * x

    with plain.context(), plain.init_context(), jax.checking_leaks():
        text = jo.jit(f).lower(X).as_text()
    assert type(params["w"]) is type(X)  # created eagerly, not a leaked tracer
    assert "stablehlo.multiply" in text
    np.testing.assert_array_equal(jax.jit(f).lower(X).compile()(X), 3.0 * X)


def _linear_traces() -> tuple[list[int], Traces]:
    count = [0]

    def lin(x):
        count[0] += 1
        return hk.Linear(3, name="lin")(x)

    return count, lin  # type: ignore[return-value]


@pytest.mark.parametrize("install", [False, True], ids=["context", "installed"])
def test_haiku_lowering_inside_a_transform_threads_the_state(install):
    count, lin = _linear_traces()
    jitted: Any = jo.jit(lin)
    seen: dict[str, object] = {}

    def forward(x):
        # Staged in the naming situation of the call below, so it stages that call.
        lowered = jitted.lower(x)
        seen["text"] = lowered.as_text()
        seen["compiled"] = lowered.compile()(stateful.internal_state(), x)
        seen["shape"] = jitted.eval_shape(x)
        seen["invars"] = len(jitted.trace(x).jaxpr.jaxpr.invars)
        out = jitted(x)
        seen["traces"] = count[0]
        seen["size"] = jitted._cache_size()  # of the build for the stack in use here
        return out

    model = hk.transform(forward)
    ctx = joh.context() if not install else contextlib.nullcontext()
    if install:
        joh.install()
    try:
        with ctx, jax.checking_leaks():
            params = model.init(jax.random.PRNGKey(0), X)
            init_traces = seen["traces"]
            out = model.apply(params, None, X)
            apply_traces, apply_size = seen["traces"], seen["size"]
            compiled_out, changed = seen["compiled"]  # type: ignore[misc]
            jitted.clear_cache()  # outside the transform: reaches every stack's build
            model.apply(params, None, X)
    finally:
        if install:
            joh.uninstall()
    assert sorted(params) == ["lin"]
    # At apply the weights are arguments of the lowered function, not constants.
    assert "tensor<3x3xf32>" in str(seen["text"]).split("\n")[1]
    assert seen["invars"] == 3  # b, w, x: the state and the argument
    np.testing.assert_array_equal(compiled_out, out)
    assert jax.tree.leaves(changed.params) == []  # at apply no parameter changes
    expected = hk.transform(lambda x: hk.Linear(3, name="lin")(x)).apply(params, None, X)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    assert seen["shape"] == jax.ShapeDtypeStruct((3,), jnp.float32)
    # One trace at init, one at apply: lower, trace and the call share each.
    assert (init_traces, apply_traces) == (1, 2)
    assert apply_size == 2  # one for init, one for apply
    assert seen["size"] == 1  # after clear_cache: apply's alone
    assert count[0] == 3  # clear_cache made apply trace and compile again


def test_haiku_lowering_outside_a_transform_is_jax_jits():
    fun = Traces()
    with joh.context():
        jitted: Any = jo.jit(fun)
        text = jitted.lower(X).as_text()
    assert text == jax.jit(Traces()).lower(X).as_text()


def test_nnx_lowering_under_track_takes_the_variables():
    model = Counter()
    count = [0]

    def f(x):
        count[0] += 1
        return model(x)

    jitted: Any = jo.jit(f)
    reference = Counter()
    with jaxoverride_nnx.track(model), jax.checking_leaks():
        scope = _tracked.current()
        assert scope is not None
        values = scope.read()  # what a call passes first
        lowered = jitted.lower(X)
        compiled_out, written = lowered.compile()(values, X)
        shape = jitted.eval_shape(X)
        invars = len(jitted.trace(X).jaxpr.jaxpr.invars)
        out = jitted(X)
        traces = count[0]
        jitted.clear_cache()
        jitted(X)
    expected = reference(X)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    np.testing.assert_array_equal(compiled_out, out)
    assert [int(v) for v in written] == [1]  # the counter's new value, not stored
    assert "tensor<3xf32>" in lowered.as_text().split("\n")[1]
    assert invars == 3  # count, w and x
    assert shape == jax.ShapeDtypeStruct((3,), jnp.float32)
    assert traces == 1 and count[0] == 2
    assert int(model.count[...]) == 2  # only the two calls ran; staging changes nothing


def test_dag_lowering_is_of_the_plan():
    import jaxoverride_dag

    calls = [0]

    def f(tree):
        calls[0] += 1
        return {"y": tree["a"] * tree["b"], "fn": tree["fn"]}

    w = jnp.arange(3.0)
    with jaxoverride_dag.context():
        jitted: Any = jo.jit(f)
        tree = {"a": w, "b": w, "fn": jnp.sin}  # shared: one traced argument
        lowered = jitted.lower(tree)
        shape = jitted.eval_shape(tree)
        out = jitted(tree)
        jitted.clear_cache()
        jitted(tree)
    assert lowered.as_text().split("\n")[1].count("tensor<3xf32>") == 2  # one input, one output
    np.testing.assert_array_equal(lowered.compile()(w).unpack()["y"], out["y"])
    assert shape["fn"] is jnp.sin and shape["y"] == jax.ShapeDtypeStruct((3,), jnp.float32)
    assert calls[0] == 2


def test_jit_api_helper_sets_the_attributes_on_what_it_is_given():
    """``jit_api`` sets the attributes on the object it is given, and returns it."""

    def call(x):
        return x

    inner: Any = jax.jit(call)
    stage = lambda method, args, kwargs: getattr(inner, method)(*args, **kwargs)
    result: Any = jo.jit_api(call, call, stage=stage, jitted=lambda: [inner])
    assert result is call and result.__wrapped__ is call
    call(X)
    inner(X)
    assert result._cache_size() == 1
    result.clear_cache()
    assert inner._cache_size() == 0


@pytest.mark.parametrize("mode", [*ADAPTER_MODES, "debug"])
def test_a_jit_built_again_compiles_nothing_again(mode):
    """``jo.jit(f)(x)`` in a loop compiles once, as ``jax.jit(f)(x)`` does: the adapter's
    build of one function and options is shared (``jo.reuse_jit``)."""

    def f(x):
        return jnp.cos(x) * 3.0

    def g(x):
        return jnp.cos(x) * 3.0

    with counting_compiles() as theirs:
        for _ in range(3):
            jax.jit(g)(X)
    ours: list[list[str]] = []
    out: Any = None
    with in_mode(mode):
        for _ in range(3):
            with counting_compiles() as compiled:
                out = jo.jit(f)(X)
            ours.append(compiled)
    assert_same(out, jax.jit(g)(X))
    assert theirs == ["jit(g)"]
    assert ours == [["jit(f)"], [], []]


class _State:
    def __init__(self, fun):
        self.fun = fun


def test_reuse_jit_lives_as_long_as_the_function():
    made: list[object] = []

    def maker(fun):
        return lambda: made.append(fun) or _State(fun)

    def f(x):
        return x

    ref = weakref.ref(f)
    first = jo.reuse_jit(f, ("options",), maker(f))
    assert jo.reuse_jit(f, ("options",), maker(f)) is first and len(made) == 1
    assert jo.reuse_jit(f, ("other options",), maker(f)) is not first  # a key of its own
    assert jo.reuse_jit(f, ([],), maker(f)) is not jo.reuse_jit(f, ([],), maker(f))  # unhashable

    @functools.wraps(f)  # copies f's __dict__, the builds' holder included
    def wrapper(x):
        return x

    assert jo.reuse_jit(wrapper, ("options",), maker(wrapper)).fun is wrapper
    # cloudpickle copies a function's __dict__: the builds never travel with it.
    holder = f.__dict__["__jaxoverride_jit_builds__"]
    assert len(holder) == 2
    for duplicate in (pickle.loads(pickle.dumps(holder)), copy.deepcopy(holder)):
        assert len(duplicate) == 0 and duplicate.owner is None
    del holder
    del first, wrapper
    made.clear()
    gc.collect()
    assert ref() is not None  # f is alive (this frame), and so are its builds
    assert jo.reuse_jit(f, ("options",), maker(f)) is not None and made == []
    del f
    gc.collect()
    assert ref() is None  # the builds, which hold f, went with it


def test_reuse_jit_of_other_callables_is_shared_while_held():
    fun = Traces()  # a callable object: no per-function holder
    first = jo.reuse_jit(fun, "options", lambda: _State(fun))
    assert jo.reuse_jit(fun, "options", lambda: _State(fun)) is first
    ref = weakref.ref(first)
    del first
    gc.collect()
    assert ref() is None
    assert jo.reuse_jit(fun, "options", lambda: _State(None)).fun is None  # built again


def test_haiku_jit_built_again_inside_a_transform_compiles_once():
    """A library's ``jo.jit(f)(x)`` inside the model: each apply builds the wrapper again,
    and only the first apply compiles; names stay those of separate calls."""

    def lin(v):
        return hk.Linear(3, name="lin")(v)

    def forward(x):
        y = jo.jit(lin)(x)
        return jo.jit(lin)(y)  # a second module: lin_1

    model = hk.transform(forward)
    with joh.context(), jax.checking_leaks():
        params = model.init(jax.random.PRNGKey(0), X)
        applied = []
        out: Any = None
        for _ in range(3):
            with counting_compiles() as compiled:
                out = model.apply(params, None, X)
            applied.append(len(compiled))
    assert sorted(params) == ["lin", "lin_1"]
    assert applied[0] >= 1 and applied[1:] == [0, 0]

    def reference(x):
        y = hk.Linear(3, name="lin")(x)
        return hk.Linear(3, name="lin_1")(y)

    expected = hk.transform(reference).apply(params, None, X)
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_adapters_stacked_on_one_function_never_share_a_build():
    """Each adapter's ``jit`` keeps its own state per function: a build made by one adapter
    (Haiku's, inside a transform) is never handed to another (the DAG's) for that function."""
    import jaxoverride_dag

    def relax(x):
        return jnp.tanh(x) * 2.0

    x = jnp.ones(3)
    with joh.context():
        model = hk.transform(lambda x: jo.jit(relax)(x))
        params = model.init(jax.random.PRNGKey(0), x)
        haiku_out = model.apply(params, None, x)
    with jaxoverride_nnx.track(Counter()):
        nnx_out = jo.jit(relax)(x)
    with jaxoverride_dag.context():
        dag_out = jo.jit(relax)(x)
        lowered = jo.jit(relax).lower(x).as_text()
    expected = jax.jit(relax)(x)
    for out in (haiku_out, nnx_out, dag_out):
        np.testing.assert_allclose(out, expected)
    assert "tanh" in lowered


class _Solver:
    """A solver that jits its own method at construction, as jaxopt's solvers do."""

    def __init__(self, scale: float):
        self.scale = scale
        self.step = jo.jit(self.update)

    def update(self, x):
        return x * self.scale


@pytest.mark.parametrize("make", [lambda f: jo.jit(f), lambda f: jo.jit(f, static_argnums=1)])
def test_copies_of_a_jitted_function_are_new_jitted_functions_as_in_jax(make):
    def scaled(x, power=2):
        return x**power

    original = make(scaled)
    for duplicate in (copy.copy(original), copy.deepcopy(original)):
        assert type(duplicate) is type(original) and duplicate is not original
        assert duplicate.__wrapped__ is scaled  # a function deep-copies to itself
        assert float(duplicate(jnp.float32(3.0), 2)) == float(original(jnp.float32(3.0), 2))
    raw = jax.jit(scaled)
    assert copy.copy(raw) is not raw and copy.deepcopy(raw) is not raw  # what JAX does


def test_deepcopy_of_an_object_holding_a_jitted_method_binds_the_copy():
    solver = _Solver(2.0)
    twin = copy.deepcopy(solver)
    twin.scale = 5.0
    assert float(solver.step(1.0)) == 2.0
    assert float(twin.step(1.0)) == 5.0, "the copy's jitted method still calls the original"
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(jo.jit(jnp.sin))
