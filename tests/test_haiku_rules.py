"""``jo.custom_vjp`` / ``jo.custom_jvp`` inside ``hk.transform`` (``jaxoverride_haiku._rules``).

The primal function and the rules read parameters, write state and draw rng keys; what
they write comes out once per call under every composition of ``jax.jit`` and
``jax.grad`` (``jax.grad(jax.jit(apply))`` traces ``fwd`` after the transform returned).
Init creates parameters once and returns what apply returns. A rule that reads a value
being differentiated without having it as an argument is refused (never a silently zero
gradient), as is a write or a draw in ``bwd``; every refusal leaves Haiku as it was.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from haiku._src import base

import jaxoverride as jo
import jaxoverride_haiku as joh
from jaxoverride_haiku import ClosedOverDifferentiationError, PureFunctionWriteError
from jaxoverride_haiku._frames import Names
from jaxoverride_haiku._rules import _REFUSED

X = jnp.linspace(-1.0, 1.0, 3)
RNG = jax.random.PRNGKey(0)


@pytest.fixture(autouse=True)
def _haiku_context(request):
    if request.node.name.startswith("test_install_"):  # activates the adapter itself
        yield
        return
    with joh.context():
        yield


def count_call() -> None:
    hk.set_state("calls", hk.get_state("calls", [], jnp.int32, init=jnp.zeros) + 1)


def counted_sin(kind: str):
    """2 sin(x) with a hand-written rule; the primal and the rule each count their call."""

    def primal(x):
        count_call()
        return 2.0 * jnp.sin(x)

    if kind == "vjp":
        f = jo.custom_vjp(primal)

        def fwd(x):
            count_call()
            return 2.0 * jnp.sin(x), jnp.cos(x)

        f.defvjp(fwd, lambda cos, g: (2.0 * cos * g,))
    else:
        f = jo.custom_jvp(primal)

        @f.defjvp
        def jvp(primals, tangents):
            count_call()
            (x,), (t,) = primals, tangents
            return 2.0 * jnp.sin(x), 2.0 * jnp.cos(x) * t

    return f


def stateful_model(kind: str) -> hk.TransformedWithState:
    def forward(x):
        return counted_sin(kind)(hk.Linear(3, name="lin")(x))

    return hk.transform_with_state(forward)


def reference(params, x=X):
    lin = params["lin"]
    return 2.0 * jnp.sin(x @ lin["w"] + lin["b"])


MODES = ["apply", "jit", "grad", "jit-grad", "grad-jit"]


def run(model, params, state, mode):
    """(gradient or None, state after) of ``sum(apply)`` in the given composition."""

    def loss(p, apply=model.apply):
        out, after = apply(p, state, None, X)
        return jnp.sum(out), after

    if mode == "apply":
        return None, model.apply(params, state, None, X)[1]
    if mode == "jit":
        return None, jax.jit(model.apply)(params, state, None, X)[1]
    if mode == "grad":
        return jax.grad(loss, has_aux=True)(params)
    if mode == "jit-grad":
        return jax.jit(jax.grad(loss, has_aux=True))(params)
    return jax.grad(lambda p: loss(p, jax.jit(model.apply)), has_aux=True)(params)


@pytest.mark.parametrize("kind", ["vjp", "jvp"])
@pytest.mark.parametrize("mode", MODES)
def test_state_written_comes_out_once_per_call(kind, mode):
    model = stateful_model(kind)
    with jax.checking_leaks():
        params, state = model.init(RNG, X)
        grads, after = run(model, params, state, mode)
    assert list(params) == ["lin"]
    assert int(state["~"]["calls"]) == 0  # init counted once, and returned the initial state
    assert int(after["~"]["calls"]) == 1
    if grads is not None:
        expected = jax.grad(lambda p: jnp.sum(reference(p)))(params)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), grads, expected)


@pytest.mark.parametrize("kind", ["vjp", "jvp"])
def test_init_creates_parameters_once_and_returns_what_apply_returns(kind):
    def forward(x):
        def primal(x):
            return 2.0 * jnp.sin(hk.Linear(3)(x))  # created inside the rule's function

        f = jo.custom_vjp(primal) if kind == "vjp" else jo.custom_jvp(primal)
        if kind == "vjp":
            f.defvjp(lambda x: (primal(x), None), lambda _, g: (g,))
        else:
            f.defjvp(lambda p, t: (primal(*p), t[0]))
        # One rule called twice names its module twice, at init as at apply (no stale
        # cache), and the caller's naming continues after it.
        return f(x), f(x), hk.Linear(2)(x)

    model = hk.transform(forward)
    with jax.checking_leaks():
        params = model.init(RNG, X)
        jitted = jax.jit(model.init)(RNG, X)
        first, second, _ = model.apply(params, None, X)
    assert sorted(params) == ["linear", "linear_1", "linear_2"]
    assert jax.tree.map(jnp.shape, params["linear_2"]) == {"b": (2,), "w": (3, 2)}
    np.testing.assert_allclose(first, reference({"lin": params["linear"]}), rtol=1e-6)
    np.testing.assert_allclose(second, reference({"lin": params["linear_1"]}), rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), jitted, params)


def test_init_output_equals_apply_output():
    outputs = []

    def forward(x):
        outputs.append(counted_sin("vjp")(hk.Linear(3, name="lin")(x)))
        return outputs[-1]

    model = hk.transform_with_state(forward)
    params, state = model.init(RNG, X)
    at_init = outputs[-1]
    applied, _ = model.apply(params, state, None, X)
    np.testing.assert_allclose(at_init, applied, rtol=1e-6)


def noisy_model() -> hk.Transformed:
    """A rule whose primal and fwd draw a key: the same key, and the rng advances once."""

    def forward(x):
        def primal(x):
            return x + jax.random.normal(hk.next_rng_key(), x.shape)

        f = jo.custom_vjp(primal)
        f.defvjp(lambda x: (primal(x), None), lambda _, g: (3.0 * g,))
        return f(x), hk.next_rng_key()

    return hk.transform(forward)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_rng_drawn_in_primal_and_fwd_gives_the_same_keys(jit):
    model = noisy_model()
    apply = jax.jit(model.apply) if jit else model.apply
    with jax.checking_leaks():
        out, key_after = apply({}, RNG, X)
        (value, key_fwd), grad = jax.value_and_grad(
            lambda x: (lambda o: (jnp.sum(o[0]), o[1]))(apply({}, RNG, x)), has_aux=True
        )(X)
    assert float(value) == pytest.approx(float(jnp.sum(out)))
    np.testing.assert_array_equal(key_after, key_fwd)
    # Two draws from the transform's sequence: the rule's, then the caller's next one.
    seq = hk.PRNGSequence(RNG)
    seq.reserve_up_to_full()
    first, second = next(seq), next(seq)
    np.testing.assert_allclose(out, X + jax.random.normal(first, X.shape), rtol=1e-6)
    np.testing.assert_array_equal(key_after, second)
    np.testing.assert_allclose(grad, 3.0 * jnp.ones(3))


def _grad_of_identity_rule_with_state(scale: float, bwd: Callable[..., Any]) -> tuple[Any, Any]:
    """``jax.grad`` (leaks checked) at ``X``, and the state after, of an identity whose
    ``jo.custom_vjp`` ``fwd`` sets the Haiku state ``scale`` and whose ``bwd`` is given."""

    def forward(x):
        f = jo.custom_vjp(lambda x: x)

        def fwd(x):
            hk.set_state("scale", jnp.float32(scale))
            return x, None

        f.defvjp(fwd, bwd)
        hk.get_state("scale", [], init=jnp.zeros)
        return jnp.sum(f(x))

    model = hk.transform_with_state(forward)
    params, state = model.init(RNG, X)
    with jax.checking_leaks():
        return jax.grad(lambda x: model.apply(params, state, None, x), has_aux=True)(X)


def test_bwd_reads_the_state_as_fwd_left_it():
    bwd = lambda _, g: (hk.get_state("scale") * g,)
    grad, after = _grad_of_identity_rule_with_state(5.0, bwd)
    np.testing.assert_allclose(grad, 5.0 * jnp.ones(3))
    assert float(after["~"]["scale"]) == 5.0


def closed_over_model(kind: str) -> hk.Transformed:
    """A rule that reads a parameter without having it as an argument."""

    def forward(x):
        w = hk.get_parameter("w", [3], init=lambda shape, dtype: jnp.full(shape, 2.0, dtype))
        primal = lambda x: x * hk.get_parameter("w", [3])
        f = jo.custom_vjp(primal) if kind == "vjp" else jo.custom_jvp(primal)
        if kind == "vjp":
            f.defvjp(lambda x: (primal(x), None), lambda _, g: (g,))
        else:
            f.defjvp(lambda p, t: (primal(*p), t[0]))
        return jnp.sum(f(x) * w)

    return hk.transform(forward)


@pytest.mark.parametrize("kind", ["vjp", "jvp"])
@pytest.mark.parametrize("jit", [False, True], ids=["grad", "jit-grad"])
def test_differentiating_a_closed_over_parameter_is_refused(kind, jit):
    model = closed_over_model(kind)
    params = model.init(RNG, X)
    grad = jax.grad(lambda p: model.apply(p, None, X))
    with pytest.raises(ClosedOverDifferentiationError, match=r"'~/w'.*closure_convert"):
        (jax.jit(grad) if jit else grad)(params)
    assert not base.frame_stack  # nothing of the failed call remains
    # Differentiating only the input reads the parameter as a constant: allowed, and the
    # gradient is the rule's (identity, times the outer w), not the true one (w * w).
    got = jax.grad(lambda x: model.apply(params, None, x))(X)
    np.testing.assert_allclose(got, jnp.full(3, 2.0))


def test_a_closed_over_parameter_passed_as_argument_gets_its_gradient():
    """What the refusal asks for: ``closure_convert`` makes the parameter an argument."""

    def forward(x):
        lin = hk.Linear(3, name="lin")
        g, consts = jo.closure_convert(lambda x: lin(x), x)
        f = jo.custom_vjp(lambda x, *consts: 2.0 * jnp.sin(g(x, *consts)))

        def fwd(x, *consts):
            y = g(x, *consts)
            return 2.0 * jnp.sin(y), (x, consts, jnp.cos(y))

        def bwd(res, ct):
            x, consts, cos = res
            return jax.vjp(g, x, *consts)[1](2.0 * cos * ct)

        f.defvjp(fwd, bwd)
        return f(x, *consts)

    model = hk.transform(forward)
    params = model.init(RNG, X)
    with jax.checking_leaks():
        got = jax.grad(lambda p: jnp.sum(model.apply(p, None, X)))(params)
    expected = jax.grad(lambda p: jnp.sum(reference(p)))(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, expected)


@pytest.mark.parametrize("what", ["write", "draw"])
def test_a_write_or_draw_in_bwd_is_refused(what):
    def forward(x):
        f = jo.custom_vjp(lambda x: x)

        def bwd(_, g):
            if what == "write":
                hk.set_state("seen", jnp.sum(g))
            else:
                hk.next_rng_key()
            return (g,)

        f.defvjp(lambda x: (x, None), bwd)
        hk.get_state("seen", [], init=jnp.zeros)
        return jnp.sum(f(x))

    model = hk.transform_with_state(forward)
    params, state = model.init(RNG, X)
    message = r"'~/seen' was written" if what == "write" else "rng key was drawn"
    with pytest.raises(PureFunctionWriteError, match=rf"custom_vjp: .*{message}.*backward rule"):
        jax.grad(lambda x: model.apply(params, state, RNG, x)[0])(X)
    assert not base.frame_stack


def haiku_view() -> tuple:
    """Everything of Haiku and jaxoverride that a failed call must leave as it was: the
    frame stack, module stack, naming counters, params, state and rng (by identity), the
    getter/setter stacks, the active overrides and the rule's refused reads."""
    frame = base.current_frame()
    names = Names.capture(frame)
    state: Any = frame.state
    sequence = frame.rng_stack.peek()
    rng = () if sequence is None else jax.tree.leaves(sequence.internal_state)
    return (
        len(base.frame_stack),
        len(frame.module_stack),
        len(frame.rng_stack),
        [dict(c) for c in names.counters],
        [set(u) for u in names.used],
        {m: {n: id(v) for n, v in b.items()} for m, b in frame.params.items()},
        {m: {n: (id(p.initial), id(p.current)) for n, p in b.items()} for m, b in state.items()},
        [id(leaf) for leaf in rng],
        [
            len(s)
            for s in (
                base.param_getter_stack,
                base.state_getter_stack,
                base.state_setter_stack,
                base.param_creator_stack,
                base.state_creator_stack,
            )
        ],
        repr(jo.current_stack()),
        _REFUSED.get(),
    )


def _undefined(x):
    return jo.custom_vjp(lambda x: 2.0 * x)(x)


def _wrong_nondiff_argnums(x):
    return jo.custom_vjp(lambda n, x: n * x, nondiff_argnums=(2,))


def _non_callable_rule(x):
    jo.custom_vjp(lambda x: x).defvjp(lambda x: (x, None), "bwd")  # pyright: ignore[reportArgumentType]


def _bwd_write(x):
    f = jo.custom_vjp(lambda x: x)

    def bwd(_, g):
        hk.set_state("before", jnp.sum(g))
        return (g,)

    f.defvjp(lambda x: (x, None), bwd)
    return jo.grad(lambda v: jnp.sum(f(v)))(x)


def _closed_over(x):
    primal = lambda x: x * hk.get_parameter("w", [3])
    f = jo.custom_vjp(primal)
    f.defvjp(lambda x: (primal(x), None), lambda _, g: (g,))
    return f(x)


def _sin_times(x, y):
    return jnp.sin(x) * y


def _bwd_of_wrong_structure(x):
    f = jo.custom_vjp(_sin_times)
    f.defvjp(lambda x, y: (_sin_times(x, y), (x, y)), lambda _, g: (g,))  # one of two
    return jo.grad(lambda v: jnp.sum(f(v, 2.0)))(x)


def _fwd_without_a_pair(x):
    f = jo.custom_vjp(_sin_times)
    f.defvjp(lambda x, y: _sin_times(x, y), lambda res, g: (g, g))
    return jo.grad(lambda v: jnp.sum(f(v, 2.0)))(x)


BAD = {
    "bwd-structure": (
        _bwd_of_wrong_structure,
        TypeError,
        # JAX's message, about the user's two arguments (not the adapter's three)
        re.escape(
            "but got bwd output structure PyTreeDef((*,)) for primal input structure "
            "PyTreeDef((*, *))."
        ),
    ),
    "fwd-not-a-pair": (
        _fwd_without_a_pair,
        TypeError,
        "Custom VJP fwd rule <lambda> for function _sin_times must produce a pair",
    ),
    "undefined": (_undefined, AttributeError, "No VJP defined for custom_vjp function.*defvjp"),
    "nondiff_argnums": (
        _wrong_nondiff_argnums,
        IndexError,
        r"nondiff_argnums \(2,\).*2 positional",
    ),
    "non-callable": (
        _non_callable_rule,
        TypeError,
        r"bwd \(the backward rule\) must be a function",
    ),
    "bwd-write": (
        _bwd_write,
        PureFunctionWriteError,
        r"'~/before' was written inside the backward",
    ),
    "closed-over": (_closed_over, ClosedOverDifferentiationError, r"'~/w'.*closure_convert"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_refused_and_leaves_haiku_as_it_was(case):
    """Each misuse, caught inside the transform (at apply, under ``jax.grad`` w.r.t. the
    params): a clear error, then Haiku is exactly as before and the program goes on."""
    bad, error, message = BAD[case]
    seen = []

    def forward(x):
        w = hk.get_parameter("w", [3], init=jnp.ones)
        hk.set_state("before", hk.get_state("before", [], init=jnp.ones))
        if not hk.running_init():
            before = haiku_view()
            with pytest.raises(error, match=message):
                bad(x)
            seen.append(haiku_view() == before)
        # The failed call named nothing: this is `linear`, and the state is untouched.
        return jnp.sum(hk.Linear(3)(x * w)) + hk.get_state("before")

    model = hk.transform_with_state(forward)
    params, state = model.init(RNG, X)
    with jax.checking_leaks():
        grads, after = jax.grad(
            lambda p: model.apply(p, state, RNG, X), has_aux=True, allow_int=True
        )(params)
    assert seen == [True]
    assert sorted(params) == ["linear", "~"]
    assert float(after["~"]["before"]) == 1.0
    expected = jax.grad(
        lambda p: hk.transform(lambda x: jnp.sum(hk.Linear(3)(x * p["~"]["w"]))).apply(
            {"linear": p["linear"]}, None, X
        )
    )(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), grads, expected)


def test_install_and_a_neutral_loop_inside_a_lazily_traced_fwd():
    """Under ``install()`` and ``jax.grad(jax.jit(apply))`` JAX traces ``fwd`` after the
    transform returned; a neutral loop inside it is still Haiku's (it carries the state
    it writes), and the ``defjvps`` rule stacked on it differentiates as JAX's."""

    def forward(x):
        def primal(x):
            def body(_, c):
                count_call()
                return c

            return jo.lax.fori_loop(0, 3, body, x)

        f = jo.custom_vjp(primal)
        f.defvjp(lambda x: (primal(x), None), lambda _, g: (2.0 * g,))
        g = jo.custom_jvp(jnp.sin)
        g.defjvps(lambda t, ans, x: jnp.cos(x) * t)
        hk.get_state("calls", [], jnp.int32, init=jnp.zeros)
        return jnp.sum(g(f(hk.Linear(3, name="lin")(x))))

    model = hk.transform_with_state(forward)
    joh.install()
    try:
        params, state = model.init(RNG, X)
        apply = jax.jit(model.apply)
        with jax.checking_leaks():
            grads, after = jax.grad(lambda p: apply(p, state, None, X), has_aux=True)(params)
    finally:
        joh.uninstall()
    assert int(after["~"]["calls"]) == 3
    pre = X @ params["lin"]["w"] + params["lin"]["b"]
    np.testing.assert_allclose(grads["lin"]["b"], 2.0 * jnp.cos(pre), rtol=1e-6)


def test_outside_a_transform_the_rule_is_jaxs_own():
    """With the context active but no transform, the jaxpr is exactly JAX's."""

    def build(kind):
        f = kind(lambda x: 2.0 * jnp.sin(x))
        f.defvjp(lambda x: (2.0 * jnp.sin(x), jnp.cos(x)), lambda c, g: (2.0 * c * g,))
        return lambda x: jnp.sum(f(x))

    ours, theirs = build(jo.custom_vjp), build(jax.custom_vjp)
    assert str(jax.make_jaxpr(ours)(X)) == str(jax.make_jaxpr(theirs)(X))
    assert str(jax.make_jaxpr(jax.grad(ours))(X)) == str(jax.make_jaxpr(jax.grad(theirs))(X))


def test_each_function_is_traced_once_per_trace_of_apply():
    traces = {"primal": 0, "fwd": 0, "bwd": 0}

    def forward(x):
        def primal(x):
            traces["primal"] += 1
            return 2.0 * jnp.sin(x)

        def fwd(x):
            traces["fwd"] += 1
            return 2.0 * jnp.sin(x), jnp.cos(x)

        def bwd(cos, g):
            traces["bwd"] += 1
            return (2.0 * cos * g,)

        f = jo.custom_vjp(primal)
        f.defvjp(fwd, bwd)
        return jnp.sum(f(hk.Linear(3)(x)))

    model = hk.transform(forward)
    params = model.init(RNG, X)
    assert traces == {"primal": 1, "fwd": 0, "bwd": 0}  # init traces once, as apply does
    apply = jax.jit(model.apply)
    for _ in range(2):
        apply(params, None, X)
    assert traces == {"primal": 2, "fwd": 0, "bwd": 0}  # a cache hit traces nothing
    grad = jax.jit(jax.grad(model.apply))
    for _ in range(2):
        grad(params, None, X)
    assert traces == {"primal": 2, "fwd": 1, "bwd": 1}


def test_keywords_and_nondiff_arguments_bind_as_in_jax():
    """Keywords resolve to positions on the user's function (JAX's binding), and a
    non-differentiable argument reaches ``fwd`` and ``bwd`` where JAX puts it."""

    def build(kind):
        def primal(power, x, scale=1.0):
            return scale * x**power

        f = kind(primal, nondiff_argnums=(0,))

        def fwd(power, x, scale=1.0):
            return primal(power, x, scale), (x, scale)

        def bwd(power, residuals, g):
            x, scale = residuals
            return (scale * power * x ** (power - 1) * g, jnp.sum(x**power * g))

        f.defvjp(fwd, bwd)
        return lambda x, scale: jnp.sum(f(3, x, scale=scale))

    ours, theirs = build(jo.custom_vjp), build(jax.custom_vjp)
    model = hk.transform(lambda x, scale: ours(x, scale))
    with jax.checking_leaks():
        got = jax.grad(lambda x, s: model.apply({}, None, x, s), argnums=(0, 1))(X, 2.0)
    expected = jax.grad(theirs, argnums=(0, 1))(X, 2.0)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, expected)


@pytest.mark.parametrize("kind", ["vjp", "jvp"])
@pytest.mark.parametrize("jit", [False, True], ids=["grad", "grad-jit"])
def test_state_the_rule_does_not_write_keeps_its_gradient(kind, jit):
    """State written from the params before the rule and read after it: the rule hands
    back only what it replaced, so this value keeps its derivative."""

    def forward(x):
        hk.set_state("h", hk.Linear(3, name="lin")(x))
        y = counted_sin(kind)(x)  # writes "calls", not "h"
        return jnp.sum(y) + jnp.sum(hk.get_state("h") ** 2)

    model = hk.transform_with_state(forward)
    params, state = model.init(RNG, X)
    apply = jax.jit(model.apply) if jit else model.apply
    with jax.checking_leaks():
        got, after = jax.grad(lambda p: apply(p, state, None, X), has_aux=True)(params)
    expected = jax.grad(lambda p: jnp.sum((X @ p["lin"]["w"] + p["lin"]["b"]) ** 2))(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, expected)
    assert int(after["~"]["calls"]) == 1


def test_differentiating_state_that_came_out_of_a_rule_is_refused():
    def forward(x):
        def primal(x):
            hk.set_state("y", 3.0 * x)
            return x

        f = jo.custom_vjp(primal)
        f.defvjp(lambda x: (primal(x), None), lambda _, g: (g,))
        return jnp.sum(f(x) + hk.get_state("y", [3], init=jnp.zeros))

    model = hk.transform_with_state(forward)
    params, state = model.init(RNG, X)
    with pytest.raises(joh.DifferentiatedStateError, match=r"state ~/y came out of the rule"):
        jax.grad(lambda x: model.apply(params, state, None, x)[0])(X)
    # Not differentiated afterwards: the written state simply comes out.
    _, after = model.apply(params, state, None, X)
    np.testing.assert_allclose(after["~"]["y"], 3.0 * X)


def test_a_lazily_traced_fwd_that_writes_what_the_primal_does_not_is_refused():
    """Under ``jax.grad(jax.jit(apply))`` the call has returned its state before JAX
    traces ``fwd``: a write only ``fwd`` makes could not come out, so it is refused."""

    def forward(x):
        f = jo.custom_vjp(lambda x: x)

        def fwd(x):
            count_call()
            return x, None

        f.defvjp(fwd, lambda _, g: (g,))
        hk.get_state("calls", [], jnp.int32, init=jnp.zeros)
        return jnp.sum(f(x))

    model = hk.transform_with_state(forward)
    params, state = model.init(RNG, X)
    apply = jax.jit(model.apply)
    with pytest.raises(ValueError, match=r"writes the Haiku state ~/calls, which the primal"):
        jax.grad(lambda x: apply(params, state, None, x)[0])(X)
    # Where JAX traces fwd during the call (jax.grad, jax.jit(jax.grad)), it comes out.
    _, after = jax.grad(lambda x: model.apply(params, state, None, x), has_aux=True)(X)
    assert int(after["~"]["calls"]) == 1


def test_a_neutral_loop_in_bwd_that_writes_nothing_is_not_refused():
    """bwd's refusal is at the write: a loop that carries the state (storing it again as
    new objects) without writing passes, and reads the state as fwd left it."""

    def bwd(_, g):
        scale = hk.get_state("scale")
        return (jo.lax.fori_loop(0, 3, lambda _, c: c * scale, g),)

    grad, _ = _grad_of_identity_rule_with_state(2.0, bwd)
    np.testing.assert_allclose(grad, 8.0 * jnp.ones(3))


class _Cell(hk.Module):
    """``z @ w + b``, then a rule whose function uses ``w`` only (its JVP rule reads ``b``
    if ``jvp_reads_bias``)."""

    def __init__(self, jvp_reads_bias: bool = False):
        super().__init__(name="cell")
        self.jvp_reads_bias = jvp_reads_bias

    def __call__(self, z: jax.Array) -> jax.Array:
        w = hk.get_parameter("w", [3, 3], init=jnp.ones)
        b = hk.get_parameter("b", [3], init=jnp.ones)
        rule = jo.custom_jvp(lambda y: y @ hk.get_parameter("w", [3, 3], init=jnp.ones))

        def jvp(primals, tangents):
            scale = hk.get_parameter("b", [3], init=jnp.ones) if self.jvp_reads_bias else 1.0
            return rule(*primals), rule(*tangents) * scale

        rule.defjvp(jvp)
        return jnp.sum(rule(z @ w + b))


def test_a_staged_custom_jvp_takes_only_the_params_its_function_uses():
    """Staged (here by ``make_jaxpr``), the rule's equation takes ``w`` and its argument,
    not the unused ``b``: from JAX 0.12 each input of a staged ``custom_jvp`` met in
    ``jax.linearize`` becomes a residual (optimistix's Newton step: lineax's operator)."""
    model = hk.transform(lambda x: _Cell()(x))
    params = model.init(RNG, X)
    jaxpr = jax.make_jaxpr(model.apply)(params, None, X).jaxpr
    (rule,) = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "custom_jvp_call"]
    assert [v.aval.shape for v in rule.invars] == [(3, 3), (3,)]  # w and z @ w + b
    apply = jax.jit(model.apply)
    with jax.checking_leaks():
        got = jax.grad(lambda x: apply(params, None, x))(X)
    w = params["cell"]["w"]
    np.testing.assert_allclose(got, w @ (w @ jnp.ones(3)), rtol=1e-6)


def test_a_jvp_rule_reading_a_param_its_staged_function_does_not_use_is_refused():
    """The staged rule does not take ``b``, so its JVP rule, traced from the staged
    equation (``jax.grad(jax.jit(apply))``), cannot read it: refused, naming the fix.
    Not staged (``jax.jit(jax.grad(apply))``: JAX runs the JVP rule at the call), it works."""
    model = hk.transform(lambda x: _Cell(jvp_reads_bias=True)(x))
    params = model.init(RNG, X)
    apply = jax.jit(model.apply)
    with pytest.raises(ValueError, match="'cell/b', which the primal function does not use"):
        jax.grad(lambda x: apply(params, None, x))(X)
    got = jax.jit(jax.grad(lambda x: model.apply(params, None, x)))(X)
    w, b = params["cell"]["w"], params["cell"]["b"]
    np.testing.assert_allclose(got, w @ (w @ jnp.ones(3) * b), rtol=1e-6)


@pytest.mark.parametrize("jit", [False, True], ids=["grad", "grad-jit"])
def test_optimize_remat_works_in_a_transform_as_in_jax(jit):
    """``defvjp(..., optimize_remat=True)`` over a primal that writes state: JAX takes no
    symbolic zeros there, so the lifted rule registers none, and the gradient is JAX's."""

    def build(kind, count):
        def primal(x):
            if count:
                count_call()
            return 2.0 * jnp.sin(x)

        f = kind(primal)
        f.defvjp(
            lambda x: (2.0 * jnp.sin(x), jnp.cos(x)),
            lambda cos, g: (2.0 * cos * g,),
            optimize_remat=True,
        )
        return hk.transform_with_state(lambda x: jnp.sum(f(hk.Linear(3)(x))))

    ours, theirs = build(jo.custom_vjp, True), build(jax.custom_vjp, False)
    params, state = ours.init(RNG, X)
    assert int(state["~"]["calls"]) == 0  # init returns the initial state

    def loss(model, state):
        return lambda p: model.apply(p, state, None, X)[0]

    grad = jax.jit(jax.grad(loss(ours, state))) if jit else jax.grad(loss(ours, state))
    with jax.checking_leaks():
        got = grad(params)
    expected = jax.grad(loss(theirs, {}))(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, expected)
    _, after = ours.apply(params, state, None, X)
    assert int(after["~"]["calls"]) == 1
