"""Linen adapter against Flax's semantics (issue 31, items 1-5): branches as alternatives,
zero-trip loops, modules from ``bind`` in a free function's loop, init passes' arguments.

Each test runs eager and under ``jax.jit`` where that applies, inside
``jax.checking_leaks()``, against the real Flax.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxoverride as jo
import jaxoverride_linen as jol
from _linen_models import leaves_are_arrays, shapes
from jaxoverride import lax as jlax

pytestmark = pytest.mark.usefixtures("linen_installed")

X = jnp.arange(4.0).reshape(2, 2)


def _eager_and_jitted(apply: Callable[..., Any], *args: Any) -> list[Any]:
    with jax.checking_leaks():
        return [apply(*args), jax.jit(apply)(*args)]


# -- 1. branches that create the same named submodule, or sow the same name -----------


class NamedBranches(nn.Module):
    """Flax's test_cond with jlax.cond: both branches create ``dense``."""

    @nn.compact
    def __call__(self, x: jax.Array, pred: Any) -> jax.Array:
        return jlax.cond(
            pred, lambda x: nn.Dense(2, name="dense")(x), lambda x: -nn.Dense(2, name="dense")(x), x
        )


class LinenNamedBranches(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array, pred: Any) -> jax.Array:
        true_fn = lambda m, x: nn.Dense(2, name="dense")(x)
        false_fn = lambda m, x: -nn.Dense(2, name="dense")(x)
        return nn.cond(pred, true_fn, false_fn, self, x)


@pytest.mark.parametrize("pred", [True, False])
def test_branches_creating_the_same_named_submodule_share_it_as_nn_cond(pred: bool):
    with jax.checking_leaks():
        variables = NamedBranches().init(jax.random.key(0), X, pred)
        expected = LinenNamedBranches().init(jax.random.key(0), X, pred)
    assert (
        shapes(variables)
        == shapes(expected)
        == {"params": {"dense": {"bias": (2,), "kernel": (2, 2)}}}
    )
    apply = lambda v, x: NamedBranches().apply(v, x, pred)
    linen = LinenNamedBranches().apply(variables, X, pred)
    for out in _eager_and_jitted(apply, variables, X):
        np.testing.assert_allclose(out, linen, rtol=1e-6)


@pytest.mark.parametrize("pred", [True, False])
def test_a_switch_whose_branches_share_a_named_submodule_matches_nn_switch(pred: bool):
    class Neutral(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array, i: Any) -> jax.Array:
            branches = [lambda x, k=k: k * nn.Dense(2, name="head")(x) for k in (1.0, 2.0, 3.0)]
            return jlax.switch(i, branches, x)

    class Linen(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array, i: Any) -> jax.Array:
            branches = [lambda m, x, k=k: k * nn.Dense(2, name="head")(x) for k in (1.0, 2.0, 3.0)]
            return nn.switch(i, branches, self, x)

    index = 2 if pred else 0
    with jax.checking_leaks():
        variables = Neutral().init(jax.random.key(0), X, index)
    assert shapes(variables) == shapes(Linen().init(jax.random.key(0), X, index))
    apply = lambda v, x: Neutral().apply(v, x, index)
    for out in _eager_and_jitted(apply, variables, X):
        np.testing.assert_allclose(out, Linen().apply(variables, X, index), rtol=1e-6)


class SowBoth(nn.Module):
    names: tuple[str, str] = ("h", "h")

    @nn.compact
    def __call__(self, x: jax.Array, pred: Any) -> jax.Array:
        def branch(name: str, sign: float) -> Callable[[jax.Array], jax.Array]:
            def run(x: jax.Array) -> jax.Array:
                self.sow("intermediates", name, sign * x)
                return sign * x

            return run

        first, second = self.names
        return jlax.cond(pred, branch(first, 1.0), branch(second, -1.0), x)


@pytest.mark.parametrize("pred", [True, False])
def test_branches_sowing_the_same_name_return_the_taken_branch_value(pred: bool):
    apply = lambda x: SowBoth().apply({}, x, pred, mutable=["intermediates"])
    for out, state in _eager_and_jitted(apply, X):
        assert leaves_are_arrays(state)
        np.testing.assert_allclose(state["intermediates"]["h"][0], X if pred else -X)
        np.testing.assert_allclose(out, X if pred else -X)


# -- 2. branches that sow different names ----------------------------------------------


@pytest.mark.parametrize("names", [("a", "b"), ("a", "a_only")])
@pytest.mark.parametrize("jitted", [False, True])
def test_branches_sowing_different_names_are_refused_as_nn_cond_refuses(
    names: tuple[str, str], jitted: bool
):
    apply = lambda x: SowBoth(names).apply({}, x, True, mutable=["intermediates"])
    with jax.checking_leaks(), pytest.raises(jol.LinenStateError) as raised:
        (jax.jit(apply) if jitted else apply)(X)
    message = str(raised.value)
    assert "branches first write different Linen variables" in message
    assert "intermediates/a" in message and f"intermediates/{names[1]}" in message
    assert "the same names in every branch" in message


def test_a_branch_that_sows_beside_one_that_does_not_is_refused():
    class OneSided(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            def sows(x: jax.Array) -> jax.Array:
                self.sow("intermediates", "h", x)
                return x

            return jlax.cond(True, sows, lambda x: -x, x)

    with jax.checking_leaks(), pytest.raises(jol.LinenStateError, match="branch 1 writes none"):
        OneSided().apply({}, X, mutable=["intermediates"])


# -- 3. a loop that runs zero times writes nothing ---------------------------------------


def _zero_trip_loops() -> dict[str, Callable[[Callable[[jax.Array], None], jax.Array], Any]]:
    def body_of(effect: Callable[[jax.Array], None]) -> Callable[[jax.Array], jax.Array]:
        def body(h: jax.Array) -> jax.Array:
            effect(h)
            return h + 1.0

        return body

    return {
        "scan": lambda e, x: jlax.scan(lambda c, r: (body_of(e)(c), None), x, jnp.zeros((0, 2)))[0],
        "scan_length": lambda e, x: jlax.scan(lambda c, _: (body_of(e)(c), None), x, length=0)[0],
        "fori_loop": lambda e, x: jlax.fori_loop(0, 0, lambda i, h: body_of(e)(h), x),
        "while_loop": lambda e, x: jlax.while_loop(lambda h: h.sum() < -1.0, body_of(e), x),
    }


class ZeroTrip(nn.Module):
    loop: str
    effect: str

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        def effect(h: jax.Array) -> None:
            if self.effect == "sow":
                self.sow("intermediates", "h", h)
            else:  # a variable first created (and written) inside the body
                count = self.variable("counters", "n", lambda: jnp.zeros((), jnp.int32))
                count.value += 1

        return _zero_trip_loops()[self.loop](effect, x)


@pytest.mark.parametrize("effect", ["sow", "counter"])
@pytest.mark.parametrize("loop", sorted(_zero_trip_loops()))
def test_a_loop_that_runs_zero_times_writes_nothing_eager(loop: str, effect: str):
    collection = "intermediates" if effect == "sow" else "counters"
    with jax.checking_leaks():
        out, state = ZeroTrip(loop, effect).apply({}, X, mutable=[collection])
    assert state == {}  # as a Python loop that runs zero times
    np.testing.assert_allclose(out, X)


@pytest.mark.parametrize("effect", ["sow", "counter"])
@pytest.mark.parametrize("loop", ["scan", "scan_length", "fori_loop"])
def test_a_loop_with_zero_trips_known_when_traced_writes_nothing_jitted(loop: str, effect: str):
    collection = "intermediates" if effect == "sow" else "counters"
    apply = lambda x: ZeroTrip(loop, effect).apply({}, x, mutable=[collection])
    with jax.checking_leaks():
        out, state = jax.jit(apply)(X)
    assert state == {}
    np.testing.assert_allclose(out, X)


def test_a_loop_that_runs_writes_what_its_last_step_sowed():
    """The written flag does not hide a sow of a loop that ran: a while_loop eagerly, a
    fori_loop with static bounds eagerly and jitted."""

    class Runs(nn.Module):
        loop: str

        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            def body(h: jax.Array) -> jax.Array:
                self.sow("intermediates", "h", h)
                return h + 1.0

            if self.loop == "fori_loop":
                return jlax.fori_loop(0, 2, lambda i, h: body(h), x)
            return jlax.while_loop(lambda h: h[0, 0] < 2.0, body, x)

    with jax.checking_leaks():
        out, state = Runs("while_loop").apply({}, X, mutable=["intermediates"])
    np.testing.assert_allclose(np.asarray(state["intermediates"]["h"][0]), out - 1.0)
    apply = lambda x: Runs("fori_loop").apply({}, x, mutable=["intermediates"])
    for out, state in _eager_and_jitted(apply, X):
        np.testing.assert_allclose(state["intermediates"]["h"][0], out - 1.0)


# -- 3, continued: a loop whose trip count is traced ------------------------------------

_TRACED_TRIPS: dict[str, Callable[..., Any]] = {
    "while_loop": lambda body, x, n: jlax.while_loop(lambda h: h[0, 0] < n, body, x),
    "fori_loop": lambda body, x, n: jlax.fori_loop(0, n, lambda i, h: body(h), x),
}
_LAST = {"reduce_fn": lambda _, new: new}  # a sow that keeps the newest value


class TracedTrips(nn.Module):
    """``n`` trips of a loop (of ``range(n)`` where ``loop="python"``); ``effect`` is what
    the body writes: a first ``sow`` or counter, or one created before the loop."""

    loop: str
    effect: str
    traced_inside: bool = False  # the loop inside jo.checkpoint (jo.jit runs inline)

    @nn.compact
    def __call__(self, x: jax.Array, n: Any) -> jax.Array:
        if self.effect == "sow_before":
            self.sow("intermediates", "h", x, **_LAST)
        if self.effect == "counter_before":
            self.put_variable("counters", "n", jnp.zeros((), jnp.int32))
        steps = self.variable("counters", "steps", lambda: jnp.zeros((), jnp.int32))

        def body(h: jax.Array) -> jax.Array:
            steps.value += 1  # exists before the loop: threaded, never refused
            if self.effect.startswith("sow"):
                self.sow("intermediates", "h", h, **_LAST)
            else:
                count = self.get_variable("counters", "n", jnp.zeros((), jnp.int32))
                self.put_variable("counters", "n", count + 1)
            return h + 1.0

        if self.loop == "python":
            for _ in range(int(n)):
                x = body(x)
            return x
        loop = lambda x, n: _TRACED_TRIPS[self.loop](body, x, n)
        return jo.checkpoint(loop)(x, n) if self.traced_inside else loop(x, n)


_MUTABLE = ["intermediates", "counters"]


def _python_result(effect: str, n: int) -> Any:
    with jax.checking_leaks():
        return TracedTrips("python", effect).apply({}, X, n, mutable=_MUTABLE)


def _assert_same(result: Any, expected: Any) -> None:
    assert jax.tree.structure(result) == jax.tree.structure(expected)
    jax.tree.map(np.testing.assert_allclose, result, expected)


@pytest.mark.parametrize("effect", ["sow", "counter"])
@pytest.mark.parametrize("loop", sorted(_TRACED_TRIPS))
def test_a_first_write_in_a_loop_whose_trip_count_is_traced_is_refused(loop: str, effect: str):
    """Whether the variable exists after the loop would depend on a traced value."""
    apply = lambda x, n: TracedTrips(loop, effect).apply({}, x, n, mutable=_MUTABLE)
    with jax.checking_leaks(), pytest.raises(jol.LinenStateError) as raised:
        jax.jit(apply)(X, 0)
    message = str(raised.value)
    path = "h in collection 'intermediates'" if effect == "sow" else "n in collection 'counters'"
    assert f"jaxoverride.lax.{loop}" in message and path in message
    assert "steps" not in message  # created before the loop: not refused
    assert "exist before it" in message and "before the loop" in message
    assert "fori_loop with static bounds" in message
    # Eagerly the trip count is concrete: Python's result for 0 trips (and for 3, for
    # the sow that keeps the last value; a counter first written in the body restarts
    # each step, as docs/linen.md says).
    for n in (0, 3) if effect == "sow" else (0,):
        with jax.checking_leaks():
            _assert_same(apply(X, n), _python_result(effect, n))


@pytest.mark.parametrize("loop", sorted(_TRACED_TRIPS))
def test_a_refused_loop_leaves_the_bound_modules_variables_as_they_were(loop: str):
    variables = {"counters": {"steps": jnp.int32(5)}}
    bound = TracedTrips(loop, "sow", traced_inside=True).bind(variables, mutable=_MUTABLE)
    before = jax.tree.map(np.asarray, bound.variables)
    with jax.checking_leaks(), pytest.raises(jol.LinenStateError, match="trip count"):
        bound(X, 3)
    assert leaves_are_arrays(bound.variables)
    _assert_same(jax.tree.map(np.asarray, bound.variables), before)
    # Nothing was sown by the refused call: an eager loop now sows once, as Python.
    eager = TracedTrips(loop, "sow").bind(bound.variables, mutable=_MUTABLE)
    with jax.checking_leaks():
        eager(X, 3)
    expected = _python_result("sow", 3)[1]
    expected["counters"]["steps"] = expected["counters"]["steps"] + 5
    _assert_same(dict(eager.variables), expected)


@pytest.mark.parametrize("n", [0, 3])
@pytest.mark.parametrize("effect", ["sow_before", "counter_before"])
@pytest.mark.parametrize("loop", sorted(_TRACED_TRIPS))
def test_the_documented_fix_creating_the_variable_before_the_loop_gives_pythons_result(
    loop: str, effect: str, n: int
):
    apply = lambda x, n: TracedTrips(loop, effect).apply({}, x, n, mutable=_MUTABLE)
    for result in _eager_and_jitted(apply, X, n):
        _assert_same(result, _python_result(effect, n))
    text = " ".join((Path(__file__).parents[1] / "docs" / "linen.md").read_text().split())
    assert "whose trip count is traced" in text and "create it before the loop" in text


def test_init_under_jit_still_creates_what_a_traced_trip_count_loop_body_creates():
    """A guard: the creation pass at init makes the body's parameters and its counter
    (which has an initializer), so apply's loop finds them before it: not refused."""

    class Creates(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array, n: Any) -> jax.Array:
            def body(h: jax.Array) -> jax.Array:
                count = self.variable("counters", "n", lambda: jnp.zeros((), jnp.int32))
                count.value += 1
                return nn.Dense(2, name="dense")(h) * 0.0 + h + 1.0

            return jlax.while_loop(lambda h: h[0, 0] < n, body, x)

    with jax.checking_leaks():
        variables = jax.jit(Creates().init)(jax.random.key(0), X, 0)
        assert shapes(variables) == {
            "counters": {"n": ()},
            "params": {"dense": {"bias": (2,), "kernel": (2, 2)}},
        }
        apply = lambda v, n: Creates().apply(v, X, n, mutable=["counters"])[1]
        for n in (0, 3):
            assert int(jax.jit(apply)(variables, n)["counters"]["n"]) == n


# -- 4. a module from bind, in a free function's neutral loop ---------------------------


class Normed(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.BatchNorm(use_running_average=False)(x)


class Pair(nn.Module):
    def setup(self) -> None:
        self.dense = nn.Dense(2)
        self.norm = nn.BatchNorm(use_running_average=False)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.norm(self.dense(x))


_FREE_LOOPS: dict[str, Callable[[Callable[[jax.Array], jax.Array], jax.Array], Any]] = {
    "scan": lambda f, xs: jlax.scan(lambda c, x: (c, f(x)), None, xs)[1],
    "jit": lambda f, xs: jo.jit(lambda x: f(x))(xs[0]),
    "jax.jit": lambda f, xs: jax.jit(lambda x: f(x))(xs[0]),
}


@pytest.mark.parametrize("loop", sorted(_FREE_LOOPS))
@pytest.mark.parametrize("which", ["module", "submodule"])
def test_a_bound_module_written_in_a_free_functions_loop_is_refused_at_the_write(
    loop: str, which: str
):
    xs = jnp.arange(12.0).reshape(3, 2, 2)
    model = Normed() if which == "module" else Pair()
    variables = model.init(jax.random.key(0), xs[0])
    bound = model.bind(variables, mutable="batch_stats")
    call = bound if which == "module" else (lambda x: bound.norm(bound.dense(x)))
    before = jax.tree.map(np.asarray, bound.variables)
    with jax.checking_leaks(), pytest.raises(jol.LinenStateError) as raised:
        _FREE_LOOPS[loop](call, xs)
    message = str(raised.value)
    assert "batch_stats/" in message and ".bind()" in message
    assert "raw JAX" not in message  # not the missing-adapter message
    # Nothing leaked into the module, and it still runs.
    assert leaves_are_arrays(bound.variables)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, bound.variables), before)
    with jax.checking_leaks():
        assert call(xs[0]).shape == (2, 2)
    assert leaves_are_arrays(bound.variables)


def test_a_bound_module_read_in_a_free_functions_loop_still_works():
    xs = jnp.arange(12.0).reshape(3, 2, 2)
    variables = Pair().init(jax.random.key(0), xs[0])
    bound = Pair().bind(variables).dense  # reads only
    with jax.checking_leaks():
        ys = jlax.scan(lambda c, x: (c, bound(x)), None, xs)[1]
        again = bound(xs[0])
    np.testing.assert_allclose(ys[0], again, rtol=1e-6)


# -- 5. the creation pass of a transform gets the arguments JAX would pass -------------


class Scaled(nn.Module):
    transform: str

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dense = nn.Dense(2)
        f = lambda h, s: dense(h) * s.astype(h.dtype)
        if self.transform == "checkpoint":
            return jo.checkpoint(f)(x, 2.0)
        if self.transform == "remat":
            return jo.remat(f)(x, 2.0)
        if self.transform == "grad":
            return jo.grad(lambda s, h: f(h, s).sum())(2.0, x) + dense(x)
        if self.transform == "vjp":
            return jo.vjp(lambda s: f(x, s), 2.0)[0]
        if self.transform == "jvp":
            return jo.jvp(lambda s: f(x, s), (2.0,), (1.0,))[0]
        return jnp.zeros(jo.eval_shape(f, x, 2.0).shape) + dense(x)


@pytest.mark.parametrize("transform", ["checkpoint", "remat", "grad", "vjp", "jvp", "eval_shape"])
def test_the_creation_pass_gets_arrays_as_jax_passes_them(transform: str):
    model = Scaled(transform)
    with jax.checking_leaks():
        variables = model.init(jax.random.key(0), X)
        jitted = jax.jit(model.init)(jax.random.key(0), X)
    assert (
        shapes(variables)
        == shapes(jitted)
        == {"params": {"Dense_0": {"bias": (2,), "kernel": (2, 2)}}}
    )
    outs = _eager_and_jitted(model.apply, variables, X)
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-6)


# -- 6 and 7: documented behaviour (docs/linen.md) --------------------------------------

_ADD = {"reduce_fn": lambda a, b: a + b, "init_fn": lambda: jnp.zeros(())}


class SumSow(nn.Module):
    sow_before: bool

    @nn.compact
    def __call__(self, xs: jax.Array) -> jax.Array:
        if self.sow_before:
            self.sow("intermediates", "total", jnp.zeros(()), **_ADD)

        def body(c: jax.Array, x: jax.Array) -> Any:
            self.sow("intermediates", "total", x, **_ADD)
            return c, None

        return jlax.scan(body, 0.0, xs)[0]


@pytest.mark.parametrize(("sow_before", "total"), [(False, 4.0), (True, 7.0)])
def test_a_reducing_sow_in_a_loop_keeps_the_last_step_unless_sown_before_as_documented(
    sow_before: bool, total: float
):
    xs = jnp.array([1.0, 2.0, 4.0])
    apply = lambda xs: SumSow(sow_before).apply({}, xs, mutable=["intermediates"])
    for _, state in _eager_and_jitted(apply, xs):
        assert float(state["intermediates"]["total"]) == total
    text = (Path(__file__).parents[1] / "docs" / "linen.md").read_text()
    assert "sow an initial value before the loop" in text


def test_init_values_differ_from_a_python_loop_by_the_creation_salt_as_documented():
    class Neutral(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            dense = nn.Dense(2)
            return jlax.fori_loop(0, 2, lambda i, h: dense(h), x)

    class Python(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            dense = nn.Dense(2)
            for _ in range(2):
                x = dense(x)
            return x

    neutral = Neutral().init(jax.random.key(0), X)
    python = Python().init(jax.random.key(0), X)
    assert shapes(neutral) == shapes(python)  # the names and shapes are Linen's
    assert not np.allclose(
        neutral["params"]["Dense_0"]["kernel"], python["params"]["Dense_0"]["kernel"]
    )
    text = (Path(__file__).parents[1] / "docs" / "linen.md").read_text()
    assert "salted" in text and "not the initial *values*" in text
