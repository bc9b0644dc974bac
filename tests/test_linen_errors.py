"""Bad input inside bound Linen modules: clear errors that leave everything as it was."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import errors as flax_errors

import jaxoverride as jo
import jaxoverride_linen as jol
from _linen_models import leaves_are_arrays
from jaxoverride import lax as jlax
from jaxoverride.errors import JaxoverrideError

pytestmark = pytest.mark.usefixtures("linen_installed")


def test_a_closure_over_an_unbound_module_raises_linens_error():
    unbound = nn.Dense(3)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            return jlax.fori_loop(0, 2, lambda i, h: unbound(h), x)

    with jax.checking_leaks(), pytest.raises(flax_errors.CallCompactUnboundModuleError):
        Model().init(jax.random.key(0), jnp.ones((1, 3)))
    assert unbound.scope is None


class Counter(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        count = self.variable("counts", "n", lambda: jnp.zeros((), jnp.int32))
        count.value = count.value + 1
        return x


def test_writing_a_module_bound_to_another_scope_is_a_clear_error():
    x = jnp.ones((1, 3))
    counter_vars = Counter().init(jax.random.key(0), x)
    foreign = Counter().bind(counter_vars, mutable=["counts"])

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            return jlax.fori_loop(0, 2, lambda i, h: foreign(nn.Dense(3)(h)), x)

    with jax.checking_leaks(), pytest.raises(jol.LinenStateError, match="bound to a scope"):
        Model().init(jax.random.key(0), x)
    assert isinstance(jol.LinenStateError("x"), JaxoverrideError)
    # No tracer reached the foreign module (init's eager creation pass did write it once).
    assert leaves_are_arrays(foreign.variables)


def test_reading_a_module_bound_to_another_scope_works():
    x = jnp.ones((1, 3))
    dense = nn.Dense(3)
    other = dense.bind(dense.init(jax.random.key(1), x))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            return jlax.fori_loop(0, 2, lambda i, h: other(h), x)

    out = Model().apply({}, x)
    assert out.shape == (1, 3)


def test_parameters_created_only_when_traced_are_a_clear_error_and_restore_the_scope():
    class Sneaky(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> Any:
            def body(h: jax.Array, _: Any) -> Any:
                if isinstance(h, jax.core.Tracer):
                    h = nn.Dense(3, name="late")(h)
                return h, None

            return jlax.scan(body, x, length=2)[0]

    with jax.checking_leaks(), pytest.raises(jol.LinenStateError, match="params/late"):
        Sneaky().init(jax.random.key(0), jnp.ones((1, 3)))


def test_an_exception_in_a_body_leaves_the_variables_and_names_as_they_were():
    seen: dict[str, Any] = {}

    class Failing(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            norm = nn.BatchNorm(use_running_average=False)
            x = norm(x)
            before = jax.tree.map(lambda a: a, self.variables["batch_stats"])

            def body(i: Any, h: jax.Array) -> jax.Array:
                h = norm(nn.Dense(3)(h))
                if isinstance(h, jax.core.Tracer):
                    raise KeyError("boom")
                return h

            with pytest.raises(KeyError, match="boom"):
                jlax.fori_loop(0, 2, body, x)
            seen["same"] = jax.tree.map(lambda a, b: a is b, before, self.variables["batch_stats"])
            return x

    with jax.checking_leaks():
        variables = Failing().init(jax.random.key(0), jnp.ones((2, 3)))
    assert all(jax.tree.leaves(seen["same"]))
    assert leaves_are_arrays(variables)
    # The Dense of the failed loop, made by init's creation pass, was removed again.
    assert sorted(variables["params"]) == ["BatchNorm_0"]


def test_jo_jit_is_unaffected_by_a_failed_call():
    assert jo.jit(lambda x: x + 1)(1) == 2
