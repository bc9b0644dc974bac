"""Linen adapter: mapped transforms over devices, ``sow`` under transforms, primitive
rules that run apart from the module's trace, and Flax left unpatched until used.

* ``jo.pmap`` and ``jo.shard_map`` (and a ``jax.sharding`` placement) whose function
  calls a Linen submodule: init creates the parameters once, under Linen's names, and
  apply equals the same map written on the explicit parameters;
* a ``sow`` inside ``jo.vmap`` comes out stacked along the mapped axis (as ``nn.vmap``'s
  with ``variable_axes={"intermediates": 0}``), inside ``jo.grad``/``value_and_grad``
  as the primal's value (as ``nn.value_and_grad``'s);
* a JAX primitive whose abstract evaluation and JVP rule call neutral functions (as
  lineax's ``linear_solve`` does) runs inside a bound module, under ``jax.jit(init)`` and
  ``jax.grad``: those rules run under a trace that cannot see the module's values, and
  the neutral calls there are JAX's own;
* importing the adapter leaves Flax's ``Scope`` methods as they were; ``context()`` and
  ``install()`` patch them while in use and put the very same objects back (fresh
  interpreters).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive
from jax.interpreters import ad, mlir
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxoverride as jo
import jaxoverride_linen as jol
from jaxoverride import lax as jlax

DEVICES = 8
RNG = jax.random.PRNGKey(0)


def _close(a: Any, b: Any, tol: float = 1e-5) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b), (a, b)
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=tol, atol=tol), a, b)


def _no_tracers(tree: Any) -> None:
    assert not any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(tree))


def _explicit_dense(params: Any, h: jax.Array) -> jax.Array:
    return jnp.tanh(h @ params["kernel"] + params["bias"])


# -- pmap, shard_map and jax.sharding ------------------------------------------------------


class Pmapped(nn.Module):
    """A ``jo.pmap`` over devices whose function calls an ``nn.Dense``."""

    @nn.compact
    def __call__(self, xs: jax.Array) -> jax.Array:
        dense = nn.Dense(3)
        return jo.pmap(lambda x: jnp.tanh(dense(x)), axis_name="devices")(xs)


class ShardMapped(nn.Module):
    """A ``jo.shard_map`` over the ``"data"`` axis whose function calls an ``nn.Dense``."""

    mesh: Any

    @nn.compact
    def __call__(self, xs: jax.Array) -> jax.Array:
        dense = nn.Dense(3)
        block = lambda x: jnp.tanh(dense(x))
        return jo.shard_map(block, mesh=self.mesh, in_specs=P("data"), out_specs=P("data"))(xs)


def _inputs() -> jax.Array:
    return jnp.linspace(-1.0, 1.0, DEVICES * 2 * 4).reshape(DEVICES, 2, 4)


def _direct_params(xs: jax.Array) -> Any:
    """What Linen's own ``nn.Dense`` creates on one slice: the names and shapes expected."""
    return jax.tree.map(jnp.shape, {"params": {"Dense_0": nn.Dense(3).init(RNG, xs[0])["params"]}})


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_pmap_of_a_linen_submodule_equals_the_explicit_pmap(jitted: bool):
    xs = _inputs()
    model = Pmapped()
    with jol.context():
        with jax.checking_leaks():
            variables = model.init(RNG, xs)
            out = model.apply(variables, xs)
        jit_variables = jax.jit(model.init)(RNG, xs)
        jit_out = jax.jit(model.apply)(variables, xs)
    assert jax.tree.map(jnp.shape, variables) == _direct_params(xs)
    _no_tracers((variables, jit_variables, out, jit_out))
    _close(jit_variables, variables, 1e-6)
    params = variables["params"]["Dense_0"]
    expected = jax.pmap(lambda x: _explicit_dense(params, x))(xs)
    _close(out, expected)
    _close(jit_out, expected)
    # The gradient through the map w.r.t. the parameters, as the explicit one.
    loss = lambda v: jnp.sum(model.apply(v, xs) ** 2)
    with jol.context():
        grads = (jax.jit(jax.grad(loss)) if jitted else jax.grad(loss))(variables)
    explicit_loss = lambda p: jnp.sum(jax.pmap(lambda x: _explicit_dense(p, x))(xs) ** 2)
    _close(grads["params"]["Dense_0"], jax.grad(explicit_loss)(params), 1e-4)


def test_pmap_init_with_output_returns_what_apply_returns():
    xs = _inputs()
    with jol.context(), jax.checking_leaks():
        out, variables = Pmapped().init_with_output(RNG, xs)
        _close(out, Pmapped().apply(variables, xs), 1e-6)


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_shard_map_of_a_linen_submodule_equals_the_explicit_shard_map(mesh, jitted: bool):
    xs = _inputs().reshape(DEVICES * 2, 4)
    model = ShardMapped(mesh)
    with jol.context():
        with jax.checking_leaks():
            variables = model.init(RNG, xs)
            out = model.apply(variables, xs)
            init_out, _ = model.init_with_output(RNG, xs)
        jit_variables = jax.jit(model.init)(RNG, xs)
        jit_out = jax.jit(model.apply)(variables, xs)
    assert jax.tree.map(jnp.shape, variables) == _direct_params(xs)
    _no_tracers((variables, jit_variables, out, jit_out))
    _close(jit_variables, variables, 1e-6)
    _close(init_out, out, 1e-6)
    params = variables["params"]["Dense_0"]
    explicit = jax.shard_map(
        lambda x: _explicit_dense(params, x), mesh=mesh, in_specs=P("data"), out_specs=P("data")
    )
    _close(out, explicit(xs))
    _close(jit_out, explicit(xs))
    loss = lambda v: jnp.sum(model.apply(v, xs) ** 2)
    with jol.context():
        grads = (jax.jit(jax.grad(loss)) if jitted else jax.grad(loss))(variables)
    explicit_loss = lambda p: jnp.sum(
        jax.shard_map(
            lambda x: _explicit_dense(p, x), mesh=mesh, in_specs=P("data"), out_specs=P("data")
        )(xs)
        ** 2
    )
    _close(grads["params"]["Dense_0"], jax.grad(explicit_loss)(params), 1e-4)


def test_a_sharded_batch_through_a_linen_while_loop_keeps_its_sharding(mesh):
    """``jax.sharding``: a batch placed over the 8 devices, through a jitted apply whose
    neutral loop calls a submodule; the output keeps the batch sharding and equals the
    explicit loop."""

    class Looped(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            dense = nn.Dense(4)
            return jlax.fori_loop(0, 3, lambda i, h: jnp.tanh(dense(h)), x)

    sharding = NamedSharding(mesh, P("data"))
    xs = jax.device_put(jnp.linspace(-1.0, 1.0, DEVICES * 4).reshape(DEVICES, 4), sharding)
    model = Looped()
    with jol.context():
        variables = jax.jit(model.init)(RNG, xs)
        out = jax.jit(model.apply, out_shardings=sharding)(variables, xs)
    params = variables["params"]["Dense_0"]
    expected = jax.lax.fori_loop(0, 3, lambda i, h: _explicit_dense(params, h), xs)
    _close(out, expected)
    assert out.sharding.is_equivalent_to(sharding, out.ndim)


# -- sow under transforms ------------------------------------------------------------------


class Sowing(nn.Module):
    """Sows its layer's output, and returns a scalar (to be differentiated)."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        y = nn.Dense(2)(x)
        self.sow("intermediates", "y", y)
        return jnp.sum(jnp.tanh(y) ** 2)


class NeutralVmap(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return jo.vmap(Sowing(name="inner"))(x)


class LinenVmap(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        mapped = nn.vmap(
            Sowing,
            variable_axes={"params": None, "intermediates": 0},
            split_rngs={"params": False},
        )
        return mapped(name="inner")(x)


class NeutralGrad(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> Any:
        return jo.value_and_grad(Sowing(name="inner"))(x)


class LinenGrad(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> Any:
        return nn.value_and_grad(lambda module, x: module(x), Sowing(name="inner"), x)


SOWS = {"vmap": (NeutralVmap, LinenVmap), "value_and_grad": (NeutralGrad, LinenGrad)}


@pytest.mark.parametrize("transform", sorted(SOWS))
@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_sow_under_a_neutral_transform_comes_out_as_linen_lifted_one(transform, jitted):
    """The sown value, its place and its shape are those of Linen's lifted transform
    (``nn.vmap`` stacking ``intermediates`` along axis 0, ``nn.value_and_grad`` keeping
    the primal's value); so are the outputs."""
    neutral, linen = SOWS[transform]
    x = jnp.linspace(-1.0, 1.0, 6).reshape(3, 2)
    variables = linen().init(RNG, x)
    expected, expected_state = linen().apply(variables, x, mutable=["intermediates"])
    apply = lambda v: neutral().apply(v, x, mutable=["intermediates"])
    with jol.context():
        assert jax.tree.map(jnp.shape, neutral().init(RNG, x)) == jax.tree.map(jnp.shape, variables)
        with jax.checking_leaks():
            out, state = (jax.jit(apply) if jitted else apply)(variables)
    _no_tracers((out, state))
    assert jax.tree.map(jnp.shape, state) == jax.tree.map(jnp.shape, expected_state)
    _close(state, expected_state)
    if transform == "value_and_grad":
        expected = (expected[0], expected[1][0])  # nn.value_and_grad: a tuple of gradients
    _close(out, expected)


def test_sow_under_vmap_is_sown_once_per_call_and_absent_when_not_mutable():
    x = jnp.ones((3, 2))
    with jol.context():
        variables = NeutralVmap().init(RNG, x)
        assert set(variables) == {"params"}  # init leaves intermediates out, as Linen's
        _, state = NeutralVmap().apply(variables, x, mutable=["intermediates"])
        assert len(state["intermediates"]["inner"]["y"]) == 1
        out = NeutralVmap().apply(variables, x)  # not mutable: sow does nothing
    _close(out, LinenVmap().apply(variables, x))


def test_sow_in_a_loop_by_a_submodule_made_before_the_loop_comes_out():
    """The sowing submodule's scope exists before the loop, so it caches its collection
    dict across the adapter's traces: the value sown in the last iteration comes out (it
    came out as the slot's zero placeholder before)."""

    class Looped(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            inner = SowingLayer(name="inner")
            return jlax.fori_loop(0, 2, lambda i, h: inner(h), x)

    x = jnp.linspace(-1.0, 1.0, 6).reshape(3, 2)
    with jol.context():
        variables = Looped().init(RNG, x)
        with jax.checking_leaks():
            out, state = Looped().apply(variables, x, mutable=["intermediates"])
        jit_out, jit_state = jax.jit(lambda v: Looped().apply(v, x, mutable=["intermediates"]))(
            variables
        )
    params = variables["params"]["inner"]["Dense_0"]
    first = jnp.tanh(x @ params["kernel"] + params["bias"])
    last = first @ params["kernel"] + params["bias"]
    _close(state, {"intermediates": {"inner": {"y": (last,)}}})
    _close(jit_state, state)
    _close(out, jnp.tanh(last))
    _close(jit_out, out)


class SowingLayer(nn.Module):
    """Sows its layer's pre-activation and returns the activation."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        y = nn.Dense(2)(x)
        self.sow("intermediates", "y", y)
        return jnp.tanh(y)


def test_sow_into_a_value_sown_before_the_transform_is_refused_as_in_a_loop():
    """Deliberate difference from ``nn.value_and_grad``, which appends: the threaded
    state keeps its structure across a transform, as across a loop body."""

    class SownTwice(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> Any:
            inner = Sowing(name="inner")
            inner(x)
            return jo.value_and_grad(inner)(x)

    x = jnp.ones((3, 2))
    with jol.context():
        variables = SownTwice().init(RNG, x)
        with pytest.raises(ValueError, match="changed the structure of the state"):
            SownTwice().apply(variables, x, mutable=["intermediates"])
        out = SownTwice().apply(variables, x)  # a read-only apply is unaffected
    assert np.isfinite(np.asarray(out[0]))


# -- nnx.bridge.ToLinen at init, unrolled ---------------------------------------------------


def test_to_linen_init_inside_an_unrolled_neutral_solver():
    """``nnx.bridge.ToLinen`` re-creates its NNX module (drawing keys, writing its params) on
    every call at init; a threaded loop carries those draws and writes, so init through
    the solver's non-implicit mode creates the wrapper's parameters once, under Linen's
    name, and apply then equals the explicit solve (the implicit mode: see the xfail in
    tests/test_linen_bridge.py)."""
    from flax import nnx

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from fpsolve import fixed_point

    n = 4
    x = jnp.linspace(-1.0, 1.0, n)

    def linear() -> nn.Module:
        kwargs = {"kernel_init": nnx.initializers.normal(0.3)}
        return nnx.bridge.ToLinen(nnx.Linear, args=(n, n), kwargs=kwargs, name="cell")

    class ToLinenSolver(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            layer = linear()
            f = lambda z, x: jnp.tanh(layer(z) + x)
            return fixed_point(f, jnp.zeros(n), x, method="forward", implicit=False).value

    with jol.context():
        with jax.checking_leaks():
            variables = ToLinenSolver().init(RNG, x)
            out = ToLinenSolver().apply(variables, x)
        jit_variables = jax.jit(ToLinenSolver().init)(RNG, x)
    assert jax.tree.map(jnp.shape, variables) == {
        "params": {"cell": {"bias": (n,), "kernel": (n, n)}}
    }
    _no_tracers((variables, jit_variables, out))
    _close(jit_variables, variables, 1e-6)
    p = variables["params"]["cell"]
    expected = fixed_point(
        lambda z, x: jnp.tanh(z @ p["kernel"] + p["bias"] + x), jnp.zeros(n), x, method="forward"
    ).value
    _close(out, expected)


# -- primitive rules that run apart from the module's trace --------------------------------


def _halvings(x: jax.Array) -> jax.Array:
    """A neutral loop with no Linen in it, as a solver's implementation."""
    return jlax.while_loop(lambda c: c[1] < 3, lambda c: (0.5 * c[0], c[1] + 1), (x, 0))[0]


def _solve_primitive() -> Primitive:
    """A primitive built as lineax's ``linear_solve``: its abstract evaluation calls
    ``eval_shape`` and its JVP rule binds it again on primal values."""
    prim = Primitive("jaxoverride_linen_test_halvings")
    prim.def_impl(_halvings)

    def abstract_eval(aval: Any) -> Any:
        shape = jo.eval_shape(_halvings, jax.ShapeDtypeStruct(aval.shape, aval.dtype))
        return jax.core.ShapedArray(shape.shape, shape.dtype)

    prim.def_abstract_eval(abstract_eval)
    ad.primitive_jvps[prim] = lambda primals, tangents: (
        prim.bind(*primals),
        0.125 * (tangents[0] if type(tangents[0]) is not ad.Zero else jnp.zeros_like(primals[0])),
    )
    mlir.register_lowering(prim, mlir.lower_fun(_halvings, multiple_results=False))
    return prim


HALVINGS = _solve_primitive()


class WithPrimitive(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dense = nn.Dense(3)
        h = HALVINGS.bind(dense(x))
        return jlax.fori_loop(0, 2, lambda i, z: jnp.tanh(dense(z) + h), x)


def test_primitive_rules_inside_a_bound_module_run_as_jax():
    """``jax.jit(model.init)`` runs the abstract evaluation under JAX's eval trace while the
    module's rng key is a jit tracer; ``jax.grad`` runs the JVP rule's primal bind apart
    from the linearize trace that holds the parameters. Both neutral calls there are
    JAX's own, and the results equal the explicit program."""
    x = jnp.linspace(-1.0, 1.0, 3)
    model = WithPrimitive()
    with jol.context():
        with jax.checking_leaks():
            variables = model.init(RNG, x)
        jit_variables = jax.jit(model.init)(RNG, x)
        out = model.apply(variables, x)
        loss = lambda v: jnp.sum(model.apply(v, x) ** 2)
        with jax.checking_leaks():
            grads = jax.grad(loss)(variables)
        jit_grads = jax.jit(jax.grad(loss))(variables)
    _no_tracers((variables, jit_variables, grads, jit_grads))
    _close(jit_variables, variables, 1e-6)

    def explicit(p: Any) -> jax.Array:
        dense = lambda z: z @ p["kernel"] + p["bias"]
        h = 0.125 * dense(x)
        return jax.lax.fori_loop(0, 2, lambda i, z: jnp.tanh(dense(z) + h), x)

    params = variables["params"]["Dense_0"]
    _close(out, explicit(params))
    expected = jax.grad(lambda p: jnp.sum(explicit(p) ** 2))(params)
    _close(grads["params"]["Dense_0"], expected, 1e-5)
    _close(jit_grads["params"]["Dense_0"], expected, 1e-5)


class JitInCustomVjp(nn.Module):
    """jaxopt's shape with ``implicit_diff=True``: a ``custom_vjp`` whose primal function
    calls a neutral ``jit`` of a map that calls a submodule and writes a counter."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dense = nn.Dense(3)
        calls = self.variable("counters", "calls", lambda: jnp.zeros((), jnp.int32))

        def step(z: jax.Array) -> jax.Array:
            calls.value += 1
            return jnp.tanh(dense(z) + x)

        @jo.custom_vjp
        def solve(z: jax.Array) -> jax.Array:
            return jo.jit(step)(jo.jit(step)(z))

        solve.defvjp(lambda z: (solve(z), None), lambda _, g: (g,))
        return solve(jnp.zeros(3))


def test_a_neutral_jit_in_a_custom_vjp_primal_threads_the_module_under_jit_init():
    """JAX traces a ``custom_vjp``'s primal function under a fresh trace, which the trace
    of ``jax.jit(model.init)`` (holding the scope's parameters) is not a parent of; reads
    there see the rule's own argument, so the module is not detached: the ``jit`` inside
    threads the counter (no leaked tracer) and init, eager or jitted, counts both calls."""
    x = jnp.linspace(-1.0, 1.0, 3)
    model = JitInCustomVjp()
    with jol.context():
        with jax.checking_leaks():
            variables = model.init(RNG, x)
            out, after = model.apply(variables, x, mutable=["counters"])
        jit_variables = jax.jit(model.init)(RNG, x)
        jit_out, jit_after = jax.jit(lambda v: model.apply(v, x, mutable=["counters"]))(variables)
    _no_tracers((variables, jit_variables, jit_out, jit_after))
    _close(jit_variables, variables, 1e-6)
    assert int(variables["counters"]["calls"]) == int(jit_variables["counters"]["calls"]) == 2
    assert int(after["counters"]["calls"]) == int(jit_after["counters"]["calls"]) == 4
    p = variables["params"]["Dense_0"]
    expected = jnp.zeros(3)
    for _ in range(2):
        expected = jnp.tanh(expected @ p["kernel"] + p["bias"] + x)
    _close(out, expected)
    _close(jit_out, expected)


# -- Flax unpatched until the adapter is used (fresh interpreters) -------------------------

PATCH_CHECK = """
from flax.core.scope import Scope
NAMES = ("make_rng", "variable", "put_variable", "get_variable")
flax_own = {name: Scope.__dict__[name] for name in NAMES}

def same():
    return all(Scope.__dict__[name] is flax_own[name] for name in NAMES)

def patched():
    return all(Scope.__dict__[name] is not flax_own[name] for name in NAMES)

import jax, jax.numpy as jnp, flax.linen as nn
import jaxoverride as jo, jaxoverride_linen as jol
assert same(), "importing the adapter patched Flax"

class Loop(nn.Module):
    @nn.compact
    def __call__(self, x):
        dense = nn.Dense(2)
        step = lambda i, h: dense(h) + jax.random.normal(self.make_rng("noise"))
        return jo.lax.fori_loop(0, 2, step, x)

rngs = {"params": jax.random.key(0), "noise": jax.random.key(1)}
x = jnp.ones(2)
"""

PATCH_CASES = {
    "import_only": "nn.Dense(2).init(jax.random.key(0), x)\nassert same()",
    "context": """
with jol.context():
    assert patched()
    with jol.context():
        variables = Loop().init(rngs, x)
    assert patched()
assert same()
""",
    "context_exception": """
try:
    with jol.context():
        assert patched()
        raise KeyError("boom")
except KeyError:
    pass
assert same()
""",
    "install": """
jol.install()
jol.install()  # the same installation: one more install patches nothing more
assert patched()
Loop().init(rngs, x)
jol.uninstall()
assert same()
assert not jol.uninstall()
assert same()
""",
    "install_and_context": """
handle = jol.install()
with jol.context():
    assert patched()
assert patched()  # install() still uses it
jol.uninstall()
assert same()
""",
    "handle_uninstall": """
handle = jol.install()
handle.uninstall()  # through the core's handle, not jol.uninstall()
jol.install()
jol.uninstall()
assert same()
""",
    "copied_mapping": """
try:
    with jo.override_context({**jol.context()}):
        Loop().init(rngs, x)
except jol.LinenStateError as error:
    assert "jaxoverride_linen.context() itself" in str(error), error
else:
    raise AssertionError("the copied layer ran unprepared")
assert same()
""",
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(PATCH_CASES))
def test_flax_scope_methods_are_patched_only_while_the_adapter_is_in_use(case: str):
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(root / "src"), str(root / "adapters"), env.get("PYTHONPATH", "")]
    )
    env.pop("XLA_FLAGS", None)
    program = PATCH_CHECK + textwrap.dedent(PATCH_CASES[case]) + "\nprint('ok')\n"
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")
