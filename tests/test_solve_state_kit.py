"""``jaxoverride.solve_state`` in the kit, on a toy framework: the semantics, once.

The toy keeps an rng key, a running mean and a call counter in a dict; its source is the
kit's ``DictStateSource`` plus the state description (``framework``, ``parts``) and it
registers with ``register_solve_source``. Its map draws a dropout-like mask per
evaluation (recorded by a host callback), updates the running mean (an EMA of its input)
and counts its calls: what a DEQ with dropout and BatchNorm does inside a solver.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

import jaxoverride as jo
from _parity import program_text
from _solve_state_solvers import checking_leaks_linearized
from jaxoverride import adapter_kit as kit

MOMENTUM = 0.9


TOY = "toy-solve"


class ToySource(kit.DictStateSource):
    framework = TOY

    def parts(self, state: Any) -> list[kit.StatePart | None]:
        paths, _ = jax.tree_util.tree_flatten_with_path(state)
        kinds = {"key": "rng", "mean": "state", "calls": "state"}
        return [kit.StatePart(kinds[p[0].key], (p[0].key,), p[0].key) for p, _ in paths]


class Toy:
    """The framework: one store, running while ``running`` is set."""

    def __init__(self) -> None:
        self.store: dict[str, Any] = {}
        self.running = False
        self.masks: list[bytes] = []

    def reset(self) -> None:
        self.store.update(key=jax.random.key(0), mean=jnp.zeros(3), calls=jnp.int32(0))
        self.masks.clear()

    def source(self) -> ToySource | None:
        return ToySource(self.store) if self.running else None

    def f(self, z: jax.Array) -> jax.Array:
        """The map: a mask from the key sequence, the EMA of ``z``, a call count."""
        key, sub = jax.random.split(self.store["key"])
        self.store["key"] = key
        mask = jax.random.bernoulli(sub, 0.7, z.shape)
        jax.debug.callback(lambda m: self.masks.append(np.asarray(m).tobytes()), mask)
        self.store["mean"] = MOMENTUM * self.store["mean"] + (1 - MOMENTUM) * z
        self.store["calls"] = self.store["calls"] + 1
        return 0.5 * jnp.cos(jnp.where(mask, z, 0.0)) + 0.2

    def distinct_masks(self) -> int:
        jax.effects_barrier()
        return len(set(self.masks))


@pytest.fixture
def toy() -> Iterator[Toy]:
    framework = Toy()
    framework.reset()
    kit.register_solve_source(TOY, framework.source)
    active = lambda: framework.running
    source = lambda where: ToySource(framework.store)
    table = kit.threaded_control_flow(active, source)
    table |= kit.stateful_transforms(
        kit.source_transform_state(active, source), lambda where, error: error
    )
    table |= kit.conversion_overrides(active, _refusing, source=source)
    framework.running = True
    try:
        with jo.override_context(table):
            yield framework
    finally:
        framework.running = False
        kit.unregister_solve_source(TOY)


class _Refused(Exception):
    pass


def _refusing(where: str, fun: Any, trace: Any, creation: Any) -> Any:
    """The toy's conversion outside a declaration: a write or draw is refused (here,
    crudely: the toy's map always writes, so any conversion of it is)."""
    raise _Refused(f"{where}: the map writes; declare jaxoverride.solve_state()")


def forward(toy: Toy, z0: jax.Array, tol: float = 1e-6) -> tuple[jax.Array, jax.Array]:
    """Plain iteration in a ``while_loop``, as fpsolve's ``forward``."""

    def body(carry: Any) -> Any:
        z, _, i = carry
        fz = toy.f(z)
        return fz, jnp.linalg.norm(fz - z), i + 1

    z, _, steps = jo.lax.while_loop(
        lambda c: (c[1] > tol) & (c[2] < 200), body, (z0, jnp.float32(jnp.inf), 0)
    )
    return z, steps


def anderson_like(toy: Toy, z0: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A direct evaluation before the loop (fpsolve's Anderson computes ``f(z0)`` first)."""
    z1 = toy.f(z0)
    return forward(toy, z1)


def newton_like(toy: Toy, z0: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A neutral transform then a direct evaluation in one body (Newton's Jacobian, then
    its residual): both see the entry rng."""

    def body(carry: Any) -> Any:
        z, _, i = carry
        jacobian = jo.jacfwd(toy.f)(z)
        fz = toy.f(z)
        step = jnp.linalg.solve(jacobian - jnp.eye(z.size), -(fz - z))
        return z + step, jnp.linalg.norm(fz - z), i + 1

    z, _, steps = jo.lax.while_loop(
        lambda c: (c[1] > 1e-6) & (c[2] < 50), body, (z0, jnp.float32(jnp.inf), 0)
    )
    return z, steps


def fixed_mask_twin(toy_key: jax.Array, z0: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The hand-written twin: the key split once before the loop, passed in."""
    key, sub = jax.random.split(toy_key)
    mask = jax.random.bernoulli(sub, 0.7, z0.shape)

    def g(z: jax.Array) -> jax.Array:
        return 0.5 * jnp.cos(jnp.where(mask, z, 0.0)) + 0.2

    def body(carry: Any) -> Any:
        z, _, i = carry
        fz = g(z)
        return fz, jnp.linalg.norm(fz - z), i + 1

    z, _, steps = jax.lax.while_loop(
        lambda c: (c[1] > 1e-6) & (c[2] < 200), body, (z0, jnp.float32(jnp.inf), 0)
    )
    return z, steps, key


SOLVERS = {"forward": forward, "anderson_like": anderson_like, "newton_like": newton_like}


@pytest.mark.parametrize("solver", sorted(SOLVERS))
@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_one_mask_per_solve_and_state_at_the_solution(toy: Toy, solver: str, jitted: bool) -> None:
    run = SOLVERS[solver]
    key0 = toy.store["key"]

    def solve(z0: jax.Array) -> tuple[jax.Array, jax.Array]:
        with jo.solve_state(state={"mean": "at_solution"}):
            return run(toy, z0)

    z, steps = _solved(toy, solve, jitted)
    assert toy.distinct_masks() == 1
    # The stream advanced once, as if the map had been called once.
    expected_key, _ = jax.random.split(key0)
    np.testing.assert_array_equal(
        jax.random.key_data(toy.store["key"]), jax.random.key_data(expected_key)
    )
    # One EMA update, from the entry mean, at the last forward evaluation's input (z*).
    np.testing.assert_allclose(toy.store["mean"], (1 - MOMENTUM) * z, atol=1e-5)
    # The counter is per evaluation: every evaluation counted.
    assert int(toy.store["calls"]) > 2
    if solver == "forward":
        twin_z, twin_steps, _ = fixed_mask_twin(key0, jnp.ones(3))
        np.testing.assert_allclose(z, twin_z, atol=1e-6)
        assert int(steps) == int(twin_steps)
    # The next forward call gets a fresh mask.
    toy.masks.clear()
    solve(jnp.ones(3))
    jax.effects_barrier()
    assert len(set(toy.masks)) == 1


def _solved(toy: Toy, solve: Any, jitted: bool) -> tuple[jax.Array, jax.Array]:
    """``solve(ones)``, eager or under ``jax.jit`` (the store passed in and written back),
    inside ``jax.checking_leaks()``."""
    with jax.checking_leaks():
        if not jitted:
            return solve(jnp.ones(3))
        z, steps, store = jax.jit(lambda z0, s: _with_store(toy, s, solve, z0))(
            jnp.ones(3), dict(toy.store)
        )
    toy.store.update(store)
    return z, steps


def _with_store(toy: Toy, store: dict[str, Any], solve: Any, z0: jax.Array) -> Any:
    saved = dict(toy.store)
    toy.store.update(store)
    try:
        z, steps = solve(z0)
        return z, steps, dict(toy.store)
    finally:
        toy.store.clear()
        toy.store.update(saved)


def test_without_the_declaration_each_evaluation_draws_anew(toy: Toy) -> None:
    forward(toy, jnp.ones(3))
    assert toy.distinct_masks() > 5  # today's eager-Python semantics, kept


def test_per_evaluation_is_an_explicit_choice_per_part(toy: Toy) -> None:
    key0 = toy.store["key"]
    with jo.solve_state(rng="per_evaluation", state={"mean": "at_solution"}):
        z, steps = forward(toy, jnp.ones(3))
    assert toy.distinct_masks() > 5
    assert not np.array_equal(
        jax.random.key_data(toy.store["key"]), jax.random.key_data(jax.random.split(key0)[0])
    )
    # One EMA update from zero (the map's values lie in [0.2, 0.7]), not an average over
    # every evaluation (which would be near the iterates themselves).
    assert float(jnp.max(toy.store["mean"])) <= (1 - MOMENTUM) * 0.7 + 1e-6
    assert int(toy.store["calls"]) == int(steps)
    del z


def test_the_short_form_freezes_every_state_part(toy: Toy) -> None:
    with jo.solve_state():
        forward(toy, jnp.ones(3))
    assert int(toy.store["calls"]) == 1  # at the solution: one call's count


def test_a_failure_leaves_the_state_as_at_entry(toy: Toy) -> None:
    before = dict(toy.store)

    def failing(z: jax.Array) -> None:
        with jo.solve_state():
            forward(toy, z)
            toy.f(z)
            raise RuntimeError("inside the solve")

    with pytest.raises(RuntimeError, match="inside the solve"):
        failing(jnp.ones(3))
    assert all(toy.store[k] is before[k] for k in before)


def test_the_declaration_is_a_decorator(toy: Toy) -> None:
    @jo.solve_state()
    def solve(z0: jax.Array) -> Any:
        return forward(toy, z0)

    solve(jnp.ones(3))
    assert toy.distinct_masks() == 1


def test_a_backward_calls_writes_are_dropped(toy: Toy) -> None:
    with jo.solve_state():
        source = ToySource(toy.store)
        thread = kit.Threaded(source, 1, "test", backward=True)
        _, after = thread.run(0, source.read(), toy.f, jnp.ones(3))
        thread.finish(after)
        mean_inside = toy.store["mean"]
    np.testing.assert_array_equal(mean_inside, jnp.zeros(3))
    np.testing.assert_array_equal(toy.store["mean"], jnp.zeros(3))


def test_with_no_framework_running_the_jaxpr_is_unchanged() -> None:
    def solve(z0: jax.Array) -> Any:
        return jo.lax.while_loop(lambda z: z.sum() < 10, lambda z: z * 2, z0)

    def declared(z0: jax.Array) -> Any:
        with jo.solve_state():
            return solve(z0)

    assert program_text(jax.make_jaxpr(declared)(jnp.ones(3))) == program_text(
        jax.make_jaxpr(solve)(jnp.ones(3))
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"rng": "once"}, ValueError, r"rng= is 'once'; expected one of \['per_solve'"),
        ({"state": {"batch_stats": "last"}}, ValueError, r"state\['batch_stats'\] is 'last'"),
        ({"state": {3: "at_solution"}}, TypeError, "names 3, a int"),
    ],
)
def test_bad_policies_are_refused_with_the_fix(kwargs: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        jo.solve_state(**kwargs)


def test_a_name_no_framework_has_is_refused_and_nothing_is_entered(toy: Toy) -> None:
    with pytest.raises(ValueError, match=r"names \[\"state 'batch_stat'\"\].*'mean'"):
        with jo.solve_state(state={"batch_stat": "at_solution"}):
            pass
    forward(toy, jnp.ones(3))
    assert toy.distinct_masks() > 5  # the refused declaration left nothing active


def _loop(g: Any, z0: jax.Array) -> jax.Array:
    def body(carry: Any) -> Any:
        z, _, i = carry
        gz = g(z)
        return gz, jnp.linalg.norm(gz - z), i + 1

    init = (z0, jnp.float32(jnp.inf), 0)
    return jo.lax.while_loop(lambda c: (c[1] > 1e-7) & (c[2] < 200), body, init)[0]


def test_a_converted_map_runs_declared_and_keeps_its_last_write(toy: Toy) -> None:
    with pytest.raises(_Refused, match=r"declare jaxoverride\.solve_state"):
        jo.closure_convert(toy.f, jnp.ones(3))
    with jax.checking_leaks(), jo.solve_state():
        converted, constants = jo.closure_convert(toy.f, jnp.ones(3))
        z = _loop(lambda z: converted(z, *constants), jnp.ones(3))
    assert toy.distinct_masks() == 1
    np.testing.assert_allclose(toy.store["mean"], (1 - MOMENTUM) * z, atol=1e-6)
    assert int(toy.store["calls"]) == 1


def test_custom_root_under_a_declaration_one_mask_and_the_implicit_gradient(toy: Toy) -> None:
    key0 = toy.store["key"]

    def root(scale: jax.Array) -> jax.Array:
        def residual(z: jax.Array) -> jax.Array:
            return scale * toy.f(z) - z

        def solve(g: Any, z0: jax.Array) -> jax.Array:
            return _loop(lambda z: g(z) + z, z0)

        tangent = lambda g, y: jnp.linalg.solve(jax.jacobian(g)(y), y)
        with jo.solve_state():
            return jo.lax.custom_root(residual, jnp.ones(3), solve, tangent)

    with checking_leaks_linearized():
        z, grad = jax.value_and_grad(lambda s: root(s).sum())(jnp.float32(1.0))
    assert toy.distinct_masks() == 1
    # The fixed-mask twin: the same mask, the map unrolled, differentiated by JAX.
    _, sub = jax.random.split(key0)
    mask = jax.random.bernoulli(sub, 0.7, (3,))

    def unrolled(scale: jax.Array) -> jax.Array:
        g = lambda z: scale * (0.5 * jnp.cos(jnp.where(mask, z, 0.0)) + 0.2)
        return jax.lax.fori_loop(0, 200, lambda _, z: g(z), jnp.ones(3)).sum()

    twin_z, twin_grad = jax.value_and_grad(unrolled)(jnp.float32(1.0))
    np.testing.assert_allclose(z, twin_z, atol=1e-5)
    np.testing.assert_allclose(grad, twin_grad, atol=1e-5)
    # The statistics: one update, at the last forward evaluation inside the solve.
    np.testing.assert_allclose(toy.store["mean"].sum(), (1 - MOMENTUM) * twin_z, atol=1e-5)


class _Sourceless(kit.Framework):
    """A registered framework whose adapter registers no solve source, running while
    ``running`` is set."""

    key = "solve_state_test_sourceless"
    module = "jax"  # always imported: the record is live
    title = "Sourceless (a test framework)"
    fix = "nothing"
    label = "sourceless"
    now = False

    def running(self) -> bool:
        return self.now


def test_a_running_framework_whose_adapter_has_no_solve_source_is_refused() -> None:
    """A framework whose adapter applies no declaration: while it runs, the declaration
    is refused by name, never silently ignored (a new mask per evaluation); the registry,
    the contexts and the framework's state are as before."""
    from jaxoverride import _frameworks, _solve_state

    record = _Sourceless()
    kit.register_framework(record)
    try:
        with jo.solve_state():  # registered, not running: accepted
            pass
        record.now = True
        with pytest.raises(NotImplementedError, match="Sourceless") as info:
            with jo.solve_state():
                pass
        assert "solve source" in str(info.value) and "pass it through" in str(info.value)
        assert _solve_state.current() is None  # the refused declaration was not entered
    finally:
        record.now = False
        with _frameworks._lock:
            _frameworks.registered.pop(record.key, None)
            _frameworks.labels.pop(record.key, None)
            _frameworks._set_live_locked()


@pytest.mark.parametrize("framework", ["haiku", "linen", "nnx"])
def test_every_built_in_stateful_adapter_registers_a_solve_source(framework: str) -> None:
    """Haiku, Linen and NNX apply declarations: none is refused while it runs."""
    pytest.importorskip({"haiku": "haiku", "linen": "flax", "nnx": "flax"}[framework])
    import importlib

    importlib.import_module(f"jaxoverride_{framework}")
    from jaxoverride.adapter_kit import _solve_policy

    assert framework in _solve_policy._sources


# -- jaxoverride.solver_map: a map called directly, each call one evaluation ------------


def newton_direct(f: Any, z0: jax.Array) -> tuple[jax.Array, jax.Array]:
    """fpsolve's Newton's shape: one loop body calls the map twice directly (the step's
    ``f(z)``, then the residual's ``f(z_new)``), with no neutral call between them."""

    def body(carry: Any) -> Any:
        z, _, i = carry
        z_new = f(z)  # a damped fixed-point step stands for Newton's
        return z_new, jnp.linalg.norm(f(z_new) - z_new), i + 1

    init = (z0, jnp.float32(jnp.inf), 0)
    z, _, steps = jo.lax.while_loop(lambda c: (c[1] > 1e-6) & (c[2] < 200), body, init)
    return z, steps


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("marked", ["by_the_model", "by_the_solver", "unmarked"])
def test_solver_map_makes_each_direct_call_one_evaluation(
    toy: Toy, marked: str, jitted: bool
) -> None:
    key0 = toy.store["key"]

    def solver(f: Any, z0: jax.Array) -> tuple[jax.Array, jax.Array]:
        return newton_direct(jo.solver_map(f) if marked == "by_the_solver" else f, z0)

    def solve(z0: jax.Array) -> tuple[jax.Array, jax.Array]:
        with jo.solve_state(state={"mean": "at_solution"}):
            return solver(jo.solver_map(toy.f) if marked == "by_the_model" else toy.f, z0)

    with jax.checking_leaks():
        if jitted:
            run = jax.jit(lambda z0, s: _with_store(toy, s, solve, z0))
            z, steps, store = run(jnp.ones(3), dict(toy.store))
            toy.store.update(store)
        else:
            z, steps = solve(jnp.ones(3))
    key_data = lambda key: np.asarray(jax.random.key_data(key))
    expected_key, sub = jax.random.split(key0)
    mask = np.asarray(jax.random.bernoulli(sub, 0.7, (3,)))
    jax.effects_barrier()
    if marked == "unmarked":
        # The two calls are one run of the stream: the second draws the next key (its
        # mask may equal the first's by chance, 3 entries), and the stream moved twice.
        np.testing.assert_array_equal(
            key_data(toy.store["key"]), key_data(jax.random.split(expected_key)[0])
        )
        return
    assert set(toy.masks) == {mask.tobytes()}  # every evaluation: the entry key's mask
    # the fixed-mask twin's iterations and fixed point
    twin = lambda z: 0.5 * jnp.cos(jnp.where(mask, z, 0.0)) + 0.2
    twin_z, twin_steps = newton_direct(twin, jnp.ones(3))
    assert int(steps) == int(twin_steps)
    np.testing.assert_allclose(z, twin_z, atol=1e-6)
    # the stream advanced once; the mean is one EMA update from the entry's, at the last
    # evaluation's input (the residual's f(z_new), z_new = z*)
    np.testing.assert_array_equal(key_data(toy.store["key"]), key_data(expected_key))
    np.testing.assert_allclose(toy.store["mean"], (1 - MOMENTUM) * z, atol=1e-6)
    assert int(toy.store["calls"]) == 2 * int(steps)  # per evaluation: each counted


def test_solver_map_called_eagerly_starts_each_call_from_the_entry_state(toy: Toy) -> None:
    f = jo.solver_map(toy.f)
    with jo.solve_state():
        first = f(jnp.ones(3))
        second = f(jnp.full(3, 2.0))
        inside = dict(toy.store)  # live: the entry state again between evaluations
    assert toy.distinct_masks() == 1
    assert float(inside["mean"].sum()) == 0.0 and int(inside["calls"]) == 0
    # at exit: the last evaluation's state (one update at its input, one call)
    np.testing.assert_allclose(toy.store["mean"], (1 - MOMENTUM) * 2.0, atol=1e-6)
    assert int(toy.store["calls"]) == 1
    del first, second


def test_solver_map_in_a_backward_pass_keeps_nothing(toy: Toy) -> None:
    f = jo.solver_map(toy.f)
    with jo.solve_state():
        source = ToySource(toy.store)
        thread = kit.Threaded(source, 1, "test", backward=True)
        _, after = thread.run(0, source.read(), lambda z: f(f(z)), jnp.ones(3))
        thread.finish(after)
    np.testing.assert_array_equal(toy.store["mean"], jnp.zeros(3))
    assert int(toy.store["calls"]) == 0


def test_solver_map_failing_leaves_the_live_state_as_it_was(toy: Toy) -> None:
    def failing(z: jax.Array) -> jax.Array:
        toy.f(z)
        raise RuntimeError("in the map")

    before = dict(toy.store)
    with jo.solve_state():
        toy.f(jnp.ones(3))  # a direct call: the live state moved
        moved = dict(toy.store)
        with pytest.raises(RuntimeError, match="in the map"):
            jo.solver_map(failing)(jnp.ones(3))
        assert all(toy.store[k] is moved[k] for k in moved)
    with pytest.raises(RuntimeError, match="in the map"):
        with jo.solve_state():
            jo.solver_map(failing)(jnp.ones(3))
    assert int(toy.store["calls"]) == 1 and before["calls"] is not toy.store["calls"]


def _marked_program(marked: bool, declared: bool) -> Any:
    def g(z: jax.Array) -> jax.Array:
        return 0.5 * jnp.cos(z) + 0.2

    f = jo.solver_map(g) if marked else g

    def program(z0: jax.Array) -> jax.Array:
        with jo.solve_state() if declared else contextlib.nullcontext():
            return newton_direct(lambda z: f(z), z0)[0] + f(z0)

    return program


@pytest.mark.parametrize("declared", [False, True])
def test_solver_map_idle_is_the_same_jaxpr(declared: bool) -> None:
    jaxprs = {
        m: program_text(jax.make_jaxpr(_marked_program(m, declared))(jnp.ones(3)))
        for m in (False, True)
    }
    assert jaxprs[False] == jaxprs[True]


def test_solver_map_under_a_framework_with_nothing_declared_is_the_same_jaxpr(toy: Toy) -> None:
    # The toy runs (its loops thread its state) but no declaration: the marker calls f.
    program = lambda m: jax.make_jaxpr(_marked_program(m, declared=False))(jnp.ones(3))
    assert program_text(program(False)) == program_text(program(True))


def test_solver_map_marks_once_and_equals_another_marking() -> None:
    def g(z: jax.Array) -> jax.Array:
        return z

    f = jo.solver_map(g)
    assert jo.solver_map(f) is f
    assert f == jo.solver_map(g) and hash(f) == hash(jo.solver_map(g))
    assert f != jo.solver_map(lambda z: z)
    assert f.__name__ == "g" and f.__wrapped__ is g  # type: ignore[attr-defined]


def _converted_by_make_jaxpr(f: Any, example: jax.Array) -> Any:
    """Equinox's ``filter_closure_convert``, in short: the map traced by (the neutral)
    ``make_jaxpr``, its jaxpr evaluated equation by equation at each call."""
    closed = jo.make_jaxpr(f)(example)
    return lambda z: jax.extend.core.jaxpr_as_fun(closed)(z)[0]


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_a_map_converted_by_make_jaxpr_keeps_its_last_forward_write(toy: Toy, jitted: bool) -> None:
    key0 = toy.store["key"]

    def solve(z0: jax.Array) -> tuple[jax.Array, jax.Array]:
        with jo.solve_state():
            g = _converted_by_make_jaxpr(toy.f, z0)

            def body(z: jax.Array) -> jax.Array:
                # a JAX-internal evaluation in the body (a JVP, as a Newton Jacobian or a
                # linearisation takes) is no forward evaluation: it keeps nothing
                jax.jvp(g, (z,), (jnp.ones_like(z),))
                return g(z)

            return _loop(body, z0), z0

    z, _ = _solved(toy, solve, jitted)
    assert toy.distinct_masks() == 1
    # One EMA update at z*, the stream advanced once, one call: the last forward
    # evaluation's writes, handed out of the jaxpr.
    np.testing.assert_allclose(toy.store["mean"], (1 - MOMENTUM) * z, atol=1e-6)
    expected_key, _ = jax.random.split(key0)
    np.testing.assert_array_equal(
        jax.random.key_data(toy.store["key"]), jax.random.key_data(expected_key)
    )
    assert int(toy.store["calls"]) == 1
    twin_z, _, _ = fixed_mask_twin(key0, jnp.ones(3))
    np.testing.assert_allclose(z, twin_z, atol=1e-6)


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_a_function_converted_after_an_evaluation_hands_out_only_its_own_writes(
    toy: Toy, jitted: bool
) -> None:
    # As equinox converts a loop's test inside diffrax's step, after the step evaluated
    # the map: the test, which writes nothing, is handed what that evaluation left; it
    # must not hand that out of its jaxpr at each evaluation, over what the evaluations
    # since then wrote (on main the mean ended at the first evaluation's update).
    def solve(z0: jax.Array) -> tuple[jax.Array, jax.Array]:
        with jo.solve_state():
            g = _converted_by_make_jaxpr(toy.f, z0)
            z1 = g(z0)
            test = _converted_by_make_jaxpr(lambda z: 2.0 * z, z0)
            return _loop(lambda z: 0.5 * test(g(z)), z1), z0

    z, _ = _solved(toy, solve, jitted)
    assert toy.distinct_masks() == 1
    np.testing.assert_allclose(toy.store["mean"], (1 - MOMENTUM) * z, atol=1e-6)
    assert int(toy.store["calls"]) == 1


def test_a_map_converted_by_make_jaxpr_under_jit_grad_as_the_unrolled_twin(toy: Toy) -> None:
    key0 = toy.store["key"]

    def loss(scale: jax.Array, store: dict[str, Any]) -> Any:
        def solve(z0: jax.Array) -> tuple[jax.Array, jax.Array]:
            with jo.solve_state():
                g = _converted_by_make_jaxpr(lambda z: scale * toy.f(z), z0)
                return jo.lax.fori_loop(0, 60, lambda _, z: g(z), z0), z0

        z, _, after = _with_store(toy, store, solve, jnp.ones(3))
        return z.sum(), (z, after)

    with jax.checking_leaks():
        grad, (z, store) = jax.jit(jax.grad(loss, has_aux=True))(jnp.float32(1.0), dict(toy.store))
    assert toy.distinct_masks() == 1
    _, sub = jax.random.split(key0)
    mask = jax.random.bernoulli(sub, 0.7, (3,))

    def unrolled(scale: jax.Array) -> jax.Array:
        g = lambda z: scale * (0.5 * jnp.cos(jnp.where(mask, z, 0.0)) + 0.2)
        return jax.lax.fori_loop(0, 60, lambda _, z: g(z), jnp.ones(3))

    twin_grad = jax.grad(lambda s: unrolled(s).sum())(jnp.float32(1.0))
    np.testing.assert_allclose(grad, twin_grad, atol=1e-5)
    # The statistics: one update, at the last forward evaluation's input (the 60th
    # iterate's predecessor: the map's input), not at a JVP's re-evaluation.
    z59 = jax.lax.fori_loop(
        0, 59, lambda _, z: 0.5 * jnp.cos(jnp.where(mask, z, 0.0)) + 0.2, jnp.ones(3)
    )
    np.testing.assert_allclose(store["mean"], (1 - MOMENTUM) * z59, atol=1e-5)
    assert int(store["calls"]) == 1
    del z
