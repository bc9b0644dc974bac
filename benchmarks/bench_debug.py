"""jaxoverride_debug: what tracing costs while it is entered, and what a progress bar costs.

For information (the issue sets no target for a debugging tool):

- ``jo.jit`` cache-hit dispatch inside ``jaxoverride_debug.trace(log=...)`` against
  ``jax.jit``: each call is recorded (a ``Call`` record with the argument shapes);
- a compiled 1000-step ``jlax.scan`` with ``trace(progress=True)`` against the same
  ``jax.lax.scan`` without it: the bar calls back to the host on about a hundred steps;
- the same dispatch after the trace has exited, against ``jax.jit``: nothing is left
  behind, so the neutral API is idle again (target <= 1.05x, as for the core).
"""

from __future__ import annotations

import io

import jax
import jax.numpy as jnp

import jaxoverride as jo
import jaxoverride_debug
from benchmarks._harness import Row, at_most, interleaved, main, ratio_rows
from jaxoverride import _stack, lax as jlax

SUITE = "debug"
STEPS = 1000


def _add_one(x: jax.Array) -> jax.Array:
    return x + 1


def _cumulative(xs: jax.Array) -> jax.Array:
    return jlax.scan(lambda c, x: (c + x, None), 0.0, xs)[0]


def _raw_cumulative(xs: jax.Array) -> jax.Array:
    return jax.lax.scan(lambda c, x: (c + x, None), 0.0, xs)[0]


def _dispatch(case: str, rounds: int, number: int, target=None, note: str = "") -> list[Row]:
    x = jnp.ones((8,), jnp.float32)
    raw, ours = jax.jit(_add_one), jo.jit(_add_one)
    samples = interleaved(
        {"jax.jit": lambda: raw(x), "jo.jit": lambda: ours(x)}, number=number, rounds=rounds
    )
    return ratio_rows(SUITE, case, samples, "jax.jit", {"jo.jit": target} if target else None, note)


def run(quick: bool) -> list[Row]:
    rounds, number = (7, 500) if quick else (31, 2000)
    rows: list[Row] = []
    records: list[object] = []
    with jaxoverride_debug.trace(log=records.append):
        rows += _dispatch(
            "jit dispatch inside trace()", rounds, number,
            note="information: one Call record per call",
        )  # fmt: skip
    assert records, "the trace recorded nothing"

    xs = jnp.ones((STEPS,), jnp.float32)
    raw = jax.jit(_raw_cumulative)
    sink = io.StringIO()
    bars = {"file": sink}  # drawn for real, into a buffer rather than the terminal
    with jaxoverride_debug.trace(log=lambda call: None, progress=True, progress_options=bars):
        with_bar = jo.jit(_cumulative)
        jax.block_until_ready(with_bar(xs))
        samples = interleaved(
            {
                "jax.lax.scan": lambda: jax.block_until_ready(raw(xs)),
                "jlax.scan + progress bar": lambda: jax.block_until_ready(with_bar(xs)),
            },
            number=max(1, number // 500),
            rounds=rounds,
        )
    jax.effects_barrier()
    assert f"{STEPS}/{STEPS}" in sink.getvalue(), "no progress bar was drawn"
    (bar_row,) = ratio_rows(
        SUITE, f"compiled scan of {STEPS} steps with a progress bar", samples, "jax.lax.scan"
    )
    per_step = (bar_row.ours_us - bar_row.baseline_us) / STEPS
    bar_row.note = (
        f"information: {per_step:.1f} µs per step on average; the bar calls back to the host "
        "about a hundred times per run, and the body is one addition"
    )
    rows.append(bar_row)

    assert _stack.idle, "the trace left the neutral API active"
    rows += _dispatch("jit dispatch after trace() exited", rounds, number, target=at_most(1.05))
    return rows


if __name__ == "__main__":
    main(run)
