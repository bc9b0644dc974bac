"""install() / uninstall() / context(), Linen's own lifted transforms, and composition."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import jaxoverride as jo
import jaxoverride_dag as jdag
import jaxoverride_debug as jd
import jaxoverride_linen as jol
from _linen_models import assert_trees_close, check_init_exact
from jaxoverride import lax as jlax


@pytest.fixture
def installed(linen_installed: None) -> None:
    """The tests below that request it run with the adapter installed (conftest's fixture)."""


class Loop(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        layer = nn.Dense(3)
        return jlax.fori_loop(0, 3, lambda i, h: jnp.tanh(layer(h)), x)


def test_install_is_idempotent_and_uninstall_removes_it():
    assert not jol.is_installed()
    first = jol.install()
    try:
        assert jol.install() is first
        assert jol.is_installed()
    finally:
        assert jol.uninstall()
    assert not jol.is_installed()
    assert not jol.uninstall()


def test_the_adapter_is_idle_outside_bound_modules(installed: None):
    assert not jol.in_bound_module()
    seen = []

    class Probe(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            seen.append(jol.in_bound_module())
            return x

        def stack(self) -> str:
            return repr(jo.current_stack())

    Probe().apply({}, jnp.ones(1))
    assert seen == [True]
    # Scoped: inactive outside module methods (neutral calls take JAX's idle fast path),
    # entered around each method call of a bound module.
    assert "jaxoverride_linen" in repr(jo.current_stack())
    assert "installed (inactive)" in repr(jo.current_stack())
    assert "[installed, scope] jaxoverride_linen" in Probe().apply({}, method=Probe.stack)
    # Outside a module a neutral call is JAX's own: same jaxpr.
    fun = lambda x: jlax.fori_loop(0, 2, lambda i, h: h * 2, x)
    assert str(jax.make_jaxpr(fun)(1.0)) == str(
        jax.make_jaxpr(lambda x: jax.lax.fori_loop(0, 2, lambda i, h: h * 2, x))(1.0)
    )


def test_the_import_error_names_the_extra():
    code = (
        "import sys; sys.modules['flax'] = None; sys.modules['flax.linen'] = None\n"
        "try:\n    import jaxoverride_linen\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert "jaxoverride[linen]" in out


class Lifted(nn.Module):
    """Linen's own lifted transforms, around and inside neutral calls."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        remat_dense = nn.remat(nn.Dense)(3)
        jit_dense = nn.jit(nn.Dense)(3)
        vmapped = nn.vmap(nn.Dense, variable_axes={"params": None}, split_rngs={"params": False})(3)
        h = jlax.fori_loop(0, 2, lambda i, h: jnp.tanh(jit_dense(remat_dense(h))), x)
        h = vmapped(h)

        def scanned(module: nn.Module, carry: jax.Array, _: Any) -> Any:
            inner = jlax.fori_loop(0, 2, lambda i, c: nn.Dense(3)(c), carry)
            return inner, None

        h, _ = nn.scan(scanned, variable_broadcast="params", split_rngs={"params": False})(
            self, h, jnp.arange(2.0)
        )
        h = nn.while_loop(
            lambda m, c: c[0] < 2,
            lambda m, c: (c[0] + 1, c[1] * 2),
            self,
            (0, h),
        )[1]
        return nn.cond(True, lambda m, c: c + 1, lambda m, c: c - 1, self, h)


def test_linen_lifted_transforms_keep_working_inside_and_around_neutral_calls(installed: None):
    variables = check_init_exact(Lifted(), jnp.ones((2, 3)))
    assert {"CheckpointDense_0", "JitDense_0", "VmapDense_0"} <= set(variables["params"])


def test_stacks_with_the_dag_context(installed: None):
    x = jnp.ones((1, 3))
    variables = Loop().init(jax.random.key(0), x)
    expected = Loop().apply(variables, x)
    with jdag.context():
        assert_trees_close(Loop().init(jax.random.key(0), x), variables)
        assert_trees_close(Loop().apply(variables, x), expected)


def test_stacks_with_the_debug_trace(installed: None):
    x = jnp.ones((1, 3))
    variables = Loop().init(jax.random.key(0), x)
    with jd.trace(log=lambda call: None) as trace:
        Loop().apply(variables, x)
    assert [(c.name, c.impl) for c in trace.calls] == [
        ("lax.fori_loop", "jaxoverride_linen._control.fori_loop")
    ]


def test_context_composes_with_jo_jit_outside(installed: None):
    x = jnp.ones((1, 3))
    variables = Loop().init(jax.random.key(0), x)
    apply = jo.jit(Loop().apply)
    assert_trees_close(apply(variables, x), Loop().apply(variables, x))
