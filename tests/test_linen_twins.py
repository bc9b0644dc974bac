"""Twins of Flax's ``tests/linen/linen_transforms_test.py`` (flax v0.12.7), neutral.

Each test rewrites one test of Flax's file (named in its docstring): the lifted transform
(``nn.jit``, ``nn.remat``, ``nn.vmap``, ``nn.scan``, ``nn.cond``, ``nn.switch``,
``nn.while_loop``, ``nn.grad``, ``nn.value_and_grad``, ``nn.vjp``, ``nn.custom_vjp``) is
replaced by the neutral call (``jo.jit``, ``jo.remat``, ``jo.vmap``, ``jlax.scan``, ...)
inside the module, under ``jaxoverride_linen.context()``, and the result is compared with
the Linen original (run too) or with the original's explicit equivalent (a Python loop).
Each runs inside ``jax.checking_leaks()``.

Not twinned (no neutral counterpart):

* ``test_remat_scan``, ``test_scan_compact_count``, ``test_jit_scan_retracing``,
  ``test_add_metadata_axis``, ``test_vmap_add_remove_axis_transforms``: per-step or
  per-example parameters (``variable_axes={'params': 0}``, ``nn.remat_scan``, axis
  metadata). A neutral loop or ``vmap`` shares the variables of the module that runs it.
* ``test_map_variables_tied_autoencoder``, ``test_map_variables_bit_weights``:
  ``nn.map_variables`` transforms variables, not functions.
* ``test_multiscope_lifting_simple``, ``test_multiscope_lifting_simple_decorator``,
  ``test_multiscope_lifting_argtree``, ``test_multiscope_lifting_argtree_decorator``,
  ``test_multiscope_lifting_simple_decorator_w_jit``, ``test_vmapped_outer_module``,
  ``test_module_transform_with_setup``, ``test_nested_module_args_vmap``,
  ``test_nested_module_args_vmap_2``, ``test_nested_setup_calls_count``,
  ``test_multimethod_setup_calls``, ``test_toplevel_submodule_adoption_transform``,
  ``test_toplevel_submodule_adoption_pytree_transform``,
  ``test_partially_applied_module_constructor_transform``, ``test_partial_module_method``,
  ``test_variable_in_args_transform``, ``test_module_instance_in_args_transform``,
  ``test_module_instance_in_args_transform_nested``, ``test_nested_variable_passing``,
  ``test_returned_module_warning``, ``test_returned_variable_warning``, ``test_nowrap``,
  ``test_transform_with_setup_and_methods_on_submodules``,
  ``test_transform_methods_on_submodules_still_reserve_names``,
  ``test_transform_setup_still_reserve_names``,
  ``test_transform_with_setup_and_methods_on_submodule_pytrees``,
  ``test_transform_setup_still_reserve_names_pytrees``, ``test_scan_of_setup_parameter``,
  ``test_multi_method_class_transform``, ``test_compact_aliasing_collision``,
  ``test_compact_aliasing_collision_arg_and_attrib``, ``test_jit_with_setup_helpers``,
  ``test_lift_instance_error``, ``test_outer_setup_called_with_sharing_across_transforms``,
  ``test_value_and_grad_multiscope_adopted``: transforms of Module *classes* and methods
  (``nn.jit(Module)``, ``nn.vmap(cls, ...)``), modules and variables passed through a
  transform as arguments, and Linen's naming and setup bookkeeping of lifted modules;
  the neutral API transforms functions.
* ``test_jit_repr_hash``, ``test_jit_reuse``, ``test_jit_recursive``,
  ``test_jit_reuse_hash``, ``test_jit_reuse_submodules``, ``test_jit_stateful_submodules``,
  ``test_jit_reuse_nested_submodules``, ``test_jit_hashes_serializable_types``:
  ``nn.jit``'s cache keyed on module hashes; inside a bound module ``jo.jit`` calls its
  function inline (the enclosing computation is what JAX compiles), so there is no
  separate cache to test.
* ``test_remat_kwargs``: skipped in Flax itself.
* ``test_jvp``: its tangent is for the *variables* (``nn.jvp(..., variable_tangents)``);
  ``jo.jvp`` differentiates its explicit arguments only.

Deliberately different (each a test asserting the documented difference):

* ``test_while_loop``: ``nn.while_loop(split_rngs={'params': False})`` draws the same
  ``params`` key every step; a neutral loop advances every stream per step, as a Python
  loop does (there is no ``split_rngs`` selection).
* ``test_custom_vjp``: ``nn.custom_vjp`` differentiates the module's params through the
  rule; ``jo.custom_vjp`` gives gradients for its explicit arguments only, so reading a
  differentiated parameter inside the rule is refused (``ClosedOverDifferentiationError``)
  instead of a silently zero gradient.
* ``test_vjp``: ``nn.vjp`` also returns the cotangent of the module's params; ``jo.vjp``
  returns those of its explicit arguments (the twin compares those, and the params'
  cotangent through ``jo.vjp`` over ``apply``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import copy, freeze
from jax import random

import jaxoverride as jo
import jaxoverride_linen as jol
from jaxoverride import lax as jlax

pytestmark = pytest.mark.usefixtures("linen_context")


@pytest.fixture
def linen_context() -> Any:
    with jol.context(), jax.checking_leaks():
        yield


def _shapes(tree: Any) -> Any:
    return jax.tree.map(jnp.shape, tree)


class MLP(nn.Module):
    """Flax's ``TransformedMLP``, each layer's call under ``transform``."""

    features: Sequence[int]
    transform: Callable[..., Any] = staticmethod(lambda f: f)  # type: ignore[assignment]

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        x = inputs
        for i, feat in enumerate(self.features):
            layer = functools.partial(lambda x, feat, i: nn.Dense(feat, name=f"layers_{i}")(x))
            x = self.transform(functools.partial(layer, feat=feat, i=i))(x)
            if i != len(self.features) - 1:
                x = nn.relu(x)
        return x


def _decorated_mlp(transform: Callable[..., Any]) -> type[nn.Module]:
    """Flax's ``decorated_MLP``: the whole compact body under ``transform``."""

    class Decorated(nn.Module):
        features: Sequence[int]

        @nn.compact
        def __call__(self, inputs: jax.Array) -> jax.Array:
            def body(x: jax.Array) -> jax.Array:
                for i, feat in enumerate(self.features):
                    x = nn.Dense(feat, name=f"layers_{i}")(x)
                    if i != len(self.features) - 1:
                        x = nn.relu(x)
                return x

            return transform(body)(inputs)

    return Decorated


def _check_layerwise(transform: Callable[..., Any]) -> None:
    key1, key2 = random.split(random.key(3), 2)
    x = random.uniform(key1, (4, 4))
    normal, neutral = MLP([3, 4, 5]), MLP([3, 4, 5], transform)
    variables = normal.init(key2, x)
    assert _shapes(neutral.init(key2, x)) == _shapes(variables)
    np.testing.assert_allclose(neutral.apply(variables, x), normal.apply(variables, x), rtol=1e-6)


def _check_decorated(transform: Callable[..., Any]) -> None:
    key1, key2 = random.split(random.key(3), 2)
    x = random.uniform(key1, (4, 4))
    normal, neutral = _decorated_mlp(lambda f: f)([3, 4, 5]), _decorated_mlp(transform)([3, 4, 5])
    variables = normal.init(key2, x)
    assert _shapes(neutral.init(key2, x)) == _shapes(variables)
    np.testing.assert_allclose(neutral.apply(variables, x), normal.apply(variables, x), rtol=1e-6)


# -- jit -------------------------------------------------------------------------------


def test_jit():
    """Twin of TransformTest.test_jit."""
    _check_layerwise(jo.jit)


def test_jit_decorated():
    """Twin of TransformTest.test_jit_decorated."""
    _check_decorated(jo.jit)


def test_jit_init_fn():
    """Twin of TransformTest.test_jit_init_fn: a jitted ``init_with_output`` override."""

    class Foo(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            return nn.Dense(2)(x)

    class Linen(Foo):
        @nn.jit
        def init_with_output(self, rngs: Any, *args: Any, **kwargs: Any) -> Any:
            return super().init_with_output(rngs, *args, **kwargs)

    class Neutral(Foo):
        def init_with_output(self, rngs: Any, *args: Any, **kwargs: Any) -> Any:
            return jo.jit(super().init_with_output)(rngs, *args, **kwargs)

    x = jnp.ones((2, 3))
    y, variables = Neutral().init_with_output(random.key(0), x)
    expected_y, expected = Linen().init_with_output(random.key(0), x)
    jax.tree.map(np.testing.assert_array_equal, (y, variables), (expected_y, expected))


def test_jit_kwargs():
    """Twin of TransformTest.test_jit_kwargs."""

    class Foo(nn.Module):
        def __call__(self, a: jax.Array, b: jax.Array) -> jax.Array:
            return jo.jit(lambda a, b: a + b)(a, b=b)

    y = Foo().apply({}, jnp.array(1.0), b=jnp.array(2.0))
    np.testing.assert_array_equal(y, jnp.array(3.0))


def test_jit_static_argnames():
    """Twin of TransformTest.test_jit_static_argnames."""
    seen = []

    class Foo(nn.Module):
        def __call__(self, a: jax.Array, b: str) -> jax.Array:
            def f(a: jax.Array, b: str) -> jax.Array:
                seen.append(b)
                return a

            return jo.jit(f, static_argnames=["b"])(a, b=b)

    y = Foo().apply({}, jnp.array(1.0), b="hi")
    assert seen == ["hi"]
    np.testing.assert_array_equal(y, jnp.array(1.0))


def test_jit_and_sow():
    """Twin of TransformTest.test_jit_and_sow."""

    class Inner(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            self.sow("intermediates", "loss", jnp.sum(x))
            return x + 1

    class Outer(nn.Module):
        def setup(self) -> None:
            self.inner = Inner()

        def __call__(self, x: jax.Array) -> jax.Array:
            return jo.jit(self.inner)(x)

    x = jnp.ones((2, 2))
    variables = Outer().init(random.key(0), x)
    y, updates = Outer().apply(variables, x, mutable=["intermediates"])
    np.testing.assert_array_equal(updates["intermediates"]["inner"]["loss"], (4.0,))
    np.testing.assert_array_equal(y, 2)


def test_fold_rngs():
    """Twin of TransformTest.test_fold_rngs: a key drawn under ``jo.jit`` is the key the
    same draw gives outside it (as ``nn.jit``'s equals ``nn.fold_rngs``')."""

    class Foo(nn.Module):
        use_jit: bool

        def __call__(self) -> jax.Array:
            draw = lambda: self.make_rng("params")
            return jo.jit(draw)() if self.use_jit else draw()

    key_jit = Foo(True).apply({}, rngs={"params": random.key(0)})
    key_plain = Foo(False).apply({}, rngs={"params": random.key(0)})
    np.testing.assert_array_equal(random.key_data(key_jit), random.key_data(key_plain))


def test_complicated_alias_mutation():
    """Twin of TransformTest.test_complicated_alias_mutation: ``jo.jit`` inside each of
    three nested modules, one of them passed as an attribute and aliased."""

    class C(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            def f(x: jax.Array) -> jax.Array:
                initialized = self.has_variable("muts", "v")
                v = self.variable("muts", "v", lambda: jnp.zeros_like(x))
                if initialized:
                    v.value += x
                return x

            return jo.jit(f)(x)

    class B(nn.Module):
        c: nn.Module

        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            def f(x: jax.Array) -> jax.Array:
                C(name="outer_c")(x)
                return self.c(x)

            return jo.jit(f)(x)

    class A(nn.Module):
        b: nn.Module

        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            return jo.jit(self.b)(x)

    a = A(b=B(c=C()))
    x = jnp.ones((1,), jnp.float32)
    variables = a.init(random.key(0), x)
    _, new = a.apply(variables, x, mutable=["muts"])
    np.testing.assert_array_equal(new["muts"]["b"]["c"]["v"], jnp.array([1.0]))
    np.testing.assert_array_equal(new["muts"]["b"]["outer_c"]["v"], jnp.array([1.0]))


def test_same_key():
    """Twin of TransformTest.test_same_key: keys drawn in a ``jo.jit`` inside a
    ``jlax.scan`` body differ per step and are the same on every init."""

    class Transformer(nn.Module):
        @nn.compact
        def __call__(self) -> jax.Array:
            def block(carry: Any, _: Any) -> Any:
                return carry, random.key_data(jo.jit(lambda: self.make_rng("params"))())

            return jlax.scan(block, None, jnp.arange(10))[1]

    keys = [Transformer().init_with_output(random.key(1))[0] for _ in range(3)]
    for other in keys[1:]:
        np.testing.assert_array_equal(keys[0], other)
    assert len({tuple(np.asarray(k).ravel()) for k in keys[0]}) == 10


# -- remat -----------------------------------------------------------------------------


def test_remat():
    """Twin of TransformTest.test_remat."""
    _check_layerwise(jo.remat)


def test_remat_decorated():
    """Twin of TransformTest.test_remat_decorated."""
    _check_decorated(jo.checkpoint)


@pytest.mark.parametrize("static", [True, False])
def test_remat_static_argnums(static: bool):
    """Twin of TransformTest.test_remat_static_argnums: a static argument arrives as the
    Python value, a traced one as an array, at init and at apply."""
    seen: list[tuple[bool, bool]] = []  # (a Python bool, an array), per call of f

    class Foo(nn.Module):
        @nn.compact
        def __call__(self, inputs: jax.Array, train: bool) -> jax.Array:
            def f(inputs: jax.Array, train: Any) -> jax.Array:
                seen.append((isinstance(train, bool), isinstance(train, jax.Array)))
                return nn.Dense(3, use_bias=False)(inputs)

            numbers = (1,) if static else ()
            return jo.checkpoint(f, static_argnums=numbers)(inputs, train)

    x = jnp.empty((1, 2))
    variables = Foo().init(random.key(0), x, True)
    y = Foo().apply(variables, x, False)
    assert y.shape == (1, 3)
    assert seen and all(
        seen_bool == static and seen_array != static for seen_bool, seen_array in seen
    )


@pytest.mark.parametrize("static", [True, False])
def test_remat_decorator_static_argnums(static: bool):
    """Twin of TransformTest.test_remat_decorator_static_argnums: ``jo.checkpoint`` as a
    decorator (``functools.partial``) with and without ``static_argnums``."""
    seen: list[bool] = []

    class Foo(nn.Module):
        @nn.compact
        def __call__(self, inputs: jax.Array, train: bool) -> jax.Array:
            @functools.partial(jo.checkpoint, static_argnums=(1,) if static else ())
            def f(inputs: jax.Array, train: Any) -> jax.Array:
                seen.append(isinstance(train, bool))
                return nn.Dense(3, use_bias=False)(inputs)

            return f(inputs, train)

    x = jnp.empty((1, 2))
    variables = Foo().init(random.key(0), x, True)
    assert Foo().apply(variables, x, False).shape == (1, 3)
    assert seen and all(python_bool == static for python_bool in seen)


# -- vmap ------------------------------------------------------------------------------


def _check_vmapped(neutral: nn.Module, normal: nn.Module) -> None:
    key1, key2, key3 = random.split(random.key(3), 3)
    x = random.uniform(key1, (4, 4))
    x2 = random.uniform(key2, (5, 4, 4))
    variables = normal.init(key3, x)
    looped = jnp.stack([normal.apply(variables, x2[i]) for i in range(x2.shape[0])])
    np.testing.assert_allclose(neutral.apply(variables, x2), looped, atol=1e-6)


def test_vmap():
    """Twin of TransformTest.test_vmap: each layer under ``jo.vmap``, params shared."""

    _check_vmapped(MLP([3, 4, 5], jo.vmap), MLP([3, 4, 5]))


def test_vmap_decorated():
    """Twin of TransformTest.test_vmap_decorated."""
    _check_vmapped(_decorated_mlp(jo.vmap)([3, 4, 5]), _decorated_mlp(lambda f: f)([3, 4, 5]))


def test_vmap_batchnorm():
    """Twin of TransformTest.test_vmap_batchnorm: BatchNorm's statistics reduced over the
    mapped axis (``axis_name``), shared across the batch."""

    class MlpBn(nn.Module):
        axis_name: Any = None

        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            x = nn.Dense(3)(x)
            return nn.BatchNorm(axis_name=self.axis_name, use_running_average=False)(x)

    class Mapped(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            return jo.vmap(MlpBn(axis_name="batch", name="MlpBn"), axis_name="batch")(x)

    key1, key2, key3 = random.split(random.key(3), 3)
    x = random.uniform(key1, (4, 4))
    x2 = random.uniform(key2, (5, 4, 4))
    variables = MlpBn().init(key3, x)
    y1, stats1 = MlpBn().apply(variables, x2.reshape((-1, 4)), mutable=["batch_stats"])
    wrapped = {col: {"MlpBn": tree} for col, tree in variables.items()}
    y2, stats2 = Mapped().apply(wrapped, x2, mutable=["batch_stats"])
    np.testing.assert_allclose(y1.reshape((5, 4, 3)), y2, atol=1e-5)
    jax.tree.map(
        functools.partial(np.testing.assert_allclose, atol=1e-5),
        stats1["batch_stats"],
        stats2["batch_stats"]["MlpBn"],
    )


# -- scan ------------------------------------------------------------------------------


def _python_lstm(params: Any, carry: Any, xs: jax.Array) -> Any:
    ys = []
    for i in range(xs.shape[0]):
        carry, y = nn.LSTMCell(2).apply(freeze({"params": params}), carry, xs[i])
        ys.append(y)
    return carry, jnp.stack(ys)


def test_scan():
    """Twin of TransformTest.test_scan: an LSTM cell under ``jlax.scan``."""

    class SimpleScan(nn.Module):
        features: int

        @nn.compact
        def __call__(self, c: Any, xs: jax.Array) -> Any:
            cell = nn.LSTMCell(self.features, name="lstm_cell")
            return jlax.scan(cell, c, xs)

    key1, key2 = random.split(random.key(0), 2)
    xs = random.uniform(key1, (5, 3, 2))
    carry = nn.LSTMCell(2).initialize_carry(random.key(0), xs[0].shape)
    variables = SimpleScan(2).init(key2, carry, xs)
    c2, y2 = SimpleScan(2).apply(variables, carry, xs)
    c, y1 = _python_lstm(variables["params"]["lstm_cell"], carry, xs)
    np.testing.assert_allclose(y1, y2, atol=1e-7)
    np.testing.assert_allclose(c[0], c2[0], atol=1e-7)
    np.testing.assert_allclose(c[1], c2[1], atol=1e-7)


def test_scan_decorated():
    """Twin of TransformTest.test_scan_decorated: a broadcast argument closed over."""

    class SimpleScan(nn.Module):
        features: int

        @nn.compact
        def __call__(self, c: Any, b: jax.Array, xs: jax.Array) -> Any:
            def step(c: Any, x: jax.Array) -> Any:
                assert b.shape == (4,)
                return nn.LSTMCell(self.features, name="lstm_cell")(c, x)

            return jlax.scan(step, c, xs)

    key1, key2 = random.split(random.key(0), 2)
    xs = random.uniform(key1, (4, 3, 2))
    b = jnp.ones((4,))
    carry = nn.LSTMCell(2).initialize_carry(random.key(0), xs[0].shape)
    variables = SimpleScan(2).init(key2, carry, b, xs)
    c2, y2 = SimpleScan(2).apply(variables, carry, b, xs)
    c, y1 = _python_lstm(variables["params"]["lstm_cell"], carry, xs)
    np.testing.assert_allclose(y1, y2, atol=1e-7)
    np.testing.assert_allclose(c[0], c2[0], atol=1e-7)


def test_scan_negative_axes():
    """Twin of TransformTest.test_scan_negative_axes: ``in_axes=1, out_axes=-1`` as the
    explicit ``moveaxis`` around ``jlax.scan`` (which scans the leading axis)."""

    class Foo(nn.Module):
        @nn.compact
        def __call__(self, _: Any, x: jax.Array) -> Any:
            return None, nn.Dense(4)(x)

    class Bar(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            _, ys = jlax.scan(Foo(), None, jnp.moveaxis(x, 1, 0))
            return jnp.moveaxis(ys, 0, -1)

    y, variables = Bar().init_with_output(
        {"params": random.key(0)}, random.normal(random.key(1), (1, 2, 3))
    )
    assert y.shape == (1, 4, 2)
    assert _shapes(variables["params"]) == {"Foo_0": {"Dense_0": {"bias": (4,), "kernel": (3, 4)}}}


# -- while_loop, cond, switch ----------------------------------------------------------


def test_while_loop_advances_every_stream_per_step():
    """Twin of TransformTest.test_while_loop, deliberately different: ``nn.while_loop``
    with ``split_rngs={'params': False}`` draws the same ``params`` key every step; the
    neutral loop advances every stream each step, as the Python loop below does (there is
    no ``split_rngs`` selection)."""

    def program(loop: Callable[..., Any]) -> type[nn.Module]:
        class Foo(nn.Module):
            @nn.compact
            def __call__(self, x: int) -> Any:
                zero = jnp.broadcast_to(random.key(0), (2,))
                inc = self.param("inc", lambda _: 1)
                self.put_variable("state", "acc", 0)
                self.put_variable("state", "rng_params", zero)
                self.put_variable("state", "rng_loop", zero)

                def cond_fn(c: Any) -> Any:
                    return self.get_variable("state", "acc") < x

                def body_fn(c: Any) -> Any:
                    i = self.get_variable("state", "acc")
                    for col, stream in (("rng_params", "params"), ("rng_loop", "loop")):
                        keys = self.get_variable("state", col)
                        self.put_variable("state", col, keys.at[i].set(self.make_rng(stream)))
                    self.put_variable("state", "acc", i + inc)
                    return c

                return loop(cond_fn, body_fn, ())

        return Foo

    def python_loop(cond_fn: Any, body_fn: Any, c: Any) -> Any:
        while cond_fn(c):
            c = body_fn(c)
        return c

    rngs = {"params": random.key(1), "loop": random.key(2)}
    _, neutral = program(jlax.while_loop)().apply({}, 2, mutable=True, rngs=rngs)
    _, python = program(python_loop)().apply({}, 2, mutable=True, rngs=rngs)
    assert int(neutral["state"]["acc"]) == 2
    for col in ("rng_params", "rng_loop"):
        keys = random.key_data(neutral["state"][col])
        assert not np.array_equal(keys[0], keys[1])  # nn.while_loop: equal for rng_params
        assert random.key_data(python["state"][col]).shape == keys.shape


def test_while_loop_denylist_split_rngs():
    """Twin of TransformTest.test_while_loop_denylist_split_rngs: a module from ``bind``
    drawing keys in a free function's loop (reads only: it works)."""

    class Foo(nn.Module):
        def setup(self) -> None:
            pass

    f = Foo().bind({}, rngs={"random": random.key(0)})

    def body_fn(carry: jax.Array) -> jax.Array:
        f.make_rng("random")
        return carry + 1

    result = jlax.while_loop(lambda carry: carry < 10, body_fn, jnp.zeros(()))
    np.testing.assert_array_equal(result, jnp.array(10.0))


def _counted_branches(count: int, signs: Sequence[float]) -> type[nn.Module]:
    names = "abc"[:count]

    class Foo(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array, index: Any) -> jax.Array:
            # Linen declares a variable once per call: the branches use the handles.
            counts = {n: self.variable("state", f"{n}_count", lambda: 0) for n in names}

            def branch(name: str, sign: float) -> Callable[[jax.Array], jax.Array]:
                def run(x: jax.Array) -> jax.Array:
                    counts[name].value += 1
                    return sign * nn.Dense(2, name="dense")(x)

                return run

            branches = [branch(n, s) for n, s in zip(names, signs, strict=True)]
            if count == 2:
                return jlax.cond(index, branches[0], branches[1], x)
            return jlax.switch(index, branches, x)

    return Foo


def test_cond():
    """Twin of TransformTest.test_cond: both branches use one ``dense`` and count."""
    foo, x = _counted_branches(2, [1.0, -1.0])(), jnp.ones((1, 3))
    y1, variables = foo.init_with_output(random.key(0), x, True)
    assert variables["state"] == {"a_count": 1, "b_count": 0}
    assert list(variables["params"]) == ["dense"]
    y2, updates = foo.apply(variables, x, False, mutable="state")
    variables = copy(variables, updates)
    assert variables["state"] == {"a_count": 1, "b_count": 1}
    np.testing.assert_allclose(y1, -y2)


def test_switch():
    """Twin of TransformTest.test_switch."""
    foo, x = _counted_branches(3, [1.0, -1.0, 1.0])(), jnp.ones((1, 3))
    y1, variables = foo.init_with_output(random.key(0), x, 0)
    assert variables["state"] == {"a_count": 1, "b_count": 0, "c_count": 0}
    y2, updates = foo.apply(variables, x, 1, mutable="state")
    variables = copy(variables, updates)
    assert variables["state"] == {"a_count": 1, "b_count": 1, "c_count": 0}
    np.testing.assert_allclose(y1, -y2)
    y3, updates = foo.apply(variables, x, 2, mutable="state")
    variables = copy(variables, updates)
    assert variables["state"] == {"a_count": 1, "b_count": 1, "c_count": 1}
    np.testing.assert_allclose(y1, y3)


def test_switch_multihead():
    """Twin of TransformTest.test_switch_multihead: heads from ``setup``."""

    class Foo(nn.Module):
        def setup(self) -> None:
            self.heads = [
                nn.Sequential([nn.Dense(10), nn.Dense(7), nn.Dense(5)]),
                nn.Sequential([nn.Dense(11), nn.Dense(5)]),
                nn.Dense(5),
            ]

        @nn.compact
        def __call__(self, x: jax.Array, index: Any) -> jax.Array:
            # Linen declares a variable once per call: the branches use the handles.
            counts = [self.variable("state", f"{i}_count", lambda: -1) for i in range(3)]

            def head_fn(i: int) -> Callable[[jax.Array], jax.Array]:
                def fn(x: jax.Array) -> jax.Array:
                    counts[i].value += 1
                    return self.heads[i](x)

                return fn

            branches = [head_fn(i) for i in range(len(self.heads))]
            if self.is_mutable_collection("params"):
                for branch in branches:
                    _ = branch(x)
            return jlax.switch(index, branches, x)

    x, foo = jnp.ones((1, 3)), Foo()
    _, variables = foo.init_with_output(random.key(0), x, 0)
    assert variables["state"] == {"0_count": 1, "1_count": 0, "2_count": 0}
    _, updates = foo.apply(variables, x, 1, mutable="state")
    variables = copy(variables, updates)
    assert variables["state"] == {"0_count": 1, "1_count": 1, "2_count": 0}
    _, updates = foo.apply(variables, x, 2, mutable="state")
    variables = copy(variables, updates)
    assert variables["state"] == {"0_count": 1, "1_count": 1, "2_count": 1}
    assert _shapes(variables["params"]) == {
        "heads_0": {
            "layers_0": {"bias": (10,), "kernel": (3, 10)},
            "layers_1": {"bias": (7,), "kernel": (10, 7)},
            "layers_2": {"bias": (5,), "kernel": (7, 5)},
        },
        "heads_1": {
            "layers_0": {"bias": (11,), "kernel": (3, 11)},
            "layers_1": {"bias": (5,), "kernel": (11, 5)},
        },
        "heads_2": {"bias": (5,), "kernel": (3, 5)},
    }


def test_bound_methods_in_direct_transforms():
    """Twin of TransformTest.test_bound_methods_in_direct_transforms: bound methods as
    the branches, under ``jax.jit(init_with_output)``."""

    class CondModel(nn.Module):
        def setup(self) -> None:
            self.dense = nn.Dense(3)

        def f1(self, arr: jax.Array) -> jax.Array:
            return self.dense(arr)

        def f2(self, arr: jax.Array) -> jax.Array:
            _ = self.dense(arr)
            return arr

        def __call__(self, x: jax.Array) -> jax.Array:
            return jlax.cond(x.sum() > 0, self.f1, self.f2, x)

    output, variables = jax.jit(CondModel().init_with_output)(random.key(0), x=jnp.ones(3))
    assert _shapes(variables["params"]) == {"dense": {"bias": (3,), "kernel": (3, 3)}}
    np.testing.assert_allclose(output, CondModel().apply(variables, jnp.ones(3)), rtol=1e-6)


# -- grad, value_and_grad, vjp, custom_vjp ---------------------------------------------


class LearnScale(nn.Module):
    aux: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, y: jax.Array) -> Any:
        p = self.param("scale", nn.initializers.ones_init(), ())
        out = jnp.sum(p * x * y)
        return (out, p) if self.aux else out


def _differentiated(transform: Callable[..., Any], has_aux: bool) -> tuple[Any, Any, Any]:
    """``((x, y), variables, out)``: ``LearnScale`` under ``transform`` in a module, applied."""

    class Foo(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array, y: jax.Array) -> Any:
            return transform(LearnScale(has_aux), argnums=(0, 1), has_aux=has_aux)(x, y)

    x, y = random.uniform(random.key(1), (4,)), random.uniform(random.key(2), (4,))
    variables = Foo().init(random.key(0), x, y)
    return (x, y), variables, Foo().apply(variables, x, y)


@pytest.mark.parametrize("has_aux", [False, True])
def test_grad_simple(has_aux: bool):
    """Twin of TransformTest.test_grad_simple (and, with ``has_aux``, of
    test_grad_simple_with_aux)."""

    (x, y), variables, out = _differentiated(jo.grad, has_aux)
    (x_grad, y_grad), aux = out if has_aux else (out, None)
    np.testing.assert_allclose(x_grad, y, rtol=1e-6)
    np.testing.assert_allclose(y_grad, x, rtol=1e-6)
    if has_aux:
        np.testing.assert_allclose(aux, variables["params"]["LearnScale_0"]["scale"])


@pytest.mark.parametrize("has_aux", [False, True])
def test_value_and_grad_simple(has_aux: bool):
    """Twin of TransformTest.test_value_and_grad_simple (and, with ``has_aux``, of
    test_value_and_grad_simple_with_aux)."""

    (x, y), variables, (value, (x_grad, y_grad)) = _differentiated(jo.value_and_grad, has_aux)
    np.testing.assert_allclose(x_grad, y, rtol=1e-6)
    np.testing.assert_allclose(y_grad, x, rtol=1e-6)
    z = value[0] if has_aux else value
    np.testing.assert_allclose(z, jnp.sum(x * y), rtol=1e-6)
    if has_aux:
        np.testing.assert_allclose(value[1], variables["params"]["LearnScale_0"]["scale"])


def test_value_and_grad_multiscope():
    """Twin of TransformTest.test_value_and_grad_multiscope: a function that creates a
    Dense and calls one passed as an attribute, differentiated by ``jo.value_and_grad``."""

    class Foo(nn.Module):
        bar: nn.Module

        @nn.compact
        def __call__(self, x: jax.Array, y: jax.Array) -> Any:
            def fn(x: jax.Array, y: jax.Array) -> jax.Array:
                qup = nn.Dense(y.shape[-1])
                delta = y - self.bar(qup(x))
                return jnp.sum(delta**2)

            z, (x_grad, y_grad) = jo.value_and_grad(fn, argnums=(0, 1))(x, y)
            return z, x_grad, y_grad

    class Baz(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array, y: jax.Array) -> Any:
            return Foo(bar=nn.Dense(y.shape[-1]))(x, y)

    x, y = random.uniform(random.key(1), (4,)), random.uniform(random.key(2), (4,))
    variables = Baz().init(random.key(0), x, y)
    z, x_grad, y_grad = Baz().apply(variables, x, y)

    def comparison_fn(x: jax.Array, y: jax.Array) -> jax.Array:
        params = variables["params"]
        w1, b1 = params["Foo_0"]["Dense_0"]["kernel"], params["Foo_0"]["Dense_0"]["bias"]
        w2, b2 = params["Dense_0"]["kernel"], params["Dense_0"]["bias"]
        delta = y - ((x @ w1 + b1) @ w2 + b2)
        return jnp.sum(delta**2)

    np.testing.assert_allclose(comparison_fn(x, y), z, rtol=1e-5)
    np.testing.assert_allclose(jax.grad(comparison_fn, 0)(x, y), x_grad, rtol=1e-5)
    np.testing.assert_allclose(jax.grad(comparison_fn, 1)(x, y), y_grad, rtol=1e-5)


class Bar(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array, y: jax.Array) -> jax.Array:
        p = self.param("test", nn.initializers.constant(0.5), ())
        self.variable("state", "counter", lambda: 0)
        return p * x * y


def test_vjp():
    """Twin of TransformTest.test_vjp, deliberately different: ``nn.vjp`` also returns
    the params' cotangent; ``jo.vjp`` those of its explicit arguments, the params' one
    through ``jo.vjp`` over ``apply`` (the explicit equivalent)."""

    class Foo(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array, y: jax.Array) -> Any:
            z, bwd = jo.vjp(Bar(), x, y)
            return bwd(jnp.ones(z.shape))

    x, y = jnp.array([1.0, 2.0, 3.0]), jnp.array([4.0, 5.0, 6.0])
    variables = Foo().init(random.key(0), x, y)
    x_grad, y_grad = Foo().apply(variables, x, y)
    np.testing.assert_allclose(x_grad, [2.0, 2.5, 3.0])
    np.testing.assert_allclose(y_grad, [0.5, 1.0, 1.5])
    state = {"state": variables["state"]["Bar_0"]}
    apply = lambda params: Bar().apply({"params": params, **state}, x, y)
    z, bwd = jo.vjp(apply, variables["params"]["Bar_0"])
    assert float(bwd(jnp.ones(z.shape))[0]["test"]) == 32.0


def test_vjp_tracer_leak():
    """Twin of TransformTest.test_vjp_tracer_leak: no tracer leaks at init or apply."""

    class Scale(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            return self.param("scale", nn.initializers.zeros, ()) * x

    class Foo(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> Any:
            y, bwd = jo.vjp(Scale(), x)
            return y, bwd(jnp.ones(y.shape))

    x = jnp.ones((2, 3))
    variables = Foo().init(random.key(0), x)
    y, (x_grad,) = Foo().apply(variables, x)
    np.testing.assert_array_equal(x_grad, jnp.zeros_like(x))  # the scale is 0
    np.testing.assert_array_equal(y, jnp.zeros_like(x))


def test_custom_vjp_refuses_a_differentiated_param_read_in_the_rule():
    """Twin of TransformTest.test_custom_vjp, deliberately different: ``nn.custom_vjp``
    differentiates the Dense's params through the rule; ``jo.custom_vjp`` gives
    gradients for its explicit arguments only, so the read of a differentiated param in
    the rule is refused (not a silently zero gradient); passed as an argument, the
    params get the rule's sign gradient."""

    def sign_grad(f: Callable[..., Any]) -> Any:
        rule = jo.custom_vjp(f)

        def fwd(*args: Any) -> Any:
            return jo.vjp(f, *args)

        def bwd(vjp_fn: Any, y_t: Any) -> Any:
            return tuple(jax.tree.map(jnp.sign, vjp_fn(y_t)))

        rule.defvjp(fwd, bwd)
        return rule

    class Closed(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            return sign_grad(nn.Dense(1))(x).reshape(())

    class Explicit(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            dense = nn.Dense(1)
            dense(x)  # created; its params go to the rule as an argument
            params = {"params": dense.variables["params"]}
            apply = lambda p, x: nn.Dense(1).apply(p, x)
            return sign_grad(apply)(params, x).reshape(())

    x = jnp.ones((2,))
    variables = Closed().init(random.key(0), x)
    with pytest.raises(jol.ClosedOverDifferentiationError):
        jax.grad(Closed().apply)(variables, x)
    variables = Explicit().init(random.key(0), x)
    grad = jax.grad(Explicit().apply)(variables, x)
    for leaf in jax.tree.leaves(grad):
        assert jnp.all(jnp.abs(leaf) == 1.0)
