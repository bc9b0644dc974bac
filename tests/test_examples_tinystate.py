"""``examples/tinystate.py`` and its adapter ``examples/tinystate_adapter.py``: a framework of
one's own made to work with every neutral function, on public names only, as the
walkthrough of docs/writing-an-adapter.md builds it."""

from __future__ import annotations

import ast
import doctest
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxoverride as jo
from jaxoverride import adapter_kit as kit, errors, lax as jlax

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))

import tinystate as ts  # noqa: E402
import tinystate_adapter  # noqa: E402
from _solve_state_solvers import checking_leaks_linearized  # noqa: E402


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {
        alias.name
        for n in ast.walk(tree)
        if isinstance(n, ast.Import)
        for a in [n]
        for alias in a.names
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_the_framework_needs_only_jax_and_the_adapter_only_public_names():
    assert {n.split(".")[0] for n in _imports(EXAMPLES / "tinystate.py")} <= {
        "__future__", "collections", "threading", "typing", "zlib", "jax",
    }  # fmt: skip
    ours = {n for n in _imports(EXAMPLES / "tinystate_adapter.py") if n.startswith("jaxoverride")}
    assert ours <= {"jaxoverride", "jaxoverride.adapter_kit", "jaxoverride.errors"}, ours


def test_the_adapter_is_small_and_decides_every_name():
    assert len((EXAMPLES / "tinystate_adapter.py").read_text().splitlines()) <= 300
    assert len((EXAMPLES / "tinystate.py").read_text().splitlines()) <= 170
    assert not kit.unhandled_names(tinystate_adapter.TABLE)
    assert set(tinystate_adapter.TABLE.overrides) == set(jo.OVERRIDEABLE)


def test_the_docstring_examples_run():
    for module in (ts, tinystate_adapter):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.attempted and not result.failed, module.__name__


def _model(x):
    """Parameters created inside a scan, a cond, a while_loop and a jit; state and rng per
    step of the scan."""

    def step(h, xi):
        w = ts.param("w", (3, 3), jax.nn.initializers.normal(0.3))
        n = ts.get_state("n", (), jnp.zeros)
        ts.set_state("n", n + 1)
        noise = 0.01 * jax.random.normal(ts.next_key(), h.shape)
        return jnp.tanh(w @ h + xi) + noise, (n, noise)

    h, (counts, noises) = jlax.scan(step, x, jnp.ones((4, 3)))
    scale = lambda h: h * ts.param("a", (), jax.nn.initializers.ones)
    h = jlax.cond(h[0] > 0, scale, lambda h: -h, h)
    h = jo.jit(lambda h: h + ts.param("b", (3,), jax.nn.initializers.zeros))(h)

    def body(carry):
        ts.set_state("m", ts.get_state("m", (), jnp.zeros) + 1)
        return carry[0] + 1, carry[1] * ts.param("s", (), jax.nn.initializers.ones)

    _, h = jlax.while_loop(lambda carry: carry[0] < 3, body, (0, h))
    return h, counts, noises


MODEL = ts.transform(_model)
X = jnp.arange(3.0)
PARAMS = ["a", "b", "s", "w"]


def _zeros(state):
    return jax.tree.map(jnp.zeros_like, state)


def _close(a, b, tol=0.0):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=tol, rtol=0)


def test_init_creates_every_parameter_and_returns_what_apply_returns():
    with jax.checking_leaks(), tinystate_adapter.context():
        out, (params, state) = MODEL.init_with_output(jax.random.key(0), X)
        applied, after = MODEL.apply(params, _zeros(state), jax.random.key(0), X)
    assert sorted(params) == PARAMS
    _close(out, applied)
    assert {k: float(v) for k, v in state.items()} == {"n": 4.0, "m": 3.0}
    assert {k: float(v) for k, v in after.items()} == {"n": 4.0, "m": 3.0}


def test_jitted_init_and_apply_give_the_eager_results():
    with jax.checking_leaks(), tinystate_adapter.context():
        out, (params, state) = MODEL.init_with_output(jax.random.key(0), X)
        jit_out, (jit_params, jit_state) = jax.jit(MODEL.init_with_output)(jax.random.key(0), X)
        applied, after = MODEL.apply(params, state, jax.random.key(1), X)
        jit_applied, jit_after = jax.jit(MODEL.apply)(params, state, jax.random.key(1), X)
    _close((out, params, state), (jit_out, jit_params, jit_state), 1e-6)
    _close((applied, after), (jit_applied, jit_after), 1e-6)


def test_state_and_rng_are_threaded_per_step():
    with jax.checking_leaks(), tinystate_adapter.context():
        params, state = MODEL.init(jax.random.key(0), X)
        (_, counts, noises), after = MODEL.apply(params, state, jax.random.key(7), X)
    # The state entering each step is what the step before left, from the given state.
    assert counts.tolist() == [4.0, 5.0, 6.0, 7.0]
    assert float(after["n"]) == 8.0 and float(after["m"]) == 6.0
    # Each step draws its own key, the one the same draws give outside any loop.
    key, expected = jax.random.key(7), []
    for _ in range(4):
        key, sub = jax.random.split(key)
        expected.append(0.01 * jax.random.normal(sub, (3,)))
    _close(noises, jnp.stack(expected), 1e-7)


def _solve(f, guess):
    return jo.lax.fori_loop(0, 200, lambda _, z: f(z) + z, guess)


def _implicit(x):
    def residual(z):
        return jnp.tanh(ts.param("w", (3, 3), jax.nn.initializers.normal(0.3)) @ z + x) - z

    tangent_solve = lambda g, y: jnp.linalg.solve(jax.jacobian(g)(y), y)
    return jlax.custom_root(residual, jnp.zeros(3), _solve, tangent_solve)


def _unrolled(x):
    w = ts.param("w", (3, 3), jax.nn.initializers.normal(0.3))
    return jo.lax.fori_loop(0, 200, lambda _, z: jnp.tanh(w @ z + x), jnp.zeros(3))


def test_an_implicit_gradient_equals_the_unrolled_one():
    implicit, unrolled = ts.transform(_implicit), ts.transform(_unrolled)

    def loss(model):
        return lambda params: jnp.sum(model.apply(params, {}, None, X)[0] ** 2)

    with jax.checking_leaks(), tinystate_adapter.context():
        params, _ = implicit.init(jax.random.key(3), X)
        assert sorted(params) == ["w"]
        _close(params, unrolled.init(jax.random.key(3), X)[0])
        grads = jax.grad(loss(implicit))(params)
        reference = jax.grad(loss(unrolled))(params)
        jit_grads = jax.jit(jax.grad(loss(implicit)))(params)
    assert float(jnp.max(jnp.abs(reference["w"]))) > 1e-3
    _close(grads, reference, 1e-5)
    _close(jit_grads, reference, 1e-5)


def test_a_write_inside_a_converted_function_is_refused():
    def writes(x):
        def residual(z):
            ts.set_state("n", z[0])
            return z - x

        return jlax.custom_root(residual, jnp.zeros(3), lambda f, g: x, lambda g, y: y)

    model = ts.transform(writes)
    with (
        tinystate_adapter.context(),
        pytest.raises(errors.PureFunctionWriteError, match="set_state"),
    ):
        model.apply({}, {"n": jnp.zeros(())}, None, X)


def test_forgetting_the_adapter_raises_its_own_fix():
    import tinystate_record  # registers tinystate with the missing-adapter check

    def scanned(x):
        return jlax.scan(
            lambda h, _: (h * ts.param("w", (), jax.nn.initializers.ones), None), x, length=2
        )[0]

    with pytest.raises(errors.MissingAdapterError, match=re.escape(tinystate_record.RECORD.fix)):
        ts.transform(scanned).init(jax.random.key(0), X)
    with jax.checking_leaks(), tinystate_adapter.context():  # the fix, as printed, works
        assert sorted(ts.transform(scanned).init(jax.random.key(0), X)[0]) == ["w"]


def test_a_custom_rule_creates_at_init_and_its_rule_is_used():
    @jo.custom_vjp
    def scaled(x):
        return x * ts.param("w", (), jax.nn.initializers.ones)

    scaled.defvjp(lambda x: (scaled(x), None), lambda _, g: (3.0 * g,))

    def f(x):
        return jo.grad(lambda x: jlax.scan(lambda c, _: (scaled(c), None), x, length=2)[0])(x)

    model = ts.transform(f)
    with jax.checking_leaks(), tinystate_adapter.context():
        out, (params, _) = model.init_with_output(jax.random.key(0), 2.0)
        applied, _ = jax.jit(model.apply)(params, {}, None, 2.0)
    assert sorted(params) == ["w"] and float(out) == float(applied) == 9.0


PAGE = (ROOT / "docs" / "writing-an-adapter.md").read_text()


def test_the_walkthrough_lists_every_neutral_name_once_by_kind():
    section = PAGE[PAGE.index("## The three kinds of names") :]
    section = section[: section.index("\n## ", 1)]
    listed = re.findall(r'`"([\w.]+)"`', section)
    assert sorted(listed) == sorted(jo.OVERRIDEABLE)
    assert f"{len(jo.OVERRIDEABLE)} names" in section


def test_the_walkthrough_shows_the_example_files_as_they_are():
    sources = "\n".join(
        (EXAMPLES / name).read_text()
        for name in ("tinystate.py", "tinystate_adapter.py", "tinystate_record.py")
    )
    excerpts = re.findall(r"^```py\n(.*?)^```", PAGE, re.DOTALL | re.MULTILINE)
    assert len(excerpts) >= 6
    for excerpt in excerpts:
        assert excerpt in sources, excerpt


def _step(x):
    """Reads a parameter (created at init), writes state and draws a key."""
    ts.set_state("n", ts.get_state("n", (), jnp.zeros) + 1)
    noise = 0.1 * jax.random.normal(ts.next_key(), jnp.shape(x))
    return x * ts.param("w", (), jax.nn.initializers.normal(1.0)) + noise


def _reads(x):
    """Reads a parameter only: what a function converted into a jaxpr may do."""
    return x * ts.param("w", (), jax.nn.initializers.normal(1.0))


def _custom(kind):
    rule = jo.custom_vjp(_reads) if kind == "vjp" else jo.custom_jvp(_reads)
    if kind == "vjp":
        rule.defvjp(lambda x: (rule(x), None), lambda _, g: (2.0 * g,))
    else:
        rule.defjvp(lambda p, t: (rule(*p), 2.0 * t[0]))
    return rule


_MESH = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
_P = jax.sharding.PartitionSpec
USES = {
    "lax.fori_loop": lambda x: jlax.fori_loop(0, 2, lambda i, h: _step(h), x),
    "lax.switch": lambda x: jlax.switch(1, [lambda h: -h, _step], x),
    "lax.map": lambda x: jlax.map(_step, x),
    "vmap": lambda x: jo.vmap(_step)(x),
    "pmap": lambda x: jo.pmap(_step)(x[None])[0],
    "shard_map": lambda x: jo.shard_map(_step, mesh=_MESH, in_specs=_P(), out_specs=_P())(x),
    "value_and_grad": lambda x: jo.value_and_grad(lambda h: jnp.sum(_step(h)))(x)[1],
    "jacfwd": lambda x: jo.jacfwd(_step)(x),
    "jacrev": lambda x: jo.jacrev(_step)(x),
    "hessian": lambda x: jo.hessian(lambda h: jnp.sum(_step(h) ** 2))(x),
    "jvp": lambda x: jo.jvp(_step, (x,), (jnp.ones_like(x),))[1],
    "vjp": lambda x: jo.vjp(_step, x)[1](jnp.ones_like(x))[0],
    "linearize": lambda x: jo.linearize(_step, x)[1](jnp.ones_like(x)),
    "checkpoint": lambda x: jo.checkpoint(_step)(x),
    "remat": lambda x: jo.remat(_step)(x),
    "eval_shape": lambda x: x + jnp.zeros(jo.eval_shape(_step, x).shape),
    "make_jaxpr": lambda x: x * len(jo.make_jaxpr(_reads)(x).eqns),
    "closure_convert": lambda x: (lambda c: c[0](x, *c[1]))(jo.closure_convert(_reads, x)),
    "lax.custom_linear_solve": lambda x: jlax.custom_linear_solve(_reads, x, lambda m, b: b),
    "custom_jvp": lambda x: jo.grad(lambda h: jnp.sum(_custom("jvp")(h)))(x),
}


@pytest.mark.parametrize("name", sorted(USES))
def test_each_neutral_function_works_inside_the_transform(name):
    model = ts.transform(lambda x: (USES[name](x), ts.get_state("n", (), jnp.zeros)))
    x = jnp.arange(1.0, 3.0)
    with jax.checking_leaks(), tinystate_adapter.context():
        out, (params, state) = model.init_with_output(jax.random.key(0), x)
        applied, _ = model.apply(params, _zeros(state), jax.random.key(0), x)
    assert sorted(params) == ["w"]
    _close(out, applied, 1e-6)


def _dropout_deq(x, declared):
    """A DEQ whose map draws a dropout mask and keeps an EMA of its input, solved by
    plain iteration; ``declared``: inside ``jo.solve_state()``."""
    w = ts.param("w", (3, 3), jax.nn.initializers.normal(0.3))

    def f(z):
        mask = jax.random.bernoulli(ts.next_key(), 0.8, z.shape)
        jax.debug.callback(lambda m: _MASKS.append(np.asarray(m).tobytes()), mask)
        ema = ts.get_state("ema", (3,), jnp.zeros)
        ts.set_state("ema", 0.9 * ema + 0.1 * z)
        return jnp.tanh(w @ jnp.where(mask, z, 0.0) + x)

    def body(carry):
        z, _, i = carry
        fz = f(z)
        return fz, jnp.max(jnp.abs(fz - z)), i + 1

    def solve():
        init = (jnp.zeros(3), jnp.float32(jnp.inf), 0)
        return jo.lax.while_loop(lambda c: (c[1] > 1e-6) & (c[2] < 100), body, init)

    if not declared:
        return solve()
    with jo.solve_state():
        return solve()


_MASKS: list = []


@pytest.mark.parametrize("declared", [True, False], ids=["declared", "undeclared"])
def test_a_declared_solve_draws_one_mask_and_updates_the_state_once(declared):
    """The third-party adapter gets ``solve_state`` from its state description alone
    (``Source.framework``, ``Source.parts`` and ``register_solve_source``)."""
    model = ts.transform(lambda x: _dropout_deq(x, declared))
    with jax.checking_leaks(), tinystate_adapter.context():
        params, state = model.init(jax.random.key(0), X)
        _MASKS.clear()
        (z, _, steps), after = jax.jit(model.apply)(params, state, jax.random.key(1), X)
        jax.effects_barrier()
        masks = set(_MASKS)
        _MASKS.clear()
        model.apply(params, state, jax.random.key(2), X)
        jax.effects_barrier()
    if not declared:
        assert len(masks) > 5  # a new mask at every evaluation: no fixed point
        assert int(steps) == 100
        return
    assert len(masks) == 1
    assert masks.isdisjoint(_MASKS)  # the next forward call (another rng) gets another mask
    # One EMA update at the solution, from the entry value.
    _close(after["ema"], 0.9 * state["ema"] + 0.1 * z, 1e-6)
    # At init the entry is created inside the solve, from zeros: one update too, at the
    # solution init reached (apply with init's rng draws init's mask).
    with tinystate_adapter.context():
        (z_init, _, _), _ = model.apply(params, state, jax.random.key(0), X)
    _close(state["ema"], 0.1 * z_init, 1e-6)
    assert int(steps) < 100


def _dropout_root(x):
    """A DEQ with a dropout mask in its map, solved by ``custom_root`` (implicit)."""
    w = ts.param("w", (3, 3), jax.nn.initializers.normal(0.3))

    def residual(z):
        mask = jax.random.bernoulli(ts.next_key(), 0.8, z.shape)
        jax.debug.callback(lambda m: _MASKS.append(np.asarray(m).tobytes()), mask)
        return jnp.tanh(w @ jnp.where(mask, z, 0.0) + x) - z

    tangent_solve = lambda g, y: jnp.linalg.solve(jax.jacobian(g)(y), y)
    with jo.solve_state():
        return jlax.custom_root(residual, jnp.zeros(3), _solve, tangent_solve)


def test_a_declared_implicit_solve_draws_one_mask_and_its_gradient_is_the_unrolled_one():
    """What a converted map refuses outside a declaration runs under it: one mask for
    the forward solve and the implicit gradient's linearisation."""
    model = ts.transform(_dropout_root)
    with checking_leaks_linearized(), tinystate_adapter.context():
        params, state = model.init(jax.random.key(0), X)
        _MASKS.clear()
        loss = lambda p: jnp.sum(model.apply(p, state, jax.random.key(1), X)[0] ** 2)
        grads = jax.jit(jax.grad(loss))(params)
        jax.effects_barrier()
    assert len(set(_MASKS)) == 1
    _, sub = jax.random.split(jax.random.key(1))
    mask = jax.random.bernoulli(sub, 0.8, (3,))

    def unrolled(p):
        step = lambda _, z: jnp.tanh(p["w"] @ jnp.where(mask, z, 0.0) + X)
        return jnp.sum(jax.lax.fori_loop(0, 200, step, jnp.zeros(3)) ** 2)

    _close(grads, jax.grad(unrolled)(params), 1e-5)
