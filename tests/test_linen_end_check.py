"""Flax Linen's end-of-call check, under ``context()`` and ``install()``.

A library of the program's own that built a bare ``jax.jit`` object at import time, bound
by name by its caller (``from mylib import step``), is raw JAX that no guard reaches.
Called inside a bound Linen module over a function that creates variables, it made init
return tracers as parameters, silently. Now the outermost method call of the bound module
raises when it returns, naming ``interpose_on_import`` and the package, under the
adapter's ``context()`` and ``install()``; the escape hatch turns it off.

Fresh interpreters: the library must be imported before anything is interposed, and the
hook on ``Module._call_wrapped_method`` is process-wide state.
"""

from __future__ import annotations

from pathlib import Path

from _fresh import run_with_raw_jit_library

_PRELUDE = """
import sys
sys.path.insert(0, {path!r})
import jax, jax.numpy as jnp, flax.linen as nn
from flax.linen import module as linen_module
from mylib import step  # bound by name, before anything is interposed
import jaxoverride as jo, jaxoverride_linen
from jaxoverride import _stack

LINEN_CALL = linen_module.Module._call_wrapped_method
key, x = jax.random.PRNGKey(0), jnp.ones((1, 2))


class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        dense = nn.Dense(2)
        return step(lambda z: dense(z), x)


def expect_error(run):
    message = raw_jit_error(run, "the raw jit's tracers became variables silently")
    assert message.startswith("A bound Linen module's call ended with 2 Flax Linen"), message


def assert_restored():
    assert linen_module.Module._call_wrapped_method is LINEN_CALL, "the hook was left in"
    assert _stack.context_snapshot() is _stack.ROOT, "a context was left entered"
"""


def _run(tmp_path: Path, body: str) -> None:
    assert run_with_raw_jit_library(tmp_path, _PRELUDE, body).strip() == "ok"


def test_raw_jit_bound_by_name_is_caught_under_context_and_install(tmp_path: Path) -> None:
    _run(
        tmp_path,
        """
        context = jaxoverride_linen.context()

        def init_in_context():
            with context:
                Model().init(key, x)

        expect_error(init_in_context)
        assert_restored()

        def nested():
            with context:
                with context:
                    pass
                assert linen_module.Module._call_wrapped_method is not LINEN_CALL
                Model().init(key, x)

        expect_error(nested)
        assert_restored()

        jaxoverride_linen.install()
        expect_error(lambda: Model().init(key, x))
        with context:
            expect_error(lambda: Model().init(key, x))
        jaxoverride_linen.uninstall()
        assert_restored()
        print("ok")
        """,
    )


def test_the_escape_hatch_and_right_programs(tmp_path: Path) -> None:
    _run(
        tmp_path,
        """
        previous = jo.set_adapter_check(False)
        with jaxoverride_linen.context():
            variables = Model().init(key, x)
        jo.set_adapter_check(previous)
        assert len(tracers(variables)) == 2, variables  # the silent failure it stood for

        class Reads(nn.Module):
            @nn.compact
            def __call__(self, x):
                w = self.param("w", nn.initializers.ones, (2, 2))
                return step(lambda z: z @ w, x)

        class Plain(nn.Module):
            @nn.compact
            def __call__(self, x):
                return nn.Dense(2)(x)

        with jaxoverride_linen.context():
            variables = Reads().init(key, x)  # reads under raw jit: right as raw JAX
            out = Reads().apply(variables, x)
            jitted = jax.jit(Plain().init)(key, x)  # the outer jit's trace is live
            bound = Plain().bind(Plain().init(key, x))
            bound(x)
        assert not tracers(variables) and not tracers(jitted)
        assert jnp.allclose(out, x @ jnp.ones((2, 2)))
        assert_restored()
        # Outside the adapter, Linen's own method runner: nothing is checked.
        assert len(tracers(Model().init(key, x))) == 2
        print("ok")
        """,
    )
