"""``install()``: global, active only inside Haiku transforms; and the runnable examples."""

from __future__ import annotations

import sys
from pathlib import Path

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax._src.linear_algebra as optax_linear_algebra
import pytest

import jaxoverride as jo
import jaxoverride_haiku as joh
from _threads import run_in_threads
from jaxoverride import lax as jlax

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
X = jnp.array([0.5, -1.0, 2.0], jnp.float32)
RNG = jax.random.PRNGKey(0)


@pytest.fixture
def installed():
    handle = joh.install()
    try:
        yield handle
    finally:
        joh.uninstall()


def test_install_is_idempotent_and_uninstall_reports() -> None:
    assert not joh.is_installed()
    first = joh.install()
    try:
        assert joh.install() is first
        assert joh.is_installed() and first.installed
    finally:
        assert joh.uninstall() is True
    assert joh.uninstall() is False
    assert not joh.is_installed() and not first.installed


def test_active_only_inside_transforms(installed) -> None:
    assert jo.resolve("lax.scan") is jax.lax.scan
    inside = hk.transform(lambda: jo.resolve("lax.scan")).apply({}, None)
    assert inside is joh.context()["lax.scan"]
    assert jo.resolve("lax.scan") is jax.lax.scan


def test_outside_transforms_the_process_stays_idle(installed) -> None:
    """install() is scoped: no per-call predicate, so neutral functions keep JAX's speed."""
    from jaxoverride import _stack

    jitted = jo.jit(lambda v: v * 2.0)
    jitted(X)
    assert _stack.idle
    assert type(jitted.func).__name__ == "PjitFunction"  # the wrapper calls jax.jit directly
    model = hk.transform(lambda: jo.current_stack())
    stack = model.apply({}, None)
    assert [layer.source for layer in stack.layers] == ["installed, scope"]
    jitted(X)
    assert type(jitted.func).__name__ == "PjitFunction"


def test_install_and_uninstall_inside_a_transform_leave_haiku_intact() -> None:
    """A transform entered before install(), or left after uninstall(), closes cleanly."""
    from haiku._src import base

    original_enter, original_exit = base.HaikuContext.__enter__, base.HaikuContext.__exit__

    def installs_midway(x):
        joh.install()
        return hk.Linear(2)(x)

    try:
        params = hk.transform(installs_midway).init(RNG, X)
        assert sorted(params) == ["linear"]
        assert [layer.source for layer in jo.current_stack().layers] == ["installed (inactive)"]

        def uninstalls_midway(x):
            inside = jo.resolve("lax.scan") is joh.context()["lax.scan"]
            joh.uninstall()
            return inside, hk.Linear(2)(x)

        inside, _ = hk.transform(uninstalls_midway).apply(params, None, X)
        assert inside
        assert jo.current_stack().layers == ()
    finally:
        joh.uninstall()
    assert base.HaikuContext.__enter__ is original_enter
    assert base.HaikuContext.__exit__ is original_exit


def test_outside_a_transform_installed_changes_nothing(installed) -> None:
    f = lambda x: jlax.scan(lambda c, v: (c * v, c), 1.0, x)
    assert str(jax.make_jaxpr(jo.jit(f))(X)) == str(jax.make_jaxpr(jax.jit(f))(X))
    jax.tree.map(np.testing.assert_array_equal, jo.jit(f)(X), jax.jit(f)(X))


def test_library_code_works_without_any_with_block(installed) -> None:
    def library_loop(f, x):  # stands for code that never heard of Haiku
        return jlax.fori_loop(0, 3, lambda i, h: f(h), x)

    model = hk.transform(lambda x: library_loop(lambda h: jnp.tanh(hk.Linear(3)(h)), x))
    params = jax.jit(model.init)(RNG, X)
    out = jax.jit(model.apply)(params, None, X)
    ref = hk.transform(lambda x: hk.fori_loop(0, 3, lambda i, h: jnp.tanh(hk.Linear(3)(h)), x))
    np.testing.assert_allclose(out, ref.apply(params, None, X), rtol=1e-6)


def test_each_thread_sees_its_own_transforms(installed) -> None:
    results: dict[int, object] = {}

    def worker(index: int) -> None:
        model = hk.transform(
            lambda x: jlax.scan(lambda c, _: (hk.Linear(3)(c), None), x, length=2)[0]
        )
        params = model.init(jax.random.PRNGKey(index), X)
        results[index] = (sorted(params), jo.resolve("lax.scan") is jax.lax.scan)

    run_in_threads(worker, 4)
    assert results == {i: (["linear"], True) for i in range(4)}


def test_context_and_install_together_give_the_same_results(installed) -> None:
    model = hk.transform_with_state(
        lambda x: jlax.scan(lambda c, _: (jnp.tanh(hk.Linear(3)(c)), None), x, length=3)[0]
    )
    params, state = model.init(RNG, X)
    out, _ = model.apply(params, state, RNG, X)
    with joh.context():
        both, _ = model.apply(params, state, RNG, X)
    np.testing.assert_allclose(both, out, rtol=1e-6)


def test_interposed_third_party_library(installed) -> None:
    """optax.power_iteration runs ``jax.lax.while_loop`` on a callable it is given."""

    def program(v0):
        linear = hk.Linear(3, with_bias=False, name="op")

        def operator(v):
            calls = hk.get_state("calls", [], jnp.int32, init=jnp.zeros)
            hk.set_state("calls", calls + 1)
            return linear(v)

        return optax.power_iteration(operator, v0=v0, num_iters=20, error_tolerance=0.0)

    model = hk.transform_with_state(program)
    with jo.interpose(optax_linear_algebra):
        params, state = model.init(RNG, jnp.ones(3))
        (value, _), new_state = model.apply(params, state, RNG, jnp.ones(3))
    expected, _ = optax.power_iteration(
        params["op"]["w"].T, v0=jnp.ones(3), num_iters=20, error_tolerance=0.0
    )
    np.testing.assert_allclose(value, expected, rtol=1e-5)
    assert int(new_state["~"]["calls"]) == 21  # once before the loop, once per iteration


def _example(name: str):
    sys.path.insert(0, str(EXAMPLES))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(EXAMPLES))


def test_flagship_example_agrees_with_raw_jax(monkeypatch) -> None:
    demo = _example("_demo")
    fpsolve = _example("fpsolve")
    haiku_demo = _example("fixed_point_haiku")
    assert haiku_demo.METHODS == ("forward", "anderson", "newton")
    # Newton alone, to keep the test short: it uses jit, while_loop and jacfwd; `make demo`
    # compares every method with raw JAX.
    monkeypatch.setattr(haiku_demo, "METHODS", ("newton",))
    problem = demo.make_problem(n=8, d=3)
    rows = haiku_demo.run(problem)
    assert [row.method for row in rows] == ["newton"]
    for row in rows:
        raw = fpsolve.fixed_point(
            demo.dense_map, jnp.zeros(problem.n), problem.args, method=row.method
        )
        assert row.framework == "haiku" and row.iterations == int(raw.iterations)
        np.testing.assert_allclose(row.solution, raw.value, atol=1e-5)


def test_install_example_runs(capsys) -> None:
    _example("haiku_install").main()
    out = capsys.readouterr().out
    assert "leaked out of the loop as a tracer" in out
    assert "install() is gone again: True" in out
