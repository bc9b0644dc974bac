"""Under ``track``, a tracked Variable read inside a raw ``jax.jit`` trace raises.

A ``jax.jit`` object bound before any adapter entry (a library's module-level
``solve = jax.jit(_solve, static_argnums=0)``) would bake the weights in as constants and
serve them stale after they change. Reads under raw transforms that run at each call
(``jax.grad``, ``jax.vmap``) and in the bodies of raw control flow stay as in JAX; the
Variables carry no hook outside ``track``. See ``jaxoverride_nnx._stale_reads``.
"""

from __future__ import annotations

import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jaxoverride as jo
import jaxoverride_nnx
from _fresh import run_source

X = jnp.array([1.0, -2.0])

# What a library does at import time: a raw jit object, bound by name before any adapter.
solve = jax.jit(lambda f, x: f(x), static_argnums=0)


def _model() -> nnx.Linear:
    return nnx.Linear(2, 2, rngs=nnx.Rngs(0))


def _metadata(model: nnx.Module) -> list[dict[str, object]]:
    return [dict(v._var_metadata) for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)]


def _hooked(model: nnx.Module) -> list[bool]:
    return [
        "on_get_value" in v._var_metadata
        for _, v in nnx.iter_graph(model)
        if isinstance(v, nnx.Variable)
    ]


def test_a_raw_module_level_jit_reading_a_tracked_model_raises_with_the_fix():
    model = _model()
    before = _metadata(model)
    with jax.checking_leaks(), jaxoverride_nnx.track(model):
        with pytest.raises(jo.errors.MissingAdapterError) as caught:
            solve(lambda x: model(x), X)
    message = str(caught.value)
    assert message.startswith("jaxoverride_nnx.track: the tracked Variable `Linear.")
    assert "jaxoverride.jit instead of jax.jit" in message
    assert "interpose_on_import" in message
    assert "jaxoverride.set_adapter_check(False)" in message
    assert _metadata(model) == before  # the error exit took the hooks off


def test_an_indexed_read_and_a_read_under_grad_inside_the_jit_raise_too():
    model = _model()
    with jax.checking_leaks(), jaxoverride_nnx.track(model):
        with pytest.raises(jo.errors.MissingAdapterError, match=r"`Linear\.kernel`"):
            solve(lambda x: x * model.kernel[0], X)  # the read itself gives a tracer
        with pytest.raises(jo.errors.MissingAdapterError):
            jax.jit(jax.grad(lambda x: model(x).sum()))(X)
        with pytest.raises(jo.errors.MissingAdapterError):
            jax.grad(lambda x: solve(lambda y: model(y).sum(), x))(X)


def test_eval_shape_and_make_jaxpr_trace_through_jits_cache_and_raise():
    model = _model()
    with jaxoverride_nnx.track(model):
        with pytest.raises(jo.errors.MissingAdapterError):
            jax.eval_shape(lambda x: model(x), X)
        with pytest.raises(jo.errors.MissingAdapterError):
            jax.make_jaxpr(lambda x: model(x))(X)
        # The neutral ones read afresh at each call: right, and allowed.
        assert jo.eval_shape(lambda x: model(x), X).shape == (2,)
        closed = jo.make_jaxpr(lambda x: model(x))(X)
        assert len(closed.consts) == 2
        # A raw jit inside the neutral make_jaxpr still caches: refused.
        with pytest.raises(jo.errors.MissingAdapterError):
            jo.make_jaxpr(lambda x: solve(lambda y: model(y), x))(X)


def test_the_check_off_lets_the_raw_jit_run_stale_as_jax():
    model = _model()
    previous = jo.set_adapter_check(False)
    try:
        forward = lambda x: model(x)  # one function: jit's cache key
        with jaxoverride_nnx.track(model):
            first = solve(forward, X)
            model.bias[...] = model.bias[...] + 1.0
            again = solve(forward, X)
    finally:
        jo.set_adapter_check(previous)
    assert jnp.array_equal(first, again)  # stale: what the check exists for
    assert not any(_hooked(model))


def test_raw_grad_vmap_and_eager_control_flow_read_the_model_as_without_track():
    model = _model()

    def run():
        loss = lambda x: jnp.sum(model(x) ** 2)
        body = lambda c, _: (c + model(X).sum(), None)
        return (
            jax.grad(loss)(X),
            jax.vmap(model)(jnp.stack([X, 2 * X])),
            jax.jacrev(lambda x: model(x))(X),
            jax.value_and_grad(loss)(X),
            jax.lax.scan(body, 0.0, length=3)[0],
            jax.lax.cond(True, lambda x: model(x), lambda x: -model(x), X),
            jax.lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, model(c[1])), (0, X))[1],
            jax.checkpoint(lambda x: model(x))(X),
        )

    expected = run()
    with jax.checking_leaks(), jaxoverride_nnx.track(model):
        got = run()
    for want, have in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
        assert jnp.array_equal(want, have)


def test_a_raw_jit_inside_a_neutral_jit_reads_tracers_and_runs():
    model = _model()
    # Not under checking_leaks: JAX's own cache of the inner jit's trace holds the outer
    # trace's tracers it closed over (jax.jit inside jax.jit does the same).
    forward = lambda y: model(y)
    with jaxoverride_nnx.track(model):
        f = jo.jit(lambda x: solve(forward, x))
        first = f(X)
        model.bias[...] = model.bias[...] + 1.0
        assert jnp.allclose(f(X), first + 1.0)  # threaded, not baked


def test_nnx_jit_given_the_module_runs_under_track():
    model = _model()
    f = nnx.jit(lambda m, x: m(x))
    expected = f(model, X)
    with jaxoverride_nnx.track(model):
        assert jnp.array_equal(f(model, X), expected)


def test_neutral_jit_under_track_never_runs_the_hook_on_its_hot_path():
    model = _model()
    reads: list[int] = []

    def counting(variable, value):  # a hook of the program's own, kept and chained
        reads.append(1)
        return value

    model.kernel._var_metadata["on_get_value"] = counting
    compiles: list[str] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _, **__: (
            compiles.append(event)
            if event == "/jax/core/compile/backend_compile_duration"
            else None
        )
    )
    f = jo.jit(lambda x: model(x))
    with jax.checking_leaks(), jaxoverride_nnx.track(model):
        first = f(X)  # traces: the user's read runs the hooks once
        traced_reads, traced_compiles = len(reads), len(compiles)
        for _ in range(5):
            assert jnp.array_equal(f(X), first)
    assert traced_reads == 1
    assert len(reads) == traced_reads  # cache hits read the raw slot: no hook ran
    assert len(compiles) == traced_compiles
    assert model.kernel._var_metadata["on_get_value"] is counting  # the program's, as it was
    assert "on_get_value" not in model.bias._var_metadata


def test_hooks_come_off_at_every_exit_and_nested_scopes_keep_them_until_the_last():
    model, other = _model(), _model()
    before = _metadata(model)
    outer = jaxoverride_nnx.track(model)
    with outer:
        assert all(_hooked(model))
        with jaxoverride_nnx.track(other):
            assert all(_hooked(model)) and all(_hooked(other))
        assert all(_hooked(model)) and not any(_hooked(other))
    assert _metadata(model) == before and not any(_hooked(other))
    with pytest.raises(ZeroDivisionError), jaxoverride_nnx.track(model):
        1 / 0
    assert _metadata(model) == before


def test_a_thread_without_track_reading_the_hooked_model_in_its_own_jit_is_left_alone():
    model = _model()
    seen: list[object] = []
    inside, done = threading.Event(), threading.Event()

    def other_thread():
        inside.wait()
        seen.append(jax.jit(lambda x: model(x))(X))  # no track here: JAX as usual
        done.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    with jaxoverride_nnx.track(model):
        assert all(_hooked(model))
        inside.set()
        done.wait(60)
    thread.join()
    assert jnp.array_equal(seen[0], model(X))


_PACKAGE = """
import jax

def _solve(f, x):
    return f(x)

solve = jax.jit(_solve, static_argnums=0)
"""

_PROGRAM = """
import os, sys
sys.path.insert(0, {tmp!r})
{interpose}
import mysolver  # imported before any adapter entry: its jit is raw
import jax, jax.numpy as jnp
from flax import nnx
import jaxoverride as jo, jaxoverride_nnx

model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
before = [dict(v._var_metadata) for _, v in nnx.iter_graph(model)
          if isinstance(v, nnx.Variable)]
x = jnp.ones(2)
with jax.checking_leaks(), jaxoverride_nnx.track(model):
    forward = lambda y: model(y)  # one function: jit's cache key
    try:
        first = mysolver.solve(forward, x)
    except jo.errors.MissingAdapterError as error:
        print("RAISED", error)
    else:
        model.bias[...] = model.bias[...] + 1.0
        again = mysolver.solve(forward, x)
        print("RAN", "stale" if bool(jnp.array_equal(first, again)) else "fresh")
after = [dict(v._var_metadata) for _, v in nnx.iter_graph(model)
         if isinstance(v, nnx.Variable)]
assert after == before, (before, after)
"""


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("pkgs")
    (folder / "mysolver").mkdir()
    (folder / "mysolver" / "__init__.py").write_text(_PACKAGE)
    return folder


def _run(package: Path, interpose: str = "", check: str = "1") -> str:
    source = _PROGRAM.format(tmp=str(package), interpose=interpose)
    result = run_source(source, JAXOVERRIDE_ADAPTER_CHECK=check)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_fresh_interpreter_a_library_imported_first_is_named_with_its_fix(package: Path):
    out = _run(package)
    assert out.startswith("RAISED jaxoverride_nnx.track: the tracked Variable"), out
    assert "'mysolver' (1)" in out
    assert "jaxoverride.interpose_on_import(" in out and "'mysolver'" in out


def test_fresh_interpreter_the_escape_hatch_runs_it_as_jax(package: Path):
    assert _run(package, check="0").strip() == "RAN stale"


def test_fresh_interpreter_the_fix_makes_the_library_neutral_and_right(package: Path):
    interpose = "import jaxoverride; jaxoverride.interpose_on_import('mysolver')"
    assert _run(package, interpose=interpose).strip() == "RAN fresh"


def _scan(model):
    return lambda x: jo.lax.scan(lambda c, _: (model(c), None), x, None, length=2)[0]


def _while(model):
    return lambda x: jo.lax.while_loop(lambda c: c.sum() < 50.0, lambda c: model(c) + 1.0, x)


@pytest.mark.parametrize("kind", ["scan", "while_loop", "jit"])
def test_a_neutral_call_inside_a_raw_jit_carrying_tracked_values_raises(kind):
    """The adapter reads what a neutral call carries from the raw slot (no hook): those
    values are checked, so a raw jit around the call cannot bake them in."""
    model = _model()
    neutral = {"scan": _scan, "while_loop": _while, "jit": lambda m: jo.jit(lambda x: m(x))}
    call = neutral[kind](model)
    with jax.checking_leaks(), jaxoverride_nnx.track(model):
        with pytest.raises(jo.errors.MissingAdapterError) as caught:
            jax.jit(call)(X)
        message = str(caught.value)
        assert message.startswith("jaxoverride_nnx.track: the tracked Variable `Linear.")
        assert "(carried by a neutral call made there)" in message
        assert "jaxoverride.jit instead of jax.jit" in message
        previous = jo.set_adapter_check(False)
        try:
            stale = jax.jit(call)  # the program means it: as JAX, constants baked in
            before = stale(X)
            model.bias[...] = model.bias[...] + 1.0
            assert jnp.array_equal(stale(X), before)
        finally:
            jo.set_adapter_check(previous)
        assert jnp.allclose(call(X), _reference(kind, model)(X))  # eager: current values


def _reference(kind, model):
    graphdef, state = nnx.split(model)

    def step(x):
        return nnx.merge(graphdef, state)(x)

    if kind == "scan":
        return lambda x: step(step(x))
    if kind == "while_loop":

        def loop(x):
            while x.sum() < 50.0:
                x = step(x) + 1.0
            return x

        return loop
    return step


def test_neutral_calls_inside_neutral_jit_and_raw_grad_carry_tracers_and_run():
    model = _model()
    with jax.checking_leaks(), jaxoverride_nnx.track(model):
        inside = jo.jit(_scan(model))(X)
        grads = jax.grad(lambda x: _scan(model)(x).sum())(X)
        # A raw jit around a neutral call that carries nothing tracked is JAX's.
        pure = jax.jit(lambda x: jo.lax.scan(lambda c, _: (c * 2.0, None), x, None, length=2)[0])
        doubled = pure(X)
    reference = _reference("scan", model)
    assert jnp.allclose(inside, reference(X))
    assert jnp.allclose(grads, jax.grad(lambda x: reference(x).sum())(X))
    assert jnp.array_equal(doubled, X * 4.0)


def _shared_jit():
    return jo.jit(lambda f, x: f(x), static_argnums=0)


def _shared_rule():
    def apply(f, x):
        return f(x)

    rule = jo.custom_vjp(apply, nondiff_argnums=(0,))
    rule.defvjp(lambda f, x: (f(x), x), lambda f, res, g: (2.0 * g,))
    return rule


@pytest.mark.parametrize("shared", [_shared_jit, _shared_rule], ids=["jit", "custom_vjp"])
def test_a_shared_neutral_call_inside_a_raw_jit_that_does_not_reach_the_model_runs(shared):
    """A library's one neutral function (a ``jo.jit``, a ``jo.custom_vjp``) first called
    with a function that uses the tracked model threads the model for every later call,
    since it keeps one build per tracked set. Inside a raw jit, a call whose functions and
    arguments do not reach the model carries those values unused: nothing can go stale,
    so it runs as in JAX (the DEQ baselines of ``make bench`` do this)."""
    model = _model()
    weights = jnp.array([[0.5, -1.0], [2.0, 0.25]])
    solve = shared()
    explicit = jax.jit(lambda x: solve(lambda v: jnp.tanh(v @ weights), x))
    expected = jnp.tanh(X @ weights)
    with jax.checking_leaks(), jaxoverride_nnx.track(model):
        assert jnp.allclose(solve(lambda v: model(v), X), model(X))  # threads the model
        assert jnp.allclose(explicit(X), expected)
        model.bias[...] = model.bias[...] + 1.0
        assert jnp.allclose(explicit(X), expected)
        reaching = jax.jit(lambda x: solve(lambda v: model(v), x))
        with pytest.raises(jo.errors.MissingAdapterError, match="carried by a neutral call"):
            reaching(X)
