"""Implicit differentiation under ``jaxoverride_nnx.track``.

The implicit-layers solver (``_implicit_solver``) runs unchanged on a closure-captured
module: ``jo.grad`` w.r.t. the module equals backpropagation through the unrolled loop,
eager and under ``jo.jit``, and is never stale after the weights change. A custom rule's
primal function may write tracked state (written back once per call); a write inside a
closure-converted function is refused.
"""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import _implicit_solver as solver
import jaxoverride as jo
import jaxoverride_nnx
from _nnx_models import identity_with_jvp
from jaxoverride import lax as jlax
from jaxoverride_nnx import ClosedOverDifferentiationError, PureFunctionWriteError

X = jnp.linspace(-1.0, 1.0, 4)


class DEQ(nnx.Module):
    def __init__(self, solve):
        self.layer = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
        self.layer.kernel[...] *= 0.3
        self.solve = solve

    def __call__(self, x):
        return jnp.sum(self.solve(lambda z, x: jnp.tanh(self.layer(z) + x), jnp.zeros(4), x) ** 2)


def _gradient(model, jit):
    grad = lambda: jo.grad(lambda m: m(X))(model)
    with jaxoverride_nnx.track(model):
        return jo.jit(grad)() if jit else grad()


@pytest.mark.parametrize("jit", [False, True], ids=["grad", "jit-grad"])
def test_grad_wrt_the_module_equals_the_unrolled_one_and_is_never_stale(jit):
    implicit, unrolled = DEQ(solver.fixed_point), DEQ(solver.unrolled)
    for _ in range(2):
        got, expected = _gradient(implicit, jit), _gradient(unrolled, jit)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
        assert float(jnp.abs(got["layer"]["kernel"][...]).sum()) > 0
        for model in (implicit, unrolled):  # new weights: the next gradient must see them
            model.layer.kernel[...] *= 0.5


def test_a_rule_may_write_tracked_state_once_per_call():
    counter = nnx.Variable(jnp.array(0))
    f = jo.custom_vjp(lambda x: jnp.sin(x))

    def fwd(x):
        counter[...] += 1
        return jnp.sin(x), x

    f.defvjp(fwd, lambda x, g: (jnp.cos(x) * g,))

    def primal(x):
        counter[...] += 1
        return jnp.sin(x)

    g = jo.custom_vjp(primal)
    g.defvjp(fwd, lambda x, t: (jnp.cos(x) * t,))
    with jaxoverride_nnx.track(counter):
        with jax.checking_leaks():
            g(X)
            assert int(counter[...]) == 1
            jo.jit(lambda: g(X))()
            assert int(counter[...]) == 2
            gradient = jo.grad(lambda x: g(x).sum())(X)
            assert int(counter[...]) == 3, "fwd ran once for the gradient"
    np.testing.assert_allclose(gradient, jnp.cos(X), rtol=1e-6)


def test_a_write_inside_closure_convert_is_refused_and_nothing_changes():
    counter = nnx.Variable(jnp.array(0))

    def f(z, x):
        counter[...] += 1
        return jnp.tanh(z + x)

    with jaxoverride_nnx.track(counter):
        with pytest.raises(PureFunctionWriteError, match="closure_convert"):
            solver.fixed_point(f, jnp.zeros(4), X)
    assert int(counter[...]) == 0


def test_a_jit_inside_the_implicit_solve_under_a_jitted_gradient():
    """The solver's own ``jo.jit`` traced first under ``jo.jit(jo.grad)``: ``bwd`` is traced
    in that jit's transpose, and used to see the Variables' values of another trace (and
    to fail lowering with "No constant handler for DynamicJaxprTracer")."""
    inner = jo.jit(solver.fixed_point, static_argnums=0)
    implicit, unrolled = DEQ(lambda f, z0, x: inner(f, z0, x)), DEQ(solver.unrolled)
    with jax.checking_leaks():
        got, expected = _gradient(implicit, jit=True), _gradient(unrolled, jit=True)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_a_write_in_bwd_is_refused_and_nothing_changes():
    counter = nnx.Variable(jnp.array(0))
    f = jo.custom_vjp(lambda x: jnp.sin(x))

    def bwd(x, g):
        counter[...] += 1
        return (jnp.cos(x) * g,)

    f.defvjp(lambda x: (jnp.sin(x), x), bwd)
    with jaxoverride_nnx.track(counter):
        for grad in (jo.grad(lambda x: f(x).sum()), jo.jit(jo.grad(lambda x: f(x).sum()))):
            with pytest.raises(PureFunctionWriteError, match=r"bwd.*wrote.*Variable"):
                grad(X)
            assert int(counter[...]) == 0


def _counting_jvp(counter):
    def primal(x):
        counter[...] += 1
        return jnp.sin(x)

    f = jo.custom_jvp(primal)

    @f.defjvp
    def _(primals, tangents):
        (x,), (x_dot,) = primals, tangents
        counter[...] += 10
        return jnp.sin(x), jnp.cos(x) * x_dot

    return f


def test_a_custom_jvp_primal_and_rule_may_write_tracked_state_once_per_call():
    counter = nnx.Variable(jnp.array(0))
    f = _counting_jvp(counter)
    with jaxoverride_nnx.track(counter), jax.checking_leaks():
        np.testing.assert_allclose(f(X), jnp.sin(X), rtol=1e-6)
        assert int(counter[...]) == 1, "the primal ran once"
        jo.jit(lambda: f(X))()
        assert int(counter[...]) == 2
        for grad in (jo.grad(lambda x: f(x).sum()), jo.jit(jo.grad(lambda x: f(x).sum()))):
            before = int(counter[...])
            np.testing.assert_allclose(grad(X), jnp.cos(X), rtol=1e-6)
            assert int(counter[...]) == before + 10, "only the rule ran, once"
        _, tangent = jo.jvp(f, (X,), (jnp.ones(4),))
        np.testing.assert_allclose(tangent, jnp.cos(X), rtol=1e-6)
        assert int(counter[...]) == 32


class Scale(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.array(0.9))


class Counted(Scale):
    def __init__(self):
        super().__init__()
        self.calls = nnx.Variable(jnp.array(0))


def _cubed(x, w):  # a neutral loop inside the rule's primal function
    return jlax.fori_loop(0, 3, lambda _, z: z * w, x)


@pytest.mark.parametrize("jit", [False, True], ids=["grad", "jit-grad"])
def test_custom_jvp_defjvps_gradient_wrt_the_module_equals_raw_jax(jit):
    f = jo.custom_jvp(_cubed)
    f.defjvps(lambda x_dot, _, x, w: x_dot * w**3, lambda w_dot, _, x, w: w_dot * 3 * x * w**2)
    model = Scale()
    expected = jax.grad(lambda w: jnp.sum(_cubed(X, w) ** 2))(jnp.array(0.9))
    with jaxoverride_nnx.track(model), jax.checking_leaks():
        grad = lambda: jo.grad(lambda m: jnp.sum(f(X, m.w[...]) ** 2))(model)
        got = jo.jit(grad)() if jit else grad()
        np.testing.assert_allclose(jo.jit(lambda: f(X, model.w[...]))(), X * 0.9**3, rtol=1e-6)
    np.testing.assert_allclose(got["w"][...], expected, rtol=1e-5)


def test_a_custom_jvp_rule_reading_a_differentiated_variable_is_refused():
    model = Scale()
    f = jo.custom_jvp(lambda x: x * model.w[...])
    f.defjvp(lambda p, t: (p[0] * model.w[...], t[0] * model.w[...]))
    with jaxoverride_nnx.track(model), jax.checking_leaks():
        np.testing.assert_allclose(
            jo.grad(lambda x: f(x))(3.0), 0.9, rtol=1e-6
        )  # w not differentiated
        with pytest.raises(
            ClosedOverDifferentiationError, match=r"custom_jvp.*`Scale.w`.*closure_convert"
        ):
            jo.grad(lambda m: f(1.0))(model)
    assert float(model.w[...]) == pytest.approx(0.9)
    assert "on_get_value" not in model.w._var_metadata


# -- lax.custom_root and lax.custom_linear_solve ----------------------------------------


class Cell(nnx.Module):
    def __init__(self):
        self.layer = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
        self.layer.kernel[...] *= 0.3
        self.calls = nnx.Variable(jnp.array(0))


def _root_loss(cell):
    """A root solve whose ``f`` is one function object, read-only on the module, and whose
    ``solve`` runs a neutral loop: the shape of a library that defines its map once."""

    def f(z):
        return jnp.tanh(cell.layer(z) + X) - z

    def solve(g, z0):
        return jlax.fori_loop(0, 100, lambda _, z: z + g(z), z0)

    def tangent_solve(g, y):
        return jnp.linalg.solve(jax.jacobian(g)(y), y)

    return lambda m: jnp.sum(jlax.custom_root(f, jnp.zeros(4), solve, tangent_solve) ** 2)


@jax.jit
@functools.partial(jax.value_and_grad, argnums=(0, 1))
def _root_reference(kernel, bias):
    """Backpropagation through the same 100 steps, on explicit arrays."""
    step = lambda _, z: jnp.tanh(z @ kernel + bias + X)
    return jnp.sum(jax.lax.fori_loop(0, 100, step, jnp.zeros(4)) ** 2)


@pytest.mark.parametrize("jit", [False, True], ids=["grad", "jit-grad"])
def test_custom_root_gradient_wrt_the_module_equals_the_unrolled_one_and_is_never_stale(jit):
    """JAX caches the trace of ``f`` by its identity, closed-over values included: without
    the override, the second call reuses the weights (or tracers) of the first."""
    cell = Cell()
    loss = _root_loss(cell)
    with jaxoverride_nnx.track(cell), jax.checking_leaks():
        for _ in range(2):
            bias = cell.layer.bias
            assert bias is not None
            value, (kernel, bias) = _root_reference(cell.layer.kernel[...], bias[...])
            np.testing.assert_allclose(loss(cell), value, rtol=1e-5)
            grad = lambda: jo.grad(loss)(cell)
            got = jo.jit(grad)() if jit else grad()
            np.testing.assert_allclose(got["layer"]["kernel"][...], kernel, rtol=1e-4, atol=1e-6)
            np.testing.assert_allclose(got["layer"]["bias"][...], bias, rtol=1e-4, atol=1e-6)
            cell.layer.kernel[...] *= 0.5


def _linear_loss(cell):
    def matvec(v):
        return 2.0 * v + cell.layer(v) - cell.layer.bias[...]

    def solve(mv, b):  # a neutral loop around a direct solve
        return jlax.fori_loop(0, 1, lambda _, x: jnp.linalg.solve(jax.jacobian(mv)(b), b), b)

    return lambda m: jnp.sum(jlax.custom_linear_solve(matvec, X, solve, solve) ** 2)


@pytest.mark.parametrize("jit", [False, True], ids=["grad", "jit-grad"])
def test_custom_linear_solve_gradient_wrt_the_module_equals_raw_jax(jit):
    cell = Cell()
    loss = _linear_loss(cell)
    reference = jax.value_and_grad(
        lambda kernel: jnp.sum(jnp.linalg.solve(2.0 * jnp.eye(4) + kernel.T, X) ** 2)
    )
    with jaxoverride_nnx.track(cell), jax.checking_leaks():
        for _ in range(2):
            value, kernel = reference(cell.layer.kernel[...])
            np.testing.assert_allclose(loss(cell), value, rtol=1e-5)
            grad = lambda: jo.grad(loss)(cell)
            got = jo.jit(grad)() if jit else grad()
            np.testing.assert_allclose(got["layer"]["kernel"][...], kernel, rtol=1e-4, atol=1e-6)
            cell.layer.kernel[...] *= 0.5


def _counting(cell, fn):
    def counted(*args):
        cell.calls[...] += 1
        return fn(*args)

    return counted


def _root_writes(where):
    cell = Cell()
    f = lambda z: jnp.tanh(cell.layer(z) + X) - z
    solve = lambda g, z0: jlax.fori_loop(0, 10, lambda _, z: z + g(z), z0)
    tangent_solve = lambda g, y: jnp.linalg.solve(jax.jacobian(g)(y), y)
    rules = {"f": f, "solve": solve, "tangent_solve": tangent_solve}
    rules[where] = _counting(cell, rules[where])
    call = lambda: jlax.custom_root(
        rules["f"], jnp.zeros(4), rules["solve"], rules["tangent_solve"]
    )
    return cell, lambda m: jnp.sum(call())


@pytest.mark.parametrize("where", ["f", "solve", "tangent_solve"])
def test_a_write_inside_custom_root_is_refused_and_nothing_changes(where):
    cell, loss = _root_writes(where)
    kernel = cell.layer.kernel[...]
    with jaxoverride_nnx.track(cell), jax.checking_leaks():
        for run in (lambda: loss(cell), jo.jit(lambda: loss(cell)), lambda: jo.grad(loss)(cell)):
            with pytest.raises(
                PureFunctionWriteError, match=rf"custom_root: {where}.*`Cell.calls`"
            ):
                run()
            assert int(cell.calls[...]) == 0
            assert cell.layer.kernel[...] is kernel


def test_a_write_inside_custom_linear_solve_is_refused_and_nothing_changes():
    cell = Cell()
    matvec = _counting(cell, lambda v: 2.0 * v + cell.layer(v))
    solve = lambda mv, b: jnp.linalg.solve(jax.jacobian(mv)(b), b)
    with jaxoverride_nnx.track(cell), jax.checking_leaks():
        for run in (
            lambda: jlax.custom_linear_solve(matvec, X, solve),
            jo.jit(lambda: jlax.custom_linear_solve(matvec, X, solve)),
        ):
            with pytest.raises(PureFunctionWriteError, match=r"custom_linear_solve: matvec"):
                run()
            assert int(cell.calls[...]) == 0


@pytest.mark.parametrize("jit", [False, True], ids=["value_and_grad", "jit-value_and_grad"])
def test_value_and_grad_wrt_the_module_through_the_implicit_solver(jit):
    implicit, unrolled = DEQ(solver.fixed_point), DEQ(solver.unrolled)
    with jax.checking_leaks():
        results = []
        for model in (implicit, unrolled):
            with jaxoverride_nnx.track(model):
                run = lambda m=model: jo.value_and_grad(lambda m: m(X))(m)
                results.append(jo.jit(run)() if jit else run())
    (value, got), (expected_value, expected) = results
    np.testing.assert_allclose(value, expected_value, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_nondiff_argnames_are_resolved_as_jax_resolves_them():
    """A named non-differentiable argument goes to ``bwd`` first, under ``track`` too."""
    counter = nnx.Variable(jnp.array(0))

    def scaled(x, scale):
        counter[...] += 1
        return jnp.sin(x) * scale

    f = jo.custom_vjp(scaled, nondiff_argnames=("scale",))
    f.defvjp(lambda x, scale: (scaled(x, scale), x), lambda scale, x, g: (jnp.cos(x) * scale * g,))
    with jaxoverride_nnx.track(counter), jax.checking_leaks():
        gradient = jo.jit(jo.grad(lambda x: f(x, scale=3.0).sum()))(X)
    np.testing.assert_allclose(gradient, 3.0 * jnp.cos(X), rtol=1e-6)
    assert int(counter[...]) == 1


def _cubed_jvp(model, rule_writes, primal_writes):
    def primal(x, w):
        if primal_writes:
            model.calls[...] += 1
        return _cubed(x, w)

    f = jo.custom_jvp(primal)

    @f.defjvp
    def _(primals, tangents):
        (x, w), (x_dot, w_dot) = primals, tangents
        if rule_writes:
            model.calls[...] += 1
        return _cubed(x, w), x_dot * w**3 + w_dot * 3 * x * w**2

    return f


@pytest.mark.parametrize("rule_writes", [True, False], ids=["both-write", "primal-writes"])
def test_custom_jvp_inside_a_jit_under_a_jitted_gradient(rule_writes):
    """The inner ``jo.jit`` traces the primal function; JAX traces the rule later, while
    it linearizes that jit, and needs the same outputs from it, written state included."""
    model = Counted()
    inner = jo.jit(_cubed_jvp(model, rule_writes, primal_writes=True))
    expected = jax.grad(lambda w: jnp.sum(_cubed(X, w) ** 2))(jnp.array(0.9))
    with jaxoverride_nnx.track(model), jax.checking_leaks():
        loss = lambda m: jnp.sum(inner(X, m.w[...]) ** 2)
        got = jo.jit(lambda: jo.grad(loss)(model))()
        np.testing.assert_allclose(inner(X, model.w[...]), X * 0.9**3, rtol=1e-6)
    np.testing.assert_allclose(got["w"][...], expected, rtol=1e-5)
    # Under jo.grad JAX runs the rule instead of the primal: its writes are the ones kept.
    assert int(model.calls[...]) == (2 if rule_writes else 1)


def test_a_custom_jvp_rule_writing_what_the_primal_does_not_is_refused():
    model = Counted()
    inner = jo.jit(_cubed_jvp(model, rule_writes=True, primal_writes=False))
    with jaxoverride_nnx.track(model):
        loss = lambda m: jnp.sum(inner(X, m.w[...]) ** 2)
        with pytest.raises(TypeError, match=r"JVP rule wrote .*`Counted.calls`.*primal function"):
            jo.jit(lambda: jo.grad(loss)(model))()
    assert int(model.calls[...]) == 0


class _Field(nnx.Module):
    """``z -> tanh(w z + mean)``, updating a running mean of ``z`` first."""

    def __init__(self) -> None:
        self.w = nnx.Param(jnp.full(4, 0.5))
        self.mean = nnx.BatchStat(jnp.zeros(4))

    def __call__(self, z: jax.Array) -> jax.Array:
        self.mean[...] = 0.9 * self.mean[...] + 0.1 * z
        return jnp.tanh(self.w[...] * z + self.mean[...])


def test_a_jvp_rule_traced_later_may_eval_shape_what_its_primal_does_not_use():
    """equinox's checkpointed loop (diffrax's adjoints): a stop-gradient ``custom_jvp``
    whose JVP rule runs the loop body under ``eval_shape`` to find what is perturbed.
    JAX traces that rule while it linearizes the inner jit, after the call returned, so
    the model's Variables were never given to the rule: ``eval_shape`` computes types
    only, and hands them in as arguments of their types (this raised a RuntimeError)."""
    field = _Field()
    # Deeper than the first guess follows (equinox's body function reaches the model
    # through its closures): the rule is not given the model's Variables.
    reach = types.SimpleNamespace(inner=types.SimpleNamespace(model=field))
    shapes = []

    def body(v):
        return reach.inner.model(v)

    def stop_unless_perturbed_jvp(primals, tangents):
        (z,), (z_dot,) = primals, tangents
        shapes.append(jo.eval_shape(body, z))
        return z, z_dot

    stop_unless_perturbed = identity_with_jvp(jo.custom_jvp, stop_unless_perturbed_jvp)
    step = jo.jit(lambda z: field(stop_unless_perturbed(z)))
    loss = lambda x: jnp.sum(step(2.0 * x) ** 2)
    with jaxoverride_nnx.track(field), jax.checking_leaks():
        got = jo.jit(jo.grad(loss))(X)
    expected = jax.grad(lambda x: jnp.sum(jnp.tanh(0.5 * 2 * x + 0.1 * 2 * x) ** 2))(X)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert [(s.shape, s.dtype) for s in shapes] == [((4,), jnp.float32)]
    # One update, the primal's: eval_shape's write is dropped with its trace.
    np.testing.assert_allclose(field.mean[...], 0.1 * 2 * X, rtol=1e-6)


def _sin_vjp_writing(counter, primal_writes, fwd_writes):
    def primal(x):
        if primal_writes:
            counter[...] += 1
        return jnp.sin(x)

    def fwd(x):
        if fwd_writes:
            counter[...] += 1
        return jnp.sin(x), x

    f = jo.custom_vjp(primal)
    f.defvjp(fwd, lambda x, g: (jnp.cos(x) * g,))
    return f


def test_custom_vjp_inside_a_jit_under_a_jitted_gradient_when_only_the_primal_writes():
    """The inner ``jo.jit`` traces the primal, then JAX traces ``fwd`` while it linearizes
    that jit; ``fwd`` returns the primal's written state, unchanged (fwd's writes count)."""
    counter = nnx.Variable(jnp.array(0))
    inner = jo.jit(_sin_vjp_writing(counter, primal_writes=True, fwd_writes=False))
    with jaxoverride_nnx.track(counter), jax.checking_leaks():
        gradient = jo.jit(jo.grad(lambda x: inner(x).sum()))(X)
        assert int(counter[...]) == 0
        inner(X)
        assert int(counter[...]) == 1
    np.testing.assert_allclose(gradient, jnp.cos(X), rtol=1e-6)


def test_a_fwd_writing_what_the_primal_does_not_is_refused_and_nothing_changes():
    counter = nnx.Variable(jnp.array(0))
    f = _sin_vjp_writing(counter, primal_writes=False, fwd_writes=True)
    inner = jo.jit(f)
    with jaxoverride_nnx.track(counter):
        with pytest.raises(TypeError, match=r"custom_vjp: the forward rule \(fwd\) wrote"):
            jo.jit(jo.grad(lambda x: inner(x).sum()))(X)
        assert int(counter[...]) == 0
        np.testing.assert_allclose(jo.grad(lambda x: f(x).sum())(X), jnp.cos(X), rtol=1e-6)
    assert int(counter[...]) == 1, "alone (no primal traced), fwd may write"


TRANSFORMS = {
    "vmap": (lambda f: jo.vmap(f)(X), jnp.sin(X)),
    "jacfwd": (lambda f: jnp.diag(jo.jacfwd(f)(X)), jnp.cos(X)),
    "jacrev": (lambda f: jnp.diag(jo.jacrev(f)(X)), jnp.cos(X)),
    "jit-vmap-grad": (lambda f: jo.jit(jo.vmap(jo.grad(lambda x: f(x))))(X), jnp.cos(X)),
}


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("kind", ["custom_jvp", "custom_vjp"])
def test_a_writing_rule_under_each_transform_writes_once(kind, transform):
    counter = nnx.Variable(jnp.array(0))

    def primal(x):
        counter[...] += 1
        return jnp.sin(x)

    if kind == "custom_jvp":
        f = jo.custom_jvp(primal)
        f.defjvp(lambda p, t: (primal(p[0]), jnp.cos(p[0]) * t[0]))
    else:
        f = jo.custom_vjp(primal)
        f.defvjp(lambda x: (primal(x), x), lambda x, g: (jnp.cos(x) * g,))
    run, expected = TRANSFORMS[transform]
    with jaxoverride_nnx.track(counter), jax.checking_leaks():
        if kind == "custom_vjp" and transform == "jacfwd":  # JAX's own refusal, unchanged
            with pytest.raises(TypeError, match="forward-mode autodiff"):
                run(f)
            assert int(counter[...]) == 0
            return
        np.testing.assert_allclose(run(f), expected, rtol=1e-6, atol=1e-7)
    assert int(counter[...]) == 1


def test_a_jitted_custom_root_gradient_traces_once_and_serves_new_weights():
    """Wrapping the functions afresh per call costs nothing on a ``jo.jit`` cache hit."""
    cell = Cell()
    traces = 0

    def f(z):
        nonlocal traces
        traces += 1
        return jnp.tanh(cell.layer(z) + X) - z

    solve = lambda g, z0: jlax.fori_loop(0, 100, lambda _, z: z + g(z), z0)
    tangent_solve = lambda g, y: jnp.linalg.solve(jax.jacobian(g)(y), y)
    loss = lambda m: jnp.sum(jlax.custom_root(f, jnp.zeros(4), solve, tangent_solve) ** 2)
    with jaxoverride_nnx.track(cell), jax.checking_leaks():
        grad = jo.jit(lambda: jo.grad(loss)(cell))
        first = grad()
        once = traces
        cell.layer.kernel[...] *= 0.5
        second = grad()
        assert traces == once, "a cache hit: nothing traced again"
        bias = cell.layer.bias
        assert bias is not None
        _, (kernel, _) = _root_reference(cell.layer.kernel[...], bias[...])
    np.testing.assert_allclose(second["layer"]["kernel"][...], kernel, rtol=1e-4, atol=1e-6)
    assert not np.allclose(first["layer"]["kernel"][...], second["layer"]["kernel"][...])
