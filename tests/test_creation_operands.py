"""Creation passes see what JAX's own call would hand a body, and trace each branch once.

At init every combinator first calls its bodies outside JAX (the creation pass). Those
calls must get the operands JAX's ``cond``/``switch``/loops give a body: arrays of the
same shape and dtype, weak type included (a Python ``1`` is a weakly-typed ``int32``),
so that a body reading ``x.shape`` works at init and bad input gets JAX's own error.
And like JAX, which traces one branch object once however often it is listed, the
creation pass calls each distinct branch once and the apply pass traces no more than
JAX does. Haiku's init normally has no creation pass: it traces control flow once,
creating parameters at the call's site, so it too sees exactly JAX's traces.
Each case is differential: the same body under the raw ``jax.lax`` function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxoverride as jo
import jaxoverride_haiku as joh
import jaxoverride_nnx
import jaxoverride_plain as plain
from jaxoverride import lax as jlax

# Python scalars of each kind, a NumPy scalar (strongly typed) and a mixed tuple.
OPERANDS = [1, 2.5, True, np.float32(1.5), (1, 2.0)]


def _avals(tree: Any) -> list[tuple[Any, ...]]:
    # isinstance(x, jax.Array) holds for tracers too: a raw Python scalar fails it.
    return [
        (isinstance(x, jax.Array), jnp.shape(x), jnp.result_type(x), jax.typeof(x).weak_type)
        for x in jax.tree.leaves(tree)
    ]


# name -> run(lax, body, operand): the combinator called with `body` seeing `operand`.
COMBINATORS: dict[str, Callable[[Any, Callable[[Any], Any], Any], Any]] = {
    "cond": lambda lax, body, x: lax.cond(True, body, body, x),
    "switch": lambda lax, body, x: lax.switch(1, [body, body], x),
    "while_cond": lambda lax, body, x: lax.while_loop(lambda c: body(c) is None, lambda c: c, x),
    "while_body": lambda lax, body, x: lax.while_loop(lambda c: False, lambda c: body(c), x),
    "fori_carry": lambda lax, body, x: lax.fori_loop(0, 2, lambda i, c: body(c), x),
    "fori_index": lambda lax, body, x: lax.fori_loop(0, 2, lambda i, c: (body(i), c)[1], x),
    "scan_carry": lambda lax, body, x: lax.scan(lambda c, _: (body(c), None), x, None, length=2),
    "scan_slice": lambda lax, body, x: lax.scan(
        lambda c, s: (c, body(s)), 0, jax.tree.map(lambda v: jnp.asarray([v, v]), x)
    ),
    "map": lambda lax, body, x: lax.map(body, jax.tree.map(lambda v: jnp.asarray([v, v]), x)),
}


def _first_seen(lax: Any, name: str, operand: Any) -> list[tuple[Any, ...]]:
    seen: list[list[tuple[Any, ...]]] = []

    def body(x: Any) -> Any:
        seen.append(_avals(x))
        return x

    COMBINATORS[name](lax, body, operand)
    return seen[0]


@pytest.mark.parametrize("operand", OPERANDS, ids=repr)
@pytest.mark.parametrize("name", sorted(COMBINATORS))
def test_plain_creation_pass_sees_what_jax_traces(name, operand):
    expected = _first_seen(jax.lax, name, operand)
    with plain.context(), plain.init_context(), jax.checking_leaks():
        assert _first_seen(jlax, name, operand) == expected


@pytest.mark.parametrize("operand", OPERANDS, ids=repr)
@pytest.mark.parametrize("name", sorted(COMBINATORS))
def test_haiku_creation_pass_sees_what_jax_traces(name, operand):
    expected = _first_seen(jax.lax, name, operand)
    seen: list[Any] = []

    def program() -> None:
        seen.append(_first_seen(jlax, name, operand))

    with joh.context(), jax.checking_leaks():
        hk.transform_with_state(program).init(None)
    assert seen == [expected]


def test_haiku_switch_branch_reads_the_shape_of_python_operands():
    # Haiku's test_switch_multiple_operands: a module sized by x.shape, x a Python int.
    def program(i: Any) -> Any:
        def case(scale: float) -> Callable[..., Any]:
            return lambda x, y, z: hk.get_parameter("w", x.shape, init=jnp.ones) * scale + y + z

        return jlax.switch(i, [case(1.0), case(2.0), case(3.0)], 1, 3, 5)

    with joh.context(), jax.checking_leaks():
        f = hk.transform_with_state(program)
        params, state = f.init(None, 1)
        out, _ = f.apply(params, state, None, 1)
    assert params["~"]["w"].shape == ()
    np.testing.assert_allclose(out, 10.0)


@pytest.mark.parametrize("kind", ["cond", "switch"])
def test_haiku_branch_structure_error_is_jaxs_at_init(kind):
    # The branches read x.shape, so a creation pass on the raw int fails before JAX checks.
    same = lambda x: jnp.zeros(x.shape)
    pair = lambda x: (jnp.zeros(x.shape), x)
    call: dict[str, Callable[[Any], Any]] = {
        "cond": lambda lax: lax.cond(True, same, pair, 1),
        "switch": lambda lax: lax.switch(0, [same, pair], 1),
    }
    with pytest.raises(TypeError) as raw:
        call[kind](jax.lax)
    with joh.context(), pytest.raises(TypeError) as adapted:
        hk.transform_with_state(lambda: call[kind](jlax)).init(None)
    assert "must have the same pytree structure" in str(raw.value)
    assert str(raw.value).split(",")[0] in str(adapted.value)


# Branch lists with repeated objects: Haiku's cond/switch "traces ... with same id once".
def _f(x: Any) -> Any:
    return x + 1


def _g(x: Any) -> Any:
    return x * 2


BRANCHES: dict[str, Callable[[Any, Callable[..., Any], Callable[..., Any]], Any]] = {
    "cond_f_f": lambda lax, f, g: lax.cond(False, f, f, 0),
    "switch_f_f": lambda lax, f, g: lax.switch(0, [f, f], 0),
    "switch_f_f_f": lambda lax, f, g: lax.switch(2, [f, f, f], 0),
    "switch_f_g_f": lambda lax, f, g: lax.switch(1, [f, g, f], 0),
    "switch_g_f_f": lambda lax, f, g: lax.switch(0, [g, f, f], 0),
}


def _calls(run: Callable[[Callable[..., Any], Callable[..., Any]], Any]) -> dict[str, int]:
    calls = {"f": 0, "g": 0}

    def counting(name: str, fun: Callable[..., Any]) -> Callable[..., Any]:
        def counted(x: Any) -> Any:
            calls[name] += 1
            return fun(x)

        return counted

    run(counting("f", _f), counting("g", _g))
    return calls


@pytest.mark.parametrize("shape", sorted(BRANCHES))
def test_haiku_each_distinct_branch_is_traced_once(shape):
    # JAX itself: one trace per distinct branch object.
    jax_calls = _calls(lambda f, g: BRANCHES[shape](jax.lax, f, g))
    assert set(jax_calls.values()) <= {0, 1}
    with joh.context():
        init = _calls(
            lambda f, g: hk.transform_with_state(lambda: BRANCHES[shape](jlax, f, g)).init(None)
        )
        apply = _calls(
            lambda f, g: hk.transform_with_state(lambda: BRANCHES[shape](jlax, f, g)).apply(
                {}, {}, None
            )
        )
    # Init traces control flow once, creating parameters at the call's site, so
    # it sees exactly JAX's traces: one per distinct branch object, as Haiku does.
    assert init == jax_calls
    assert apply == jax_calls


@pytest.mark.parametrize("shape", sorted(BRANCHES))
def test_plain_each_distinct_branch_is_traced_once(shape):
    jax_calls = _calls(lambda f, g: BRANCHES[shape](jax.lax, f, g))
    with plain.context():
        apply = _calls(lambda f, g: BRANCHES[shape](jlax, f, g))
        with plain.init_context():
            init = _calls(lambda f, g: BRANCHES[shape](jlax, f, g))
    assert init == {k: v + v for k, v in jax_calls.items()}
    assert apply == jax_calls


@pytest.mark.parametrize("shape", sorted(BRANCHES))
def test_nnx_each_distinct_branch_is_traced_once_and_sees_arrays(shape):
    # NNX has no creation pass: its overrides hand JAX one cached wrapper per branch
    # object, so JAX's own count and operands hold; this guards that.
    model = nnx.Linear(1, 1, rngs=nnx.Rngs(0))
    seen: list[Any] = []

    def through_model(lax: Any) -> Callable[[Any, Any], Any]:
        def run(f: Callable[..., Any], g: Callable[..., Any]) -> Any:
            def via(fun: Callable[..., Any]) -> Callable[..., Any]:
                def branch(x: Any) -> Any:
                    seen.append(_avals(x))
                    return fun(model(jnp.reshape(x * 1.0, (1, 1))).sum())

                return branch

            return BRANCHES[shape](lax, via(f), via(g))

        return run

    jax_calls = _calls(through_model(jax.lax))
    jax_seen = list(seen)
    seen.clear()
    with jaxoverride_nnx.track(model):
        calls = _calls(through_model(jlax))
    assert calls == jax_calls
    assert seen == jax_seen


# name -> run(jax-like module, f): the transform applied to `f(x, n)` at x = 2.0 (Python).
TRANSFORMS: dict[str, Callable[[Any, Callable[..., Any]], Any]] = {
    "grad": lambda j, f: j.grad(f)(2.0, 3),
    "value_and_grad": lambda j, f: j.value_and_grad(f)(2.0, 3),
    "jacfwd": lambda j, f: j.jacfwd(f)(2.0, 3),
    "jacrev": lambda j, f: j.jacrev(f)(2.0, 3),
    "hessian": lambda j, f: j.hessian(f)(2.0, 3),
    "jit": lambda j, f: j.jit(f, static_argnums=1)(2.0, 3),
    "jit_argnames": lambda j, f: j.jit(f, static_argnames="n")(2.0, n=3),
    "jvp": lambda j, f: j.jvp(lambda x: f(x, 3), (2.0,), (1.0,)),
    "vjp": lambda j, f: j.vjp(lambda x: f(x, 3), 2.0)[0],
    "linearize": lambda j, f: j.linearize(lambda x: f(x, 3), 2.0)[0],
}


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_plain_transform_creation_pass_sees_what_jax_traces(name):
    seen: list[Any] = []

    def f(x: Any, n: Any) -> Any:
        # x is differentiated (an array in JAX's trace); n is passed through as given.
        seen.append((_avals(x), type(n)))
        return x**2 * n

    TRANSFORMS[name](jax, f)
    expected = seen[0]
    seen.clear()
    with plain.context(), plain.init_context(), jax.checking_leaks():
        TRANSFORMS[name](jo, f)
    assert seen[0] == expected


@pytest.mark.parametrize("name", [*sorted(TRANSFORMS), "eval_shape"])
def test_haiku_transform_creation_pass_sees_what_jax_traces(name):
    run: Callable[[Any, Callable[..., Any]], Any] = TRANSFORMS.get(
        name, lambda j, f: j.eval_shape(f, 2.0, 3)
    )
    seen: list[Any] = []

    def f(x: Any, n: Any) -> Any:
        # A module sized by x.shape: the creation pass needs an array, as JAX traces one.
        seen.append((_avals(x), _avals(n)))
        return (hk.get_parameter("w", x.shape, init=jnp.ones) * x**2).sum() * n

    hk.transform_with_state(lambda: run(jax, f)).init(None)
    expected = seen[0]
    seen.clear()
    with joh.context(), jax.checking_leaks():
        hk.transform_with_state(lambda: run(jo, f)).init(None)
    assert seen[0] == expected
