"""A complete adapter, written only against ``jaxoverride`` and ``jaxoverride.adapter_kit``.

``counting()`` counts, per overridable name, the neutral calls that library code makes:
``with counting() as counts: solve(...)`` leaves ``counts["lax.while_loop"] == 1``. It
shows the adapter contract of docs/writing-an-adapter.md: one constant
``OverrideTable`` that overrides or explicitly passes through every name of
``jaxoverride.OVERRIDEABLE``; per-scope data in a context variable, never in the layer;
delegation with ``jaxoverride.next_impl``; and a ``jit`` that keeps JAX's jitted API.

Counts are Python-level: a neutral call inside a jitted function is counted when JAX
traces it, once per compilation, as a ``print`` there would be.

Run: ``python examples/call_counter.py``.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

import jaxoverride as jo
from jaxoverride import adapter_kit as kit, lax as jlax

# Where this thread's or task's counts go; None outside ``counting()``.
_COUNTS: contextvars.ContextVar[collections.Counter[str] | None] = contextvars.ContextVar(
    "call_counter_counts", default=None
)


def _topmost(name: str) -> bool:
    """Whether no copy of this layer sits above the running one (``counting()`` entered
    inside ``counting()`` puts the layer in the stack twice: only the top one counts)."""
    return TABLE.overrides[name] not in kit.override_position(name).above


def _count(name: str) -> None:
    counts = _COUNTS.get()
    if counts is not None:
        counts[name] += 1


def _counting_call(name: str) -> Callable[..., Any]:
    """A call runs at once: count it, then hand the same arguments to the layer below."""

    def call(*args: Any, **kwargs: Any) -> Any:
        if _topmost(name):
            _count(name)
        return jo.next_impl(name)(*args, **kwargs)

    call.__qualname__ = f"counting_{name.replace('.', '_')}"
    return call


def _counting_transform(name: str) -> Callable[..., Any]:
    """A transform is built once per active stack: count the calls of what it returns."""

    def transform(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
        built = jo.next_impl(name)(fun, *args, **kwargs)  # resolved now, at build time
        topmost = _topmost(name)

        def call(*call_args: Any, **call_kwargs: Any) -> Any:
            if topmost:
                _count(name)
            return built(*call_args, **call_kwargs)

        if name != "jit":
            return call
        # ``.lower``, ``.trace``, ``.eval_shape`` of what a call runs: ``built`` itself.
        return jo.jit_api(
            call,
            fun,
            stage=lambda method, args, kwargs: getattr(built, method)(*args, **kwargs),
            jitted=lambda: [built],
        )

    transform.__qualname__ = f"counting_{name}"
    return transform


# The adapter's one, constant table: every name is overridden or passed through on purpose.
TABLE = kit.OverrideTable(
    "call_counter",
    {
        **{name: _counting_call(name) for name in kit.CALLS},
        **{name: _counting_transform(name) for name in kit.TRANSFORMS},
    },
    passes_through={
        "custom_vjp": "a rule is a decorator object; its calls run JAX code, not ours",
        "custom_jvp": "a rule is a decorator object; its calls run JAX code, not ours",
    },
)
assert not kit.unhandled_names(TABLE)  # the contract, as the test suite checks it


@contextlib.contextmanager
def counting() -> Iterator[collections.Counter[str]]:
    """Counts the neutral calls made inside the block, per name.

    Returns:
      A context manager whose value is a ``collections.Counter`` filled as calls run.
    """
    counts: collections.Counter[str] = collections.Counter()
    token = _COUNTS.set(counts)
    try:
        with TABLE.context():
            yield counts
    finally:
        _COUNTS.reset(token)


# -- a tiny library written against the neutral API, and a run of it --------------------


def fixed_point(f: Callable[[Any], Any], x0: Any, tol: float = 1e-6) -> Any:
    """The fixed point of ``f`` from ``x0``: iterate while the step is larger than ``tol``."""

    def keep_going(state: tuple[Any, Any]) -> Any:
        x, previous = state
        return jnp.max(jnp.abs(x - previous)) > tol

    def step(state: tuple[Any, Any]) -> tuple[Any, Any]:
        x, _ = state
        return f(x), x

    x, _ = jlax.while_loop(keep_going, step, (f(x0), x0))
    return x


@jo.jit
def solve(a: Any) -> Any:
    return fixed_point(lambda x: jnp.cos(a * x), jnp.zeros_like(a))


def main() -> collections.Counter[str]:
    a = jnp.array([0.5, 0.8])
    with counting() as counts:
        first = solve(a)
        second = solve(a)  # cached: no trace, so the while_loop is not counted again
        slopes = jo.jacfwd(solve)(a)  # forward mode differentiates a while_loop
    reference = jax.jit(lambda a: fixed_point(lambda x: jnp.cos(a * x), jnp.zeros_like(a)))(a)
    assert jnp.allclose(first, reference) and jnp.allclose(second, reference)
    assert slopes.shape == (2, 2)
    # Three calls of the jitted solve, one trace: jacfwd differentiates the traced
    # program, so JAX runs no Python of solve again and the while_loop counts once.
    assert counts == {"jit": 3, "lax.while_loop": 1, "jacfwd": 1}, counts
    print("calls per name:", dict(sorted(counts.items())))
    print("'jit' resolves to", kit.describe_impl(jo.resolve("jit"), "jit"), "outside the block")
    return counts


if __name__ == "__main__":
    main()
