"""jaxoverride_debug.trace: records, transparency, composition with adapters, progress bars."""

from __future__ import annotations

import io
import logging
import re
import subprocess
import sys
import threading
import warnings

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

import jaxoverride as jo
import jaxoverride_debug as jd
import jaxoverride_haiku as joh
import jaxoverride_nnx
from _parity import JAX, assert_same
from jaxoverride import _stack, lax as jlax
from jaxoverride._compat import jaxprs_in_params
from jaxoverride_debug._describe import describe_leaf
from jaxoverride_debug._layer import _SESSION
from test_parity_lax import CASES as LAX_CASES
from test_parity_rules import CASES as RULE_CASES
from test_parity_transforms import CASES as TRANSFORM_CASES


def covering(cases):
    """The first parity case through each overridable name: every name, a third of the time."""
    chosen, covered = [], set()
    for case in cases:
        if not set(case.uses) <= covered:
            chosen.append(case)
            covered |= set(case.uses)
    assert covered == jo.OVERRIDEABLE
    return chosen


CASES = covering([*LAX_CASES, *TRANSFORM_CASES, *RULE_CASES])


def lines(t: jd.Trace) -> list[str]:
    return [str(call) for call in t.calls]


# -- transparency ------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_results_and_jaxprs_are_those_of_jax(case):
    """Every parity case gives JAX's outputs (bits, dtypes, weak types) and jaxpr under trace."""
    args = case.args()
    expected = case.call(JAX, *args)
    expected_jaxpr = str(jax.make_jaxpr(lambda *a: case.call(JAX, *a))(*args)) if case.jaxpr else ""
    with jd.trace(log=lambda call: None) as t:
        actual = case.call(jo, *args)
        jaxpr = str(jax.make_jaxpr(lambda *a: case.call(jo, *a))(*args)) if case.jaxpr else ""
    assert_same(actual, expected)
    assert jaxpr == expected_jaxpr
    assert {call.name for call in t.calls} >= set(case.uses)


# -- the log -----------------------------------------------------------------------------


def step(carry, x):
    return carry * 2.0 + x, carry


def solve(x):
    def body(state):
        i, value = state
        value, _ = jlax.scan(step, value, jnp.ones((3, *value.shape)))
        return i + 1, value

    _, value = jlax.while_loop(lambda state: state[0] < 2, body, (0, x))
    return jlax.cond(value.sum() > 0, jnp.sin, jnp.cos, value)


def test_the_log_of_a_known_program_is_exact():
    solver = jo.jit(solve)
    with jd.trace(log=lambda call: None) as t:
        solver(jnp.zeros((2, 4)))
        solver(jnp.zeros((2, 4)))  # a cache hit: nothing inside runs in Python
        solver(jnp.zeros(5))  # a retrace
    assert lines(t) == [
        "jit(solve) built -> jax.jit",
        "jit(solve)(f32[2,4]) -> jax.jit",
        "  lax.while_loop((int, f32[2,4])) -> jax.lax.while_loop",
        "    lax.scan(f32[2,4], f32[3,2,4]) -> jax.lax.scan",
        "  lax.cond(bool[], f32[2,4]) -> jax.lax.cond",
        "jit(solve)(f32[2,4]) -> jax.jit",
        "jit(solve)(f32[5]) -> jax.jit",
        "  lax.while_loop((int, f32[5])) -> jax.lax.while_loop",
        "    lax.scan(f32[5], f32[3,5]) -> jax.lax.scan",
        "  lax.cond(bool[], f32[5]) -> jax.lax.cond",
    ]
    assert [call.depth for call in t.calls] == [0, 0, 1, 2, 1, 0, 0, 1, 2, 1]
    assert t.calls[3] == jd.Call(
        "lax.scan", "call", "f32[2,4], f32[3,2,4]", "jax.lax.scan", 2, "step"
    )
    assert t.format() == "\n".join(lines(t))


def test_shapes_show_pytrees_options_and_non_array_leaves():
    tree = {"w": jnp.zeros((2, 3), jnp.bfloat16), "b": [np.zeros(3, np.uint8), 1.5]}
    with jd.trace(log=lambda call: None) as t:
        jlax.scan(lambda c, x: (c, None), tree, length=2, reverse=True)
        jlax.map(lambda x: x, jnp.arange(4), batch_size=2)
        jo.vmap(lambda a, b: a, in_axes=(0, None))(jnp.ones((2, 3)), "label")
        jlax.scan(lambda c, x: (c, x), 0, tuple(jnp.zeros(2) for _ in range(8)))
    assert lines(t) == [
        "lax.scan({w: bf16[2,3], b: [u8[3], float]}, length=2, reverse=True) -> jax.lax.scan",
        "lax.map(i32[4], batch_size=2) -> jax.lax.map",
        "vmap(<lambda>, in_axes=(0, None)) built -> jax.vmap",
        "vmap(<lambda>)(f32[2,3], str) -> jax.vmap",
        "lax.scan(int, (f32[2], f32[2], f32[2], f32[2], f32[2], f32[2], +2 more)) -> jax.lax.scan",
    ]


DTYPES = ["bool", "int8", "int16", "int32", "uint8", "uint32", "float16", "bfloat16", "float32"]
DTYPES += ["complex64"]


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(0, 5), max_size=4).map(tuple),
    dtype=st.sampled_from(DTYPES),
)
def test_leaf_shapes_read_as_jax_writes_them(shape, dtype):
    """Arrays and tracers read as JAX's own short form of their type, e.g. ``bf16[2,0]``."""
    value = jnp.zeros(shape, dtype)
    assert describe_leaf(value) == jax.typeof(value).str_short(short_dtypes=True)
    traced = jax.make_jaxpr(lambda v: (seen.append(describe_leaf(v)), v)[1])
    seen: list[str] = []
    traced(value)
    assert seen == [describe_leaf(value)]


def test_depth_of_a_scan_inside_a_while_body_and_the_names_filter():
    def program(x):
        body = lambda v: jlax.scan(lambda c, _: (c + 1.0, None), v, length=2)[0]
        return jlax.while_loop(lambda v: v.sum() < 10.0, body, x)

    with jd.trace(log=lambda call: None) as everything:
        expected = program(jnp.zeros(2))
    assert [(c.name, c.depth) for c in everything.calls] == [("lax.while_loop", 0), ("lax.scan", 1)]
    # Depth counts recorded calls, so that it matches the indentation of what is shown.
    with jd.trace(names=["lax.scan"], log=lambda call: None) as scans:
        actual = program(jnp.zeros(2))
    assert [(c.name, c.depth) for c in scans.calls] == [("lax.scan", 0)]
    assert_same(actual, expected)


def test_default_log_is_the_jaxoverride_debug_logger(caplog):
    with caplog.at_level(logging.INFO, logger="jaxoverride_debug"):
        with jd.trace():
            jlax.fori_loop(0, 3, lambda i, c: c + i, 0)
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("jaxoverride_debug", logging.INFO, "lax.fori_loop(int, int, int) -> jax.lax.fori_loop")
    ]


@pytest.mark.filterwarnings("ignore::jaxoverride_debug.NothingTracedWarning")  # on purpose
def test_builds_are_recorded_once_per_stack_and_runs_every_call():
    double = jo.jit(lambda x: jlax.map(lambda v: 2 * v, x))
    with jd.trace(log=lambda call: None) as first:
        double(jnp.ones(2))
    with jd.trace(log=lambda call: None) as second:  # same configuration: same layer
        double(jnp.ones(2))
    assert [c.kind for c in first.calls] == ["build", "run", "call"]
    assert [c.kind for c in second.calls] == ["run"]  # the build and jax.jit's cache are reused
    assert first.context is second.context
    # The built function keeps the jitted function's attributes.
    with jd.trace(log=lambda call: None):
        assert "module" in double.lower(jnp.ones(2)).as_text()


def test_a_trace_is_reusable_nests_and_decorates():
    outer, inner = jd.trace(log=lambda c: None), jd.trace(log=lambda c: None)
    with outer:
        jlax.map(jnp.sin, jnp.ones(2))
        with inner:  # the innermost trace records; the layer below it stays silent
            jlax.map(jnp.sin, jnp.ones(2))
        with outer:
            jlax.map(jnp.sin, jnp.ones(2))

    @outer
    def decorated():
        return jlax.map(jnp.cos, jnp.ones(3))

    decorated()
    assert [c.shapes for c in outer.calls] == ["f32[2]", "f32[2]", "f32[3]"]
    assert [(c.shapes, c.above) for c in inner.calls] == [("f32[2]", ())]


def test_only_the_entering_thread_is_traced():
    seen_elsewhere = []

    def other():
        seen_elsewhere.append(jo.current_stack().layers)
        jlax.map(jnp.sin, jnp.ones(4))

    with jd.trace(log=lambda c: None) as t:
        worker = threading.Thread(target=other)
        worker.start()
        worker.join()
        jlax.map(jnp.sin, jnp.ones(2))
    assert seen_elsewhere == [()]
    assert [c.shapes for c in t.calls] == ["f32[2]"]


@pytest.mark.filterwarnings("ignore::jaxoverride_debug.NothingTracedWarning")  # on purpose
def test_cost_nothing_when_not_entered_and_state_restored_on_errors():
    t = jd.trace(log=lambda c: None)
    with pytest.raises(ZeroDivisionError), t:
        jlax.map(lambda x: 1 / 0, jnp.ones(2))
    assert _SESSION.get() is None
    assert jo.resolve("lax.scan") is jax.lax.scan
    assert _stack.idle  # nothing alive anywhere: neutral functions are JAX's own objects
    other = jd.trace(log=lambda c: None)
    t.__enter__()
    other.__enter__()
    with pytest.raises(RuntimeError, match="reverse order"):
        t.__exit__(None, None, None)  # misordered: refused, nothing changed
    assert _SESSION.get() is not None and len(jo.current_stack().layers) == 2
    other.__exit__(None, None, None)
    t.__exit__(None, None, None)
    assert _SESSION.get() is None


def test_no_tracer_leaks_through_the_records():
    with jax.checking_leaks(), jd.trace(log=lambda c: None) as t:
        jo.jit(lambda x: jlax.scan(step, x, jnp.ones(3))[0])(1.0)
        jo.grad(lambda x: jlax.fori_loop(0, 2, lambda i, c: c * x, x))(2.0)
    assert all(isinstance(field, str) for call in t.calls for field in (call.shapes, call.impl))


# -- composition with adapters -----------------------------------------------------------


def haiku_model():
    def f(x):
        layer = hk.Linear(2)
        return jlax.scan(lambda h, _: (jnp.tanh(layer(h)), None), x, length=3)[0]

    return hk.transform(f), jnp.ones((1, 2))


def test_inside_the_haiku_context_the_haiku_scan_is_shown_and_its_bar_counts_the_loop():
    bars = Bars()
    model, x = haiku_model()
    options = {"progress": True, "progress_options": bars.options, "log": lambda c: None}
    with joh.context():
        reference = model.apply(model.init(jax.random.PRNGKey(0), x), None, x)
        with jd.trace(**options) as t:
            params = model.init(jax.random.PRNGKey(0), x)
            out = model.apply(params, None, x)
    assert_same(out, reference)
    assert (
        lines(t)
        == ["lax.scan(f32[1,2], length=3) -> jaxoverride_haiku._control.scan [progress]"] * 2
    )
    # Init runs the body once eagerly to create parameters, then the loop: one bar each
    # for init and apply, and the creation pass does not count as a step.
    assert bars.runs() == {"lax.scan <lambda>": [full(3), full(3)]}


def test_outside_the_haiku_context_the_trace_sees_what_haiku_hands_down():
    model, x = haiku_model()
    with jd.trace(log=lambda c: None) as t, joh.context():
        params = model.init(jax.random.PRNGKey(0), x)
        model.apply(params, None, x)
    assert [(c.name, c.impl, c.above) for c in t.calls] == [
        ("lax.scan", "jax.lax.scan", ("jaxoverride_haiku._control.scan",))
    ] * 2
    assert t.calls[0].shapes.startswith("(f32[1,2], InternalState(")  # Haiku's threaded carry


def test_with_haiku_installed_the_trace_stays_above_it():
    model, x = haiku_model()
    joh.install()
    try:
        with jd.trace(log=lambda c: None) as t:
            model.init(jax.random.PRNGKey(0), x)
    finally:
        joh.uninstall()
    assert [(c.impl, c.above) for c in t.calls] == [("jaxoverride_haiku._control.scan", ())]


def test_nnx_track_inside_and_outside_the_trace():
    model = nnx.Linear(3, 3, rngs=nnx.Rngs(0))

    def run(x):
        return jlax.fori_loop(0, 4, lambda i, h: jnp.tanh(model(h)), x)

    x = jnp.ones(3)
    expected = run(x)
    with jaxoverride_nnx.track(model), jd.trace(log=lambda c: None) as inside:
        assert_same(jo.jit(run)(x), expected)
    assert lines(inside) == [
        "jit(run) built -> jaxoverride_nnx._jit.jit",
        "jit(run)(f32[3]) -> jaxoverride_nnx._jit.jit",
        "  lax.fori_loop(int, int, f32[3]) -> jaxoverride_nnx._control.fori_loop",
    ]
    with jd.trace(log=lambda c: None) as outside, jaxoverride_nnx.track(model):
        assert_same(jo.jit(run)(x), expected)
    handed = [c for c in outside.calls if c.name == "lax.fori_loop"]
    assert [(c.impl, c.above) for c in handed] == [
        ("jax.lax.fori_loop", ("jaxoverride_nnx._control.fori_loop",))
    ]


# -- progress bars -----------------------------------------------------------------------

STATUS = re.compile(r"^\s*(.*?):\s+\d+%\|[^|]*\|\s*(\d+)/(\d+) ")


class Bars:
    """A tqdm output captured in memory, printed on every update."""

    def __init__(self) -> None:
        self.file = io.StringIO()
        self.options = {"file": self.file, "mininterval": 0, "miniters": 1}

    def runs(self) -> dict[str, list[list[int]]]:
        """Per bar description, each run's displayed counts (a run starts at 0)."""
        jax.effects_barrier()
        found: dict[str, list[list[int]]] = {}
        for status in re.split(r"[\r\n]", self.file.getvalue()):
            match = STATUS.match(status)
            if match is None:
                continue
            description, n = match.group(1), int(match.group(2))
            if n == 0:
                found.setdefault(description, []).append([])
            found[description][-1].append(n)
        return found


def test_a_long_loop_calls_back_about_a_hundred_times():
    bars = Bars()
    f = jo.jit(lambda xs: jlax.scan(step, 0.0, xs)[0])
    xs = jnp.ones(1000)
    with jd.trace(progress=True, progress_options=bars.options, log=lambda c: None):
        assert_same(f(xs), jax.jit(lambda xs: jax.lax.scan(step, 0.0, xs)[0])(xs))
    [runs] = bars.runs().values()
    [run] = runs
    assert run[:2] == [0, 1] and run[-1] == 1000 and run == sorted(run)
    assert 100 <= len(run) <= 103, len(run)  # step 1, every 10th step, and the close


def full(total: int) -> list[int]:
    return [*range(total + 1), total]  # tqdm prints the last count again when it closes


def test_progress_of_a_jitted_scan_and_identical_results():
    bars = Bars()
    f = lambda xs: jlax.scan(step, 1.0, xs)
    xs = jnp.arange(5.0)
    expected = f(xs)
    with jd.trace(progress=True, progress_options=bars.options, log=lambda c: None) as t:
        jitted = jo.jit(f)
        actual = jitted(xs)
        jitted(xs)
    assert_same(actual, expected)
    assert bars.runs() == {"lax.scan step": [full(5), full(5)]}  # one bar per run
    assert [c.progress for c in t.calls if c.kind == "call"] == [True]


@pytest.mark.parametrize(
    "program",
    [
        pytest.param(lambda xs: jlax.scan(step, 1.0, xs, reverse=True), id="reverse-scan"),
        pytest.param(
            lambda xs: jlax.fori_loop(2, 8, lambda i, c: c + xs[i - 2] * i, 0.0), id="fori"
        ),
        pytest.param(lambda xs: jlax.map(jnp.sin, xs), id="map"),
        pytest.param(lambda xs: jlax.map(jnp.sin, xs, batch_size=4), id="map-batched"),
        pytest.param(jax.grad(lambda xs: jlax.scan(step, 1.0, xs)[0]), id="grad"),
        pytest.param(
            lambda xs: jo.vmap(lambda row: jlax.scan(step, 1.0, row)[0])(jnp.stack([xs, 2 * xs])),
            id="vmap",
        ),
    ],
)
def test_progress_completes_once_per_run_under_transforms(program, request):
    bars = Bars()
    xs = jnp.arange(6.0)
    expected = program(xs)
    with jd.trace(progress=True, progress_options=bars.options, log=lambda c: None):
        actual = program(xs)
    assert_same(actual, expected)
    [runs] = bars.runs().values()
    if "batched" in request.node.callspec.id:
        # The callback runs once per element of a batch, in no fixed order: the bar
        # shows the furthest step reported, and still completes.
        assert len(runs) == 1 and runs[0][:2] == [0, 1] and runs[0][-2:] == [6, 6]
        assert runs[0] == sorted(runs[0])
    else:
        assert runs == [full(6)]


def test_progress_under_pmap_gives_complete_bars_at_most_one_per_device():
    bars = Bars()
    program = jo.pmap(lambda row: jlax.scan(step, 0.0, row)[0])
    xs = jnp.arange(48.0).reshape(8, 6)
    expected = jax.pmap(lambda row: jax.lax.scan(step, 0.0, row)[0])(xs)
    with jd.trace(progress=True, progress_options=bars.options, log=lambda c: None):
        assert_same(program(xs), expected)
    [runs] = bars.runs().values()
    # Devices report concurrently: a bar may jump ahead to another device's step, but
    # each one opens at step 1, only moves forward, and completes.
    assert 1 <= len(runs) <= 8
    for run in runs:
        assert run[:2] == [0, 1] and run[-2:] == [6, 6] and run == sorted(run), run


@pytest.mark.filterwarnings("ignore::jaxoverride_debug.NothingTracedWarning")  # on purpose
def test_progress_changes_the_jaxpr_only_by_the_callback():
    # What a bar may add: the callback, the cond that gates it to about a hundred steps
    # and the arithmetic of that gate, and for scan an iota of iteration indices.
    gate = {"debug_callback", "cond", "eq", "or", "rem", "add", "sub", "iota"}
    gate.add("convert_element_type")  # cond's boolean predicate becomes a branch index

    def primitives(jaxpr):
        found = []
        for eqn in jaxpr.eqns:
            found.append(eqn.primitive.name)
            for sub in jaxprs_in_params(eqn.params):
                found += primitives(sub)
        return found

    def only_gate_added(plain, barred):
        remaining = iter(barred)
        extra = []
        for name in plain:  # plain must be a subsequence of barred
            for candidate in remaining:
                if candidate == name:
                    break
                extra.append(candidate)
            else:
                return False
        extra += list(remaining)
        return "debug_callback" in extra and set(extra) <= gate

    def jaxprs(program, x):
        plain = jax.make_jaxpr(program)(x).jaxpr
        with jd.trace(progress=True, progress_options={"disable": True}, log=lambda c: None):
            barred = jax.make_jaxpr(program)(x).jaxpr
        return primitives(plain), primitives(barred)

    fori = lambda x: jlax.fori_loop(0, 4, lambda i, c: jnp.sin(c) * i, x)
    assert only_gate_added(*jaxprs(fori, jnp.ones(2)))
    assert only_gate_added(*jaxprs(lambda x: jlax.scan(step, x, jnp.ones(4)), 1.0))
    plain, barred = jaxprs(fori, jnp.ones(2))
    assert not only_gate_added([*plain, "mul"], barred)  # the check can fail


def test_progress_threshold_and_nested_loops():
    bars = Bars()

    def nested(x):
        inner = lambda c, _: (jlax.scan(step, c, jnp.ones(2))[0], None)
        once = jlax.scan(step, x, jnp.ones(1))[0]  # below min_steps: no bar
        return jlax.scan(inner, once, None, length=3)[0]

    expected = nested(1.0)
    with jd.trace(progress=True, progress_options=bars.options, log=lambda c: None) as t:
        actual = jo.jit(nested)(1.0)
    assert_same(actual, expected)
    assert [c.progress for c in t.calls if c.name == "lax.scan"] == [False, True, True]
    assert bars.runs() == {"lax.scan <lambda>": [full(3)], "lax.scan step": [full(2)] * 3}


def test_tqdm_is_needed_only_for_progress(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # `import tqdm` now raises ImportError
    with pytest.raises(ImportError, match=re.escape("pip install 'jaxoverride[debug]'")):
        jd.trace(progress=True)
    with jd.trace(log=lambda c: None) as t:
        jlax.map(jnp.sin, jnp.ones(2))
    assert len(t.calls) == 1


def test_importing_the_adapter_does_not_import_tqdm():
    code = "import sys, jaxoverride_debug; assert 'tqdm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# -- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"names": ["lax.scann"]}, ValueError, "Did you mean 'lax.scan'"),
        ({"names": ["scan"]}, ValueError, "Did you mean 'lax.scan'"),
        ({"names": "lax.scan"}, TypeError, r"write names=\['lax.scan'\]"),
        ({"names": 3}, TypeError, "collection of names"),
        ({"log": "stdout"}, TypeError, "callable taking a Call"),
        ({"progress": "yes"}, TypeError, "expects a bool"),
        ({"min_steps": 0}, ValueError, "at least 1"),
        ({"min_steps": 2.5}, TypeError, "expects an int"),
        ({"progress": True, "progress_options": {"file": []}}, TypeError, "must be hashable"),
        ({"progress": True, "progress_options": ["leave"]}, TypeError, "mapping of tqdm"),
    ],
)
def test_bad_arguments_are_rejected_clearly(kwargs, error, message):
    with pytest.raises(error, match=message):
        jd.trace(**kwargs)
    assert _SESSION.get() is None


def test_a_trace_that_records_nothing_warns_and_names_interpose():
    with pytest.warns(jd.NothingTracedWarning, match=r"jaxoverride\.interpose"):
        with jd.trace(log=lambda call: None):
            jax.jit(lambda x: x + 1)(1.0)  # raw JAX: never reaches the neutral API
    with warnings.catch_warnings():
        warnings.simplefilter("error", jd.NothingTracedWarning)
        with jd.trace(log=lambda call: None) as recorded:
            jo.jit(lambda x: x + 1)(1.0)
    assert recorded.calls
    with warnings.catch_warnings():  # an exception is its own message: no warning on top
        warnings.simplefilter("error", jd.NothingTracedWarning)
        with pytest.raises(ZeroDivisionError):
            _raise_inside_a_trace()


def _raise_inside_a_trace():
    with jd.trace(log=lambda call: None):
        raise ZeroDivisionError
