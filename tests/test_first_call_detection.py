"""The missing-adapter check catches a silent failure at its first call, in Haiku, Linen and NNX.

Two cases of issue 20 that used to pass silently or be caught far from their cause:

- a solver library never interposed (optimistix imported before ``interpose_on_import``),
  called while an adapter is active: its import-time ``eqx.filter_jit`` runs framework
  code under raw JAX. The call itself now raises ``MissingAdapterError`` naming the
  transform, the packages and ``interpose_on_import``, under ``install()`` and
  ``context()`` alike. These cases run in fresh interpreters: import order is the point.
- a ``jo.jit`` built at import time (before any framework scope), called inside a
  transform with no adapter: its trace now raises with the fix, though its dispatch is
  JAX's own.
"""

from __future__ import annotations

import functools
import textwrap
from collections.abc import Callable
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn, nnx
from jax.core import Tracer

import jaxoverride as jo
import jaxoverride_haiku
import jaxoverride_linen
import jaxoverride_nnx
from _fresh import MISSING_ADAPTER_MESSAGE, run_source
from jaxoverride import adapter_kit
from jaxoverride.errors import MissingAdapterError

X = jnp.ones((1, 2))
HATCH = "jaxoverride.set_adapter_check(False)"


def _run(source: str) -> str:
    result = run_source(source)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def _tracers(tree: object) -> list[object]:
    return [leaf for leaf in jax.tree_util.tree_leaves(tree) if isinstance(leaf, Tracer)]


# -- 1. A never-interposed solver library, called while an adapter is active ---------------

# Shared by the subprocesses: asserts the error of a never-interposed optx.fixed_point.
_EXPECT = (
    MISSING_ADAPTER_MESSAGE
    + """

def expect_first_call_error(run, framework):
    reached.clear()
    silently = f"{framework}: the raw transform ran framework code silently"
    message = missing_adapter_message(run, silently)
    assert reached == [], f"{framework}: caught only after the call returned to the model"
    assert message.startswith("optimistix.fixed_point is a transform"), message
    assert "jaxoverride.interpose_on_import('equinox', 'lineax', 'optimistix')" in message, message
    assert framework in message, message
    assert "jaxoverride.set_adapter_check(False)" in message, message
    from jaxoverride import _stack
    assert _stack.context_snapshot() is _stack.ROOT, "a context was left entered"
"""
)

# The models the subprocesses solve in, each checked under the adapter's context() and
# install(); ``{fixed_point}`` is how they reach the solver (``optx.fixed_point``, looked up
# at each call, or ``fixed_point``, bound by name before any adapter).
_HAIKU_MODEL = """
def forward(x):
    layer = hk.Linear(2, w_init=hk.initializers.RandomNormal(0.1), name="cell")
    fun = lambda z, _: jnp.tanh(layer(z) + x)
    z = {fixed_point}(fun, solver, jnp.zeros(2), max_steps=50, throw=False).value
    reached.append(True)
    return z

haiku_model = hk.transform(forward)

def haiku_in_context():
    with jaxoverride_haiku.context():
        haiku_model.init(key, x)

expect_first_call_error(haiku_in_context, "Haiku")
jaxoverride_haiku.install()
expect_first_call_error(lambda: haiku_model.init(key, x), "Haiku")
"""

_LINEN_MODEL = """
class Deq(nn.Module):
    @nn.compact
    def __call__(self, x):
        dense = nn.Dense(2)
        fun = lambda z, _: jnp.tanh(dense(z) + x)
        z = {fixed_point}(fun, solver, jnp.zeros(2), max_steps=50, throw=False).value
        reached.append(True)
        return z

def linen_in_context():
    with jaxoverride_linen.context():
        Deq().init(key, x)

expect_first_call_error(linen_in_context, "Flax Linen")
jaxoverride_linen.install()
expect_first_call_error(lambda: Deq().init(key, x), "Flax Linen")
"""


def _run_expecting_first_call_errors(imports: str, *body: str) -> None:
    """Runs ``imports``, then ``expect_first_call_error`` (_EXPECT), then the ``body`` parts,
    each dedented, in a fresh interpreter that must print ``ok``."""
    parts = [imports, "reached = []\n", _EXPECT, *body]
    assert _run("".join(textwrap.dedent(part) for part in parts)).strip() == "ok"


def test_haiku_never_interposed_solver_is_caught_at_its_call_under_install_and_context():
    _run_expecting_first_call_errors(
        """
        import jax, jax.numpy as jnp, haiku as hk
        import optimistix as optx  # before any interpose_on_import
        import jaxoverride as jo, jaxoverride_haiku
        import sys
        flax_modules = {name for name in sys.modules if name.startswith("flax")}
        """,
        """
        solver = optx.FixedPointIteration(rtol=1e-6, atol=1e-6)
        key, x = jax.random.PRNGKey(0), jnp.ones(2)
        """,
        _HAIKU_MODEL.format(fixed_point="optx.fixed_point"),
        """
        # A never-interposed solver over a function that touches no Haiku state is right
        # as raw JAX: it runs, with the adapter active.
        def pure(x):
            fun = lambda z, _: jnp.tanh(0.5 * z + x)
            return optx.fixed_point(fun, solver, jnp.zeros(2), max_steps=200).value

        out = hk.transform(pure).apply({}, None, x)
        expected = optx.fixed_point(
            lambda z, _: jnp.tanh(0.5 * z + x), solver, jnp.zeros(2), max_steps=200
        ).value
        assert jnp.allclose(out, expected), (out, expected)
        jaxoverride_haiku.uninstall()
        now = {name for name in sys.modules if name.startswith("flax")}
        assert now == flax_modules, now - flax_modules  # the check imported no framework
        print("ok")
        """,
    )


def test_linen_never_interposed_solver_is_caught_at_its_call_under_install_and_context():
    _run_expecting_first_call_errors(
        """
        import jax, jax.numpy as jnp, flax.linen as nn
        import optimistix as optx
        import jaxoverride as jo, jaxoverride_linen
        """,
        """
        solver = optx.FixedPointIteration(rtol=1e-6, atol=1e-6)
        key, x = jax.random.PRNGKey(0), jnp.ones(2)
        """,
        _LINEN_MODEL.format(fixed_point="optx.fixed_point"),
        """
        # The escape hatch: the silent failure it stood for (tracers as parameters).
        jo.set_adapter_check(False)
        variables = Deq().init(key, x)
        jo.set_adapter_check(True)
        leaves = jax.tree_util.tree_leaves(variables)
        assert any(isinstance(leaf, jax.core.Tracer) for leaf in leaves), leaves
        jaxoverride_linen.uninstall()
        assert "haiku" not in __import__("sys").modules
        print("ok")
        """,
    )


def test_nnx_never_interposed_solver_over_a_tracked_module_is_caught_at_its_call():
    _run_expecting_first_call_errors(
        """
        import jax, jax.numpy as jnp
        from flax import nnx
        import optimistix as optx
        import jaxoverride as jo, jaxoverride_nnx
        """,
        """
        solver = optx.FixedPointIteration(rtol=1e-6, atol=1e-6)
        model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

        def solve():
            fun = lambda z, _: jnp.tanh(model(z))
            z = optx.fixed_point(fun, solver, jnp.zeros(2), max_steps=50, throw=False).value
            reached.append(True)
            return z

        def tracked():
            with jaxoverride_nnx.track(model):
                return solve()

        expect_first_call_error(tracked, "model")
        # Without track, no NNX adapter is active: raw JAX's behaviour, as before.
        assert solve().shape == (2,)
        assert "haiku" not in __import__("sys").modules
        print("ok")
        """,
    )


def test_a_solver_bound_by_name_before_the_first_adapter_entry_is_caught_at_its_call():
    """``from optimistix import fixed_point`` at the top of a script binds the raw
    ``eqx.filter_jit`` wrapper itself, which no rebinding of ``optimistix.fixed_point``
    reaches. The guard on the jit the wrapper holds does: under Haiku's ``context()`` and
    ``install()``, Linen's ``context()`` and ``install()`` and NNX's ``track``, the call
    raises with the fix, as ``optx.fixed_point(...)`` does, instead of tracer parameters
    (Haiku ``context()``, Linen) or stale weights served from raw JAX's cache (NNX)."""
    _run_expecting_first_call_errors(
        """
        import jax, jax.numpy as jnp, haiku as hk, flax.linen as nn
        from flax import nnx
        from optimistix import FixedPointIteration, fixed_point  # before any adapter
        import jaxoverride as jo, jaxoverride_haiku, jaxoverride_linen, jaxoverride_nnx
        """,
        """
        solver = FixedPointIteration(rtol=1e-6, atol=1e-6)
        key, x = jax.random.PRNGKey(0), jnp.ones(2)
        """,
        _HAIKU_MODEL.format(fixed_point="fixed_point"),
        """
        jaxoverride_haiku.uninstall()
        """,
        _LINEN_MODEL.format(fixed_point="fixed_point"),
        """
        jaxoverride_linen.uninstall()

        model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        cell = lambda z, _: jnp.tanh(model(z) + 1.0)  # one function: raw JAX caches it

        def nnx_tracked():
            with jaxoverride_nnx.track(model):
                fixed_point(cell, solver, jnp.zeros(2), max_steps=50, throw=False)
                reached.append(True)

        expect_first_call_error(nnx_tracked, "model")

        # The escape hatch: the silent failures it stood for.
        jo.set_adapter_check(False)
        with jaxoverride_haiku.context():
            params = haiku_model.init(key, x)
        leaves = jax.tree_util.tree_leaves(params)
        assert leaves and all(isinstance(l, jax.core.Tracer) for l in leaves), leaves
        with jaxoverride_nnx.track(model):
            before = fixed_point(cell, solver, jnp.zeros(2), max_steps=50, throw=False).value
            model.kernel[...] = jnp.zeros((2, 2))
            stale = fixed_point(cell, solver, jnp.zeros(2), max_steps=50, throw=False).value
        assert jnp.allclose(stale, before) and not jnp.allclose(stale, jnp.tanh(1.0))
        jo.set_adapter_check(True)

        # With an adapter active, a solver over a function that touches no framework
        # state is right as raw JAX: the guard runs it.
        pure = lambda z, _: jnp.tanh(0.5 * z + x)
        expected = fixed_point(pure, solver, jnp.zeros(2), max_steps=200).value
        with jaxoverride_haiku.context():
            out = hk.transform(lambda: fixed_point(pure, solver, jnp.zeros(2), max_steps=200))
            out = out.apply({}, None).value
        assert jnp.allclose(out, expected), (out, expected)
        print("ok")
        """,
    )


def test_the_fix_in_the_error_works_and_the_guard_keeps_reports_truthful():
    """``interpose_on_import`` before the import makes the same model right; a guard put on
    a raw transform still counts as raw for ``ImportOrderError`` and the self-check."""
    out = _run(
        """
        import jax, jax.numpy as jnp, haiku as hk, sys
        import jaxoverride as jo, jaxoverride_haiku
        from jaxoverride import adapter_kit

        handle = jo.interpose_on_import("equinox", "optimistix")
        import optimistix as optx
        solver = optx.FixedPointIteration(rtol=1e-6, atol=1e-6)

        def forward(x):
            layer = hk.Linear(2, w_init=hk.initializers.RandomNormal(0.1), name="cell")
            fun = lambda z, _: jnp.tanh(layer(z) + x)
            return optx.fixed_point(fun, solver, jnp.zeros(2), max_steps=200).value

        with jaxoverride_haiku.context():
            params = hk.transform(forward).init(jax.random.PRNGKey(0), jnp.ones(2))
        leaves = jax.tree_util.tree_leaves(params)
        assert leaves and not any(isinstance(l, jax.core.Tracer) for l in leaves), leaves
        assert adapter_kit.raw_import_time_transforms(["optimistix"]) == {}
        handle.restore()

        import diffrax  # imported without interposition: raw, then guarded on entry
        before = adapter_kit.raw_import_time_transforms(["diffrax"])["diffrax"]
        with jaxoverride_haiku.context():
            pass
        assert type(diffrax.diffeqsolve).__name__ == "RawGuard"
        assert adapter_kit.raw_import_time_transforms(["diffrax"])["diffrax"] == before
        report = jo.self_check(["diffrax"])
        assert f"diffrax: {len(before)} (" in report, report
        assert f"{len(before)} of them are checked at each call" in report, report
        try:
            jo.interpose_on_import("diffrax")
        except jo.ImportOrderError as error:
            assert f"'diffrax' {len(before)} (" in str(error), error
        else:
            raise AssertionError("a guarded raw transform was not reported")
        # Idle, the guard is the raw transform: same result, its attributes forwarded.
        assert diffrax.diffeqsolve.__wrapped__.__name__ == "diffeqsolve"
        print("ok")
        """
    )
    assert out.strip() == "ok"


def test_a_process_without_frameworks_guards_nothing_and_imports_no_framework():
    out = _run(
        """
        import sys
        import jax.numpy as jnp
        import optimistix as optx
        import jaxoverride as jo, jaxoverride_plain
        raw = optx.fixed_point
        with jaxoverride_plain.context():
            z = optx.fixed_point(
                lambda z, _: jnp.tanh(0.5 * z),
                optx.FixedPointIteration(rtol=1e-6, atol=1e-6),
                jnp.ones(2),
            ).value
        assert optx.fixed_point is raw, "rebound in a process that imports no framework"
        assert not {"haiku", "flax"} & set(sys.modules), sorted(sys.modules)
        print("ok")
        """
    )
    assert out.strip() == "ok"


# -- 2. A jo.jit built at import time, called inside a transform with no adapter -------------


@jo.jit
def _haiku_layer(x: jax.Array) -> jax.Array:
    return hk.Linear(2, name="dense")(x)


@jo.jit
def _linen_layer(x: jax.Array) -> jax.Array:
    return nn.Dense(2)(x)


@jo.jit
def _nnx_layer(x: jax.Array) -> jax.Array:
    return _NNX_MODEL(x)


@jo.jit
def _reads_nothing(x: jax.Array) -> jax.Array:
    return jnp.tanh(x) * 2


# Assigned after the jit was built: creating it could not see the module it captures.
_NNX_MODEL = nnx.Linear(2, 2, rngs=nnx.Rngs(0))


class _LinenModel(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return _linen_layer(x)


def _haiku_model() -> hk.Transformed:
    return hk.transform(lambda x: _haiku_layer(x))


def _assert_raises_with_the_fix(run: Callable[[], object], *phrases: str) -> None:
    """``run()`` raises MissingAdapterError, whose message has ``phrases`` and the hatch."""
    with pytest.raises(MissingAdapterError) as info:
        run()
    for phrase in (*phrases, HATCH):
        assert phrase in str(info.value)


def test_module_level_jit_in_haiku_without_the_adapter_raises_with_the_fix():
    # Earlier tests that installed adapters may have left it on its slow path, which its
    # first idle call leaves; this test is about JAX's own (fast) path.
    _haiku_layer._switch_to_fast()
    assert _haiku_layer.func is _haiku_layer.__dict__["_jaxoverride_state"].plain  # JAX's path
    init = lambda: _haiku_model().init(jax.random.PRNGKey(0), X)
    _assert_raises_with_the_fix(init, "jaxoverride.jit met Haiku", "jaxoverride_haiku.install()")


def test_module_level_jit_in_haiku_with_the_adapter_gives_arrays():
    with jaxoverride_haiku.context():
        params = _haiku_model().init(jax.random.PRNGKey(0), X)
        out = _haiku_model().apply(params, None, X)
    assert sorted(params) == ["dense"] and not _tracers(params)
    expected = X @ params["dense"]["w"] + params["dense"]["b"]
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_module_level_jit_in_linen_without_the_adapter_raises_with_the_fix():
    init = lambda: _LinenModel().init(jax.random.PRNGKey(0), X)
    fix = "jaxoverride_linen.install()"
    _assert_raises_with_the_fix(init, "jaxoverride.jit met Flax Linen", fix)


def test_module_level_jit_in_linen_with_the_adapter_gives_arrays():
    with jaxoverride_linen.context():
        variables = _LinenModel().init(jax.random.PRNGKey(0), X)
        out = _LinenModel().apply(variables, X)
    dense = variables["params"]["Dense_0"]
    assert not _tracers(variables)
    np.testing.assert_allclose(out, X @ dense["kernel"] + dense["bias"], rtol=1e-6)


def test_module_level_jit_over_an_nnx_module_without_track_raises_with_the_fix():
    _assert_raises_with_the_fix(
        lambda: _nnx_layer(X), "bake their current weights", "jaxoverride_nnx.track("
    )


def test_module_level_jit_over_an_nnx_module_under_track_sees_new_weights():
    with jaxoverride_nnx.track(_NNX_MODEL):
        first = _nnx_layer(X)
        _NNX_MODEL.bias.value = _NNX_MODEL.bias.value + 1.0
        second = _nnx_layer(X)
    np.testing.assert_allclose(second, first + 1.0, rtol=1e-6)


def test_module_level_jit_that_touches_no_framework_runs_as_jax_inside_transforms():
    haiku_out = hk.transform(lambda x: _reads_nothing(x)).apply({}, None, X)
    np.testing.assert_allclose(haiku_out, jnp.tanh(X) * 2, rtol=1e-6)

    class Plain(nn.Module):
        def __call__(self, x: jax.Array) -> jax.Array:
            return _reads_nothing(x)

    np.testing.assert_allclose(Plain().apply({}, X), jnp.tanh(X) * 2, rtol=1e-6)


def test_the_trace_time_check_keeps_jax_names_jaxprs_and_one_compile():
    def scaled(x: jax.Array, n: int) -> jax.Array:
        return x * n

    ours, theirs = jo.jit(scaled, static_argnums=1), jax.jit(scaled, static_argnums=1)
    assert ours.__wrapped__ is scaled
    assert (ours.__name__, ours.__qualname__) == (theirs.__name__, theirs.__qualname__)
    assert str(jax.make_jaxpr(ours, static_argnums=1)(1.0, 2)) == str(
        jax.make_jaxpr(theirs, static_argnums=1)(1.0, 2)
    )
    assert ours.trace(1.0, 2).jaxpr.jaxpr.debug_info == theirs.trace(1.0, 2).jaxpr.jaxpr.debug_info
    compiles: list[str] = []
    np.asarray(X)  # made before counting

    def listener(event: str, *args: object, **kwargs: object) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        fresh = jo.jit(lambda x: x * 3)
        for _ in range(3):
            fresh(X)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert len(compiles) == 1


# -- 3. What no guard reaches: the end-of-transform check, and what it reads -----------------


def test_escaped_tracers_finds_tracers_of_ended_traces_not_of_live_ones():
    leaked: list[jax.Array] = []
    jax.make_jaxpr(lambda x: leaked.append(x) or x)(1.0)
    assert len(adapter_kit.escaped_tracers({"w": leaked[0], "b": jnp.ones(2)})) == 1
    seen: list[list[object]] = []

    def outer(x: jax.Array) -> jax.Array:
        # x's trace runs around the inner one: live, not escaped; the leaked one is.
        jax.make_jaxpr(lambda y: seen.append(adapter_kit.escaped_tracers([x, y, *leaked])) or y)(x)
        return x

    jax.make_jaxpr(outer)(2.0)
    assert len(seen[0]) == 1 and seen[0][0] is leaked[0]


def test_a_raw_jit_the_guards_cannot_reach_is_caught_when_an_installed_transform_ends():
    """A bare ``jax.jit`` object (JAX's C++ object, which no guard can wrap from inside) that
    creates Haiku parameters under its raw trace: ``install()``'s check at the end of
    ``hk.transform`` raises with the fix instead of returning tracers as parameters."""

    @functools.partial(jax.jit, static_argnums=0)
    def solve(fun: Any, x: jax.Array) -> jax.Array:
        return fun(x)

    def forward(x: jax.Array) -> jax.Array:
        layer = hk.Linear(2, name="cell")
        return solve(lambda z: layer(z), x)

    jaxoverride_haiku.install()
    try:
        with pytest.raises(MissingAdapterError) as info:
            hk.transform(forward).init(jax.random.PRNGKey(0), X)
    finally:
        jaxoverride_haiku.uninstall()
    message = str(info.value)
    assert message.startswith("hk.transform ended with 2 Haiku parameter"), message
    assert "tracers of a JAX trace that has ended" in message
    assert "interpose_on_import" in message
    assert HATCH in message
    # The escape hatch turns this check off too: the silent failure it stands for comes back.
    previous = jo.set_adapter_check(False)
    jaxoverride_haiku.install()
    try:
        params = hk.transform(forward).init(jax.random.PRNGKey(0), X)
    finally:
        jaxoverride_haiku.uninstall()
        jo.set_adapter_check(previous)
    assert _tracers(params), "with the check off, init returns the leaked tracers as before"
