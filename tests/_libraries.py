"""Shared helpers for the tests of unmodified third-party solver libraries.

``interposed(*packages)`` interposes whole installed packages (every imported submodule)
and undoes it on exit. ``eager_calls`` counts how often a callback runs when the library
runs eagerly (``jax.disable_jit()`` turns ``lax.while_loop``/``scan``/``cond`` into Python
loops), which is what an adapter that threads state must leave in a call counter.

The solvers under test, and which of their modules hold the ``jax``/``lax`` references:

- jaxopt: ``jaxopt._src.loop`` (``jax.lax.while_loop``/``scan``/``cond``, ``jax.jit``),
  ``jaxopt._src.base`` (``jax.jit(self.update)``), ``jaxopt._src.implicit_diff``
  (``jax.custom_vjp``, ``jax.vjp``) and the solver modules: ``interposed("jaxopt")``.
- optax: ``optax._src.linear_algebra`` (``power_iteration``: ``from jax import lax``).
- optimistix / diffrax / lineax: ``eqx.filter_jit`` at import, ``eqx.filter_closure_convert``
  (``jax.make_jaxpr``) and ``equinox.internal.while_loop``: they are interposed with
  ``equinox`` too, and still fail with a state-writing callback (the tests pin why).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import jax

import jaxoverride as jo

EQUINOX_FAMILY = ("optimistix", "diffrax", "lineax", "equinox")


@contextlib.contextmanager
def interposed(*packages: str) -> Iterator[list[jo.Interposition]]:
    """Interposes each package recursively for the block; restores every binding on exit."""
    with contextlib.ExitStack() as stack:
        handles = [
            stack.enter_context(jo.interpose(importlib.import_module(name), recursive=True))
            for name in packages
        ]
        for name, handle in zip(packages, handles, strict=True):
            # A package whose layout changed would otherwise run raw JAX, unnoticed.
            assert handle.rebound, f"interposing {name} rebound nothing"
        yield handles


def eager_calls(run: Callable[[Callable[..., Any]], Any], callback: Callable[..., Any]) -> int:
    """How often ``run(counted_callback)`` calls the callback with JAX's loops as Python loops."""
    calls = 0

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return callback(*args, **kwargs)

    with jax.disable_jit():
        run(counted)
    return calls
