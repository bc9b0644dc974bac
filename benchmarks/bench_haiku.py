"""jaxoverride_haiku: the flagship solver through the adapter against the same model by hand.

The adapter's model is ``examples/fpsolve.py``, unchanged, inside ``hk.transform`` with
``jaxoverride_haiku.context()``: its ``jo.jit``, ``jlax.while_loop`` and ``jo.jacfwd`` see
a Haiku module in the fixed-point map. The ``hk.*`` model is what a Haiku user writes by
hand: the same arithmetic (fpsolve itself, unjitted, its ``while_loop`` bound to
``hk.while_loop`` and its ``jacfwd`` left as ``jax.jacfwd``, which only reads params at
apply), with ``hk.running_init()`` to create the parameters at init, because
``hk.while_loop`` refuses to run at init. Rows, for forward, Anderson and Newton:

- equations of ``jax.make_jaxpr(jax.jit(model.apply))``, counted through every sub-jaxpr
  (loop bodies, branches); call wrappers (the ``jit`` equation that ``jo.jit`` leaves,
  and the ones both models share) are not counted themselves, only what they hold: they
  compute nothing and XLA inlines them (target: equal, ratio 1.0);
- compiled apply, ``jax.jit(model.apply)`` on a cache hit (target <= 1.05x);
- init, ``jax.jit(model.init)`` on a new transformed function each round, i.e. trace,
  compile and run, as a model is initialised once (target <= 1.5x). The adapter's init
  also runs the solver, so that init returns what apply returns; the hand-written one
  skips it. For information: eager ``model.init`` too;
- init against apply of the adapter's own model, trace only (``jax.make_jaxpr`` of each, a
  new transformed function every round): init traces each loop body and branch once,
  as apply does (target <= 1.5x);
- resident memory growth over a long eager run: ``apply`` of a model whose loop is an
  eager ``jlax.fori_loop`` with a module-level body, against ``jax.lax.fori_loop`` in the
  same place (MiB over the steps, and compiles; target: at most 5 MiB);
- the core's metric for this adapter: ``jo.jit`` dispatch with ``install()`` active but
  outside any transform (its predicate false), against ``jax.jit`` (target <= 1.10x).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp

import jaxoverride as jo
import jaxoverride_haiku as joh
from benchmarks._harness import Row, at_most, interleaved, main, ratio_rows
from jaxoverride import lax as jlax
from jaxoverride._compat import jaxprs_in_params

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from _demo import make_problem
from fixed_point_haiku import DenseMap, model, problem_params
from fpsolve import Solution, fixed_point

SUITE = "haiku"
METHODS = ("forward", "anderson", "newton")


# -- the hk.* model: the solver's arithmetic with Haiku's own control flow ------------------


def _hk_while_loop(cond_fun: Callable, body_fun: Callable, init_val: Any) -> Any:
    return hk.while_loop(cond_fun, body_fun, init_val)


# Binds the solver's while_loop to hk.while_loop (its jacfwd stays jax.jacfwd): the model a
# Haiku user writes by hand, with the very arithmetic of fpsolve, so that the two cannot
# drift apart. Not jitted: Haiku has no public jit.
_HK_CONTROL_FLOW = jo.override_context({"lax.while_loop": _hk_while_loop}, name="hk.*")


def by_hand(n: int, method: str) -> hk.Transformed:
    def solve(x: jax.Array):
        layer = DenseMap(n)
        f = lambda z, x: layer(z, x)
        z0 = jnp.zeros(n)
        if hk.running_init():  # hk.while_loop cannot run at init: create the params only
            return Solution(f(z0, x), jnp.asarray(0), jnp.asarray(0.0))
        with _HK_CONTROL_FLOW:
            return fixed_point(f, z0, x, method=method, jit=False)

    return hk.transform(solve)


# -- measurements --------------------------------------------------------------------------


_CALLS = {"jit", "pjit", "closed_call", "core_call"}


def count_equations(jaxpr: Any) -> int:
    """Equations in ``jaxpr`` and every sub-jaxpr; call wrappers count only their body."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name not in _CALLS:
            total += 1
        for sub in jaxprs_in_params(eqn.params):
            total += count_equations(sub)
    return total


def _equation_rows(problem: Any) -> list[Row]:
    params = problem_params(problem)
    rows = []
    for method in METHODS:
        with joh.context():
            ours = jax.make_jaxpr(jax.jit(model(problem.n, method).apply))(params, None, problem.x)
        hand = jax.make_jaxpr(jax.jit(by_hand(problem.n, method).apply))(params, None, problem.x)
        n_ours, n_hand = count_equations(ours.jaxpr), count_equations(hand.jaxpr)
        rows.append(Row(
            suite=SUITE, case=f"apply jaxpr equations, {method}", ours="fpsolve via adapter",
            baseline="hk.* by hand", ours_us=float(n_ours), baseline_us=float(n_hand),
            ratio=n_ours / n_hand, target="equal", met=n_ours == n_hand,
            note="counts, not microseconds; pjit wrappers not counted",
        ))  # fmt: skip
    return rows


def _apply_rows(problem: Any, quick: bool) -> list[Row]:
    rounds, number = (5, 20) if quick else (25, 100)
    params = problem_params(problem)
    rows = []
    for method in METHODS:
        with joh.context():
            ours = jax.jit(model(problem.n, method).apply)
            ours(params, None, problem.x)  # compile with the adapter active
        hand = jax.jit(by_hand(problem.n, method).apply)
        samples = interleaved(
            {
                "hk.* by hand": lambda hand=hand: jax.block_until_ready(
                    hand(params, None, problem.x)),
                "fpsolve via adapter": lambda ours=ours: jax.block_until_ready(
                    ours(params, None, problem.x)),
            },
            number=number, rounds=rounds,
        )  # fmt: skip
        rows += ratio_rows(
            SUITE,
            f"compiled apply, {method}",
            samples,
            "hk.* by hand",
            {"fpsolve via adapter": at_most(1.05)},
        )
    return rows


def _fresh_init_seconds(
    make: Callable[[], hk.Transformed], problem: Any, jit: bool, adapter: bool
) -> float:
    transformed = make()
    init = jax.jit(transformed.init) if jit else transformed.init
    start = time.perf_counter()
    if adapter:
        with joh.context():
            jax.block_until_ready(init(jax.random.PRNGKey(0), problem.x))
    else:
        jax.block_until_ready(init(jax.random.PRNGKey(0), problem.x))
    return time.perf_counter() - start


def _init_rows(problem: Any, quick: bool) -> list[Row]:
    rounds = 3 if quick else 9
    rows = []
    for jit in (True, False):
        for method in METHODS:
            samples: dict[str, list[float]] = {"hk.* by hand": [], "fpsolve via adapter": []}
            for _ in range(rounds):  # interleaved; a new transformed function every time
                samples["hk.* by hand"].append(
                    _fresh_init_seconds(
                        lambda m=method: by_hand(problem.n, m), problem, jit, adapter=False
                    )
                )
                samples["fpsolve via adapter"].append(
                    _fresh_init_seconds(
                        lambda m=method: model(problem.n, m), problem, jit, adapter=True
                    )
                )
            case = f"init {'jax.jit(init), trace+compile+run' if jit else 'eager'}, {method}"
            target = {"fpsolve via adapter": at_most(1.5)} if jit else None
            note = (
                ""
                if jit
                else (
                    "information: eager init compiles and runs the solver (the library's jo.jit) "
                    "so that init returns apply's value; by hand, init calls the layer once "
                    "and returns f(z0, x)"
                )
            )
            rows += ratio_rows(SUITE, case, samples, "hk.* by hand", target, note)
    return rows


def _trace_seconds(trace: Callable[[], Any]) -> float:
    start = time.perf_counter()
    trace()
    return time.perf_counter() - start


def _trace_only_rows(problem: Any, quick: bool) -> list[Row]:
    rounds = 3 if quick else 9
    params = problem_params(problem)
    key = jax.random.PRNGKey(0)
    rows = []
    for method in METHODS:
        samples: dict[str, list[float]] = {"apply, traced": [], "init, traced": []}
        with joh.context():
            for _ in range(rounds):  # interleaved; a new transformed function every time
                apply = model(problem.n, method).apply
                samples["apply, traced"].append(
                    _trace_seconds(lambda a=apply: jax.make_jaxpr(a)(params, None, problem.x))
                )
                init = model(problem.n, method).init
                samples["init, traced"].append(
                    _trace_seconds(lambda i=init: jax.make_jaxpr(i)(key, problem.x))
                )
        rows += ratio_rows(
            SUITE,
            f"DEQ init vs apply, trace only (make_jaxpr), {method}",
            samples,
            "apply, traced",
            {"init, traced": at_most(1.5)},
            "fpsolve via the adapter; both traced with joh.context()",
        )
    return rows


def _fori_body(i: Any, y: jax.Array) -> jax.Array:
    return y * 2.0 + 1.0


def _resident_mib() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _growth(loop: Callable[..., Any], steps: int) -> tuple[float, int]:
    """MiB of resident memory and compiles over ``steps`` eager applies, after a warm-up."""
    model = hk.transform(lambda x: loop(0, 2, _fori_body, hk.Linear(3)(x)))
    x = jnp.ones((2, 3))
    compiles = [0]

    def count(event: str, duration: float, **kwargs: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles[0] += 1

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        with joh.context():
            params = model.init(jax.random.PRNGKey(0), x)
            for _ in range(20):
                model.apply(params, None, x)
            before, compiles[0] = _resident_mib(), 0
            for _ in range(steps):
                jax.block_until_ready(model.apply(params, None, x))
            return _resident_mib() - before, compiles[0]
    finally:
        jax.monitoring.unregister_event_duration_listener(count)


def _memory_rows(quick: bool) -> list[Row]:
    steps = 200 if quick else 1000
    raw, raw_compiles = _growth(jax.lax.fori_loop, steps)
    ours, our_compiles = _growth(jlax.fori_loop, steps)
    return [Row(
        suite=SUITE, case=f"resident memory growth, {steps} eager applies with a fori_loop",
        ours="jlax.fori_loop via adapter", baseline="jax.lax.fori_loop", ours_us=ours,
        baseline_us=raw, ratio=ours / raw if raw > 0 else float(ours <= 0.5),
        target="<= 5 MiB", met=ours <= 5.0,
        note=f"MiB, not microseconds; compiles: {our_compiles} ours, {raw_compiles} raw",
    )]  # fmt: skip


def _add_one(x: jax.Array) -> jax.Array:
    return x + 1


def _dispatch_rows(quick: bool) -> list[Row]:
    rounds, number = (9, 2000) if quick else (31, 5000)
    x = jnp.ones((8,), jnp.float32)
    raw = jax.jit(_add_one)
    ours = jo.jit(_add_one)
    already = joh.is_installed()
    joh.install()
    try:
        samples = interleaved(
            {"jax.jit": lambda: raw(x), "jo.jit": lambda: ours(x)}, number=number, rounds=rounds
        )
    finally:
        if not already:
            joh.uninstall()
    return ratio_rows(
        SUITE,
        "jit dispatch, install() active, outside transform",
        samples,
        "jax.jit",
        {"jo.jit": at_most(1.10)},
        "predicate: Haiku's frame stack is empty; call not blocked on",
    )


def run(quick: bool) -> list[Row]:
    problem = make_problem()
    rows = _equation_rows(problem)
    rows += _apply_rows(problem, quick)
    rows += _init_rows(problem, quick)
    rows += _trace_only_rows(problem, quick)
    rows += _memory_rows(quick)
    rows += _dispatch_rows(quick)
    return rows


if __name__ == "__main__":
    main(run)
