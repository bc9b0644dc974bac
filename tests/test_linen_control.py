"""Neutral control flow inside bound Linen modules: init-exact, named as Linen names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import jaxoverride as jo
import jaxoverride_linen as jol
from _linen_models import check_init_exact, shapes
from jaxoverride import lax as jlax

pytestmark = pytest.mark.usefixtures("linen_installed")


class WhileDense(nn.Module):
    """The issue's repro: a neutral while_loop whose body calls an nn.Dense."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        def body(carry: Any) -> Any:
            i, h = carry
            return i + 1, jnp.tanh(nn.Dense(3)(h))

        _, h = jlax.while_loop(lambda c: c[0] < 3, body, (0, x))
        return nn.Dense(2)(h)


def test_the_issue_repro_gives_real_params_eager_and_jitted_and_apply_matches():
    variables = check_init_exact(WhileDense(), jnp.ones((1, 3)))
    # Named as Linen names them outside the loop: the loop's Dense first, created once.
    assert shapes(variables["params"]) == {
        "Dense_0": {"bias": (3,), "kernel": (3, 3)},
        "Dense_1": {"bias": (2,), "kernel": (3, 2)},
    }


def _loop_bodies() -> dict[str, Callable[[jax.Array], jax.Array]]:
    def dense(h: jax.Array) -> jax.Array:
        return jnp.tanh(nn.Dense(3)(h))

    return {
        "scan": lambda x: jlax.scan(lambda c, _: (dense(c), None), x, length=3)[0],
        "scan_xs": lambda x: jlax.scan(lambda c, r: (dense(c) + r, c), x, jnp.ones((2, 3)))[0],
        "fori_loop": lambda x: jlax.fori_loop(0, 3, lambda i, h: dense(h), x),
        "zero_trip_fori": lambda x: jlax.fori_loop(0, 0, lambda i, h: dense(h), x),
        "zero_trip_while": lambda x: jlax.while_loop(lambda h: False, dense, x),
        "cond": lambda x: jlax.cond(x.sum() > 0, dense, lambda h: -dense(h), x),
        "switch": lambda x: jlax.switch(1, [dense, lambda h: 2 * dense(h)], x),
        "map": lambda x: jlax.map(dense, x),
        "nested": lambda x: jlax.scan(
            lambda c, _: (jlax.fori_loop(0, 2, lambda i, h: dense(h), c), None), x, length=2
        )[0],
    }


@pytest.mark.parametrize("name", sorted(_loop_bodies()))
def test_every_control_flow_function_is_init_exact(name: str):
    run = _loop_bodies()[name]

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            return nn.Dense(2)(run(x))

    variables = check_init_exact(Model(), jnp.ones((2, 3)))
    # The branches of cond and switch are alternatives: both create Dense_0 and share
    # it, as nn.cond and a Python if/else do; the Dense after the call is Dense_1.
    assert sorted(variables["params"]) == ["Dense_0", "Dense_1"]


class WithSetup(nn.Module):
    def setup(self) -> None:
        self.layer = nn.Dense(3)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, Any]:
        h = jlax.fori_loop(0, 2, lambda i, h: self.layer(h), x)
        seen = jlax.scan(lambda c, _: (c, shapes(self.variables)), 0, length=1)[1]
        return h, seen


def test_setup_submodules_and_self_variables_work_in_bodies():
    model, x = WithSetup(), jnp.ones((1, 3))
    variables = model.init(jax.random.key(0), x)
    assert sorted(variables["params"]) == ["layer"]
    out, seen = model.apply(variables, x)
    assert out.shape == (1, 3)
    assert seen == {"params": {"layer": {"bias": (3,), "kernel": (3, 3)}}}


def test_a_module_called_in_and_after_the_loop_is_shared():
    class Shared(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            layer = nn.Dense(3)
            h = jlax.fori_loop(0, 2, lambda i, h: layer(h), x)
            return layer(h)

    variables = check_init_exact(Shared(), jnp.ones((1, 3)))
    assert sorted(variables["params"]) == ["Dense_0"]


def test_loops_compile_once_per_identical_call():
    model, x = WhileDense(), jnp.ones((1, 3))
    variables = model.init(jax.random.key(0), x)
    apply = jax.jit(model.apply)
    apply(variables, x)
    with jax.log_compiles(False):
        before = apply._cache_size()
        apply(variables, x + 1)
        assert apply._cache_size() == before


def test_context_gives_the_same_as_install():
    model, x = WhileDense(), jnp.ones((1, 3))
    installed = model.init(jax.random.key(0), x)
    jol.uninstall()
    with jol.context():
        in_context = model.init(jax.random.key(0), x)
    jax.tree.map(lambda a, b: bool(jnp.all(a == b)) or pytest.fail("differ"), installed, in_context)


def test_neutral_calls_outside_modules_are_jax():
    assert jo.current_stack is not None
    out = jlax.fori_loop(0, 3, lambda i, h: h + 1, 0)
    assert int(out) == 3
    assert not jol.in_bound_module()


def test_a_bound_module_runs_its_neutral_loops_outside_init_and_apply():
    model, x = WhileDense(), jnp.ones((1, 3))
    variables = model.init(jax.random.key(0), x)
    bound = model.bind(variables)
    with jax.checking_leaks():
        out = bound(x)
    assert jnp.allclose(out, model.apply(variables, x))


def test_a_sow_in_a_while_loop_body_comes_out_once():
    class SowWhile(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            def body(c: Any) -> Any:
                i, h = c
                h = nn.Dense(3)(h)
                self.sow("intermediates", "h", h)
                return i + 1, h

            return jlax.while_loop(lambda c: c[0] < 2, body, (0, x))[1]

    x = jnp.ones((1, 3))
    variables = SowWhile().init(jax.random.key(0), x)
    with jax.checking_leaks():
        out, state = SowWhile().apply(variables, x, mutable=["intermediates"])
    assert jnp.allclose(state["intermediates"]["h"][0], out)


@pytest.mark.parametrize("batch_size", [None, 2, 5])
def test_a_map_that_only_reads_params_traces_to_jax_lax_map(batch_size: int | None):
    # The kit's map is JAX's: a scan (of vmaps over JAX's split, then the remainder).
    class Mapped(nn.Module):
        @nn.compact
        def __call__(self, xs: jax.Array) -> jax.Array:
            return jlax.map(nn.Dense(3), xs, batch_size=batch_size)

    xs, dense = jnp.ones((5, 3)), nn.Dense(3)
    with jol.context():
        variables = Mapped().init(jax.random.key(0), xs)
        ours = jax.make_jaxpr(Mapped().apply)(variables, xs)

    def raw(v: Any, xs: jax.Array) -> jax.Array:
        params = {"params": v["params"]["Dense_0"]}
        return jax.lax.map(lambda x: dense.apply(params, x), xs, batch_size=batch_size)

    assert str(ours) == str(jax.make_jaxpr(raw)(variables, xs))


@pytest.mark.parametrize(("batch_size", "count"), [(0, 5), (2, 0)])
def test_a_map_splits_as_jax_does_at_the_edges(batch_size: int, count: int):
    # A batch size of 0 and an empty xs: what jax.lax.map gives (an error before the kit's
    # map used JAX's own split).
    class Mapped(nn.Module):
        @nn.compact
        def __call__(self, xs: jax.Array) -> jax.Array:
            return jlax.map(nn.Dense(3), xs, batch_size=batch_size)

    xs, dense = jnp.ones((count, 3)), nn.Dense(3)
    params = {"params": dense.init(jax.random.key(0), jnp.ones((1, 3)))["params"]}
    try:
        raw = jax.lax.map(lambda x: dense.apply(params, x), xs, batch_size=batch_size)
    except Exception as error:  # JAX 0.8 divides by a batch size of 0: so must we
        with jol.context(), pytest.raises(type(error)):
            Mapped().apply({"params": {"Dense_0": params["params"]}}, xs)
        return
    with jol.context():
        variables = Mapped().init(jax.random.key(0), jnp.ones((5, 3)))
        ours = Mapped().apply(variables, xs)
    params = {"params": variables["params"]["Dense_0"]}
    raw = jax.lax.map(lambda x: dense.apply(params, x), xs, batch_size=batch_size)
    assert ours.shape == raw.shape and jnp.allclose(ours, raw)
