"""Progress bars for loops with a static trip count, updated from inside compiled code.

The body gets a ``jax.debug.callback`` of the iteration index (``fori_loop``'s counter, or
an ``arange`` scanned alongside ``xs``): being loop-variant it stays inside the forward
loop under ``grad``, and unbatched it runs once per iteration under ``vmap``. A
``lax.cond`` on the index lets about a hundred callbacks through per run; nothing flows
back into the loop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.core import Tracer

from jaxoverride.adapter_kit import get_opaque_trace_state, scan_arguments
from jaxoverride_debug._describe import function_name

_NEEDS_TQDM = (
    "jaxoverride_debug.trace(progress=True) needs tqdm: pip install 'jaxoverride[debug]' "
    "(or pip install tqdm). Tracing without progress bars needs nothing extra."
)


def require_tqdm() -> Any:
    """The ``tqdm.tqdm`` class, or an ImportError that names the extra to install."""
    try:
        from tqdm import tqdm
    except ImportError as error:
        raise ImportError(_NEEDS_TQDM) from error
    return tqdm


class Bar:
    """The host side of one loop's progress bar: one tqdm bar per run, opened at step 1
    and closed at the last; a step at or behind the bar (another device's) is ignored."""

    def __init__(self, total: int, description: str, options: Mapping[str, Any]):
        self.total = total
        self.description = description
        self.options = dict(options)
        self.runs = 0
        self._bar: Any = None
        self._lock = threading.Lock()

    def report(self, step: int) -> None:
        with self._lock:
            if self._bar is None:
                if step != 1:
                    return
                self.runs += 1
                self._bar = require_tqdm()(total=self.total, desc=self.description, **self.options)
            if step > self._bar.n:
                self._bar.update(step - self._bar.n)
            if self._bar.n >= self.total:
                self._bar.close()
                self._bar = None


UPDATES = 100
"""The most times one run of a loop calls back to the host (plus its first and last step):
a host callback costs tens of microseconds, far more than a small loop body."""


def _ticking(bar: Bar, step_of: Callable[[Any], Any]) -> Callable[[Any], None]:
    """A function of the iteration index that reports to ``bar`` from compiled code, on the
    first and last step and every ``total // UPDATES``-th between (a ``lax.cond`` on the
    step). It does nothing at the loop call's own trace level (a creation pass)."""
    outer = get_opaque_trace_state()
    stride = max(1, bar.total // UPDATES)

    def report(step: Any) -> None:
        jax.debug.callback(lambda s: bar.report(int(s)), step, ordered=False)

    def tick(index: Any) -> None:
        if get_opaque_trace_state() == outer:
            return
        step = step_of(index)
        # lax rather than jnp operators: a step is never negative, so rem is enough, and
        # the gate stays a handful of equations.
        ends = jax.lax.bitwise_or(jax.lax.eq(step, 1), jax.lax.eq(step, bar.total))
        due = jax.lax.bitwise_or(ends, jax.lax.eq(jax.lax.rem(step, stride), 0))
        jax.lax.cond(due, report, lambda step: None, step)

    return tick


def _static_int(value: Any) -> int | None:
    if isinstance(value, Tracer):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _leading(xs: Any) -> int | None:
    leaves = jax.tree_util.tree_leaves(xs)
    if not leaves or not getattr(leaves[0], "shape", ()):
        return None
    return int(leaves[0].shape[0])


def with_progress(
    name: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    min_steps: int,
    options: Mapping[str, Any],
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The arguments of a ``scan``/``fori_loop``/``map`` call with a progress bar attached.

    Returns None (leave the call alone) for other names, for a trip count that is not
    static or is below ``min_steps``, and for arguments JAX would reject anyway.
    """
    attach = {"lax.fori_loop": _fori, "lax.map": _map}.get(name)
    try:
        if name == "lax.scan":
            return _scan(scan_arguments(*args, **kwargs), min_steps=min_steps, options=options)
        if attach is not None:
            return attach(*args, **kwargs, min_steps=min_steps, options=options)
    except TypeError:
        return None
    return None


def _scan(
    bound: tuple[Any, ...], *, min_steps: int, options: Mapping[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    f, init, xs, length, reverse, unroll, split = bound  # ``scan_arguments``
    total = _static_int(length) if length is not None else _leading(xs)
    if total is None or total < min_steps or not callable(f):
        return None
    bar = Bar(total, f"lax.scan {function_name(f)}", options)
    # A reversed scan consumes the indices from the last: its first step has the highest.
    tick = _ticking(bar, (lambda i: total - i) if reverse else (lambda i: i + 1))

    def body(carry: Any, x_and_index: Any) -> Any:
        x, index = x_and_index
        tick(index)
        return f(carry, x)

    indices = jnp.arange(total, dtype=jnp.int32)
    return (body, init, (xs, indices), length, reverse, unroll, split), {}


def _fori(
    lower: Any,
    upper: Any,
    body_fun: Any,
    init_val: Any,
    *,
    min_steps: int,
    options: Mapping[str, Any],
    **kwargs: Any,
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    first, last = _static_int(lower), _static_int(upper)
    if first is None or last is None or last - first < min_steps or not callable(body_fun):
        return None
    bar = Bar(last - first, f"lax.fori_loop {function_name(body_fun)}", options)
    tick = _ticking(bar, lambda i: i - first + 1)

    def body(i: Any, carry: Any) -> Any:
        tick(i)
        return body_fun(i, carry)

    return (lower, upper, body, init_val), kwargs


def _map(
    f: Any, xs: Any, *, min_steps: int, options: Mapping[str, Any], **kwargs: Any
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    total = _leading(xs)
    if total is None or total < min_steps or not callable(f):
        return None
    bar = Bar(total, f"lax.map {function_name(f)}", options)
    tick = _ticking(bar, lambda i: i + 1)

    def each(x_and_index: Any) -> Any:
        x, index = x_and_index
        tick(index)
        return f(x)

    return (each, (xs, jnp.arange(total, dtype=jnp.int32))), kwargs
