"""Haiku's end-of-transform check under ``context()``, not only under ``install()``.

A library of the program's own that built a bare ``jax.jit`` object at import time, bound
by name by its caller (``from mylib import step``), is raw JAX that no guard reaches: JAX's
C++ object cannot be changed from inside. Called inside ``hk.transform`` over a function
that creates parameters, it returns tracers as parameters at init. ``install()`` catches
that when the transform ends; entering ``jaxoverride_haiku.context()`` now does too, with
the same error naming ``interpose_on_import`` and the package, and the same escape hatch.

Each case runs in a fresh interpreter: the library must be imported before anything is
interposed, and the hook on ``HaikuContext.__exit__`` is process-wide state.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from _fresh import RAW_JIT_LIBRARY, run_source, run_with_raw_jit_library

_PRELUDE = """
import sys
sys.path.insert(0, {path!r})
import jax, jax.numpy as jnp, haiku as hk
from haiku._src import base
from mylib import step  # bound by name, before anything is interposed
import jaxoverride as jo, jaxoverride_haiku
from jaxoverride import adapter_kit, _stack

HAIKU_ENTER, HAIKU_EXIT = base.HaikuContext.__enter__, base.HaikuContext.__exit__
key, x = jax.random.PRNGKey(0), jnp.ones((1, 2))


def forward(x):
    layer = hk.Linear(2, name="cell")
    return step(lambda z: layer(z), x)


model = hk.transform(forward)


def expect_error(run):
    message = raw_jit_error(run, "the raw jit's tracers became parameters silently")
    assert message.startswith("hk.transform ended with 2 Haiku parameter"), message
    assert "tracers of a JAX trace that has ended" in message, message
    return message


def assert_restored():
    assert base.HaikuContext.__exit__ is HAIKU_EXIT, "the transform exit hook was left in"
    assert _stack.context_snapshot() is _stack.ROOT, "a context was left entered"
"""


def _run(tmp_path: Path, body: str) -> str:
    return run_with_raw_jit_library(tmp_path, _PRELUDE, body)


@pytest.mark.parametrize("phase", ["init", "init_with_state"])
def test_raw_jit_bound_by_name_is_caught_when_a_transform_ends_under_context(
    tmp_path: Path, phase: str
) -> None:
    out = _run(
        tmp_path,
        f"""
        transformed = hk.transform_with_state(forward) if {phase!r} == "init_with_state" else model

        def init_in_context():
            with jaxoverride_haiku.context():
                transformed.init(key, x)

        expect_error(init_in_context)
        assert_restored()
        print("ok")
        """,
    )
    assert out.strip() == "ok"


def test_nested_reentered_and_decorated_contexts_keep_the_check_and_restore_the_hook(
    tmp_path: Path,
) -> None:
    out = _run(
        tmp_path,
        """
        context = jaxoverride_haiku.context()

        def nested():
            with context:
                with context:
                    model.init(key, x)

        expect_error(nested)
        assert_restored()

        with context:
            with context:
                pass
            # The inner exit leaves the hook for the outer entry.
            assert base.HaikuContext.__exit__ is not HAIKU_EXIT
            expect_error(lambda: model.init(key, x))
        assert_restored()

        expect_error(context(lambda: model.init(key, x)))  # as a decorator
        assert_restored()

        # Out-of-order exit is refused with nothing changed: the hook is still counted.
        other = jo.override_context({}, name="other")
        context.__enter__()
        other.__enter__()
        try:
            context.__exit__(None, None, None)
        except RuntimeError:
            pass
        else:
            raise AssertionError("an out-of-order exit was accepted")
        assert base.HaikuContext.__exit__ is not HAIKU_EXIT
        other.__exit__(None, None, None)
        context.__exit__(None, None, None)
        assert_restored()

        # Under install() too, the check runs once and both hooks come out.
        jaxoverride_haiku.install()
        with context:
            expect_error(lambda: model.init(key, x))
        jaxoverride_haiku.uninstall()
        assert_restored()
        assert base.HaikuContext.__enter__ is HAIKU_ENTER
        print("ok")
        """,
    )
    assert out.strip() == "ok"


def test_the_escape_hatch_turns_the_check_off_under_context(tmp_path: Path) -> None:
    out = _run(
        tmp_path,
        """
        previous = jo.set_adapter_check(False)
        assert not adapter_kit.adapter_check_on()
        with jaxoverride_haiku.context():
            params = model.init(key, x)
        jo.set_adapter_check(previous)
        # The silent failure that the check stands for comes back.
        assert len(tracers(params)) == 2, params
        assert_restored()
        print("ok")
        """,
    )
    assert out.strip() == "ok"


def test_the_check_leaves_right_programs_and_idle_transforms_alone(tmp_path: Path) -> None:
    out = _run(
        tmp_path,
        """
        # A raw jit over a function that only reads parameters is right as raw JAX.
        def reads(x):
            w = hk.get_parameter("w", (2, 2), init=jnp.ones)
            return step(lambda z: z @ w, x)

        with jaxoverride_haiku.context():
            params = hk.transform(reads).init(key, x)
            out = hk.transform(reads).apply(params, None, x)
            # A transform traced by an outer jit keeps that live trace's tracers...
            plain = hk.transform(lambda x: hk.Linear(2, name="cell")(x))
            jitted = jax.jit(plain.init)(key, x)
        # ...and the check is that trace's: a raw jit inside it still leaks.
        with jaxoverride_haiku.context():
            expect_error(lambda: jax.jit(model.init)(key, x))
        assert not tracers(params) and not tracers(jitted), (params, jitted)
        assert jnp.allclose(out, x @ jnp.ones((2, 2)))

        # Outside the context Haiku's exit is its own: nothing is checked.
        assert_restored()
        assert len(tracers(model.init(key, x))) == 2
        print("ok")
        """,
    )
    assert out.strip() == "ok"


def test_the_fix_the_error_names_makes_the_same_model_right(tmp_path: Path) -> None:
    (tmp_path / "mylib.py").write_text(RAW_JIT_LIBRARY)
    result = run_source(
        f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import jax, jax.numpy as jnp, haiku as hk
        import jaxoverride as jo, jaxoverride_haiku

        jo.interpose_on_import("mylib")
        from mylib import step

        def forward(x):
            layer = hk.Linear(2, name="cell")
            return step(lambda z: layer(z), x)

        x = jnp.ones((1, 2))
        with jaxoverride_haiku.context():
            params = hk.transform(forward).init(jax.random.PRNGKey(0), x)
            out = hk.transform(forward).apply(params, None, x)
        leaves = jax.tree_util.tree_leaves(params)
        assert leaves and not any(isinstance(l, jax.core.Tracer) for l in leaves), leaves
        expected = x @ params["cell"]["w"] + params["cell"]["b"]
        assert jnp.allclose(out, expected), (out, expected)
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip() == "ok"
