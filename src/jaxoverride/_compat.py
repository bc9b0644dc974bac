"""Every JAX difference across the supported range (``jax>=0.8.1,<0.11``), in one place.

The core, the adapters, the tests and the benchmarks import these names from here rather
than from JAX, so a JAX release that moves one is handled by this file alone:

- ``get_opaque_trace_state`` and ``jaxprs_in_params``: public in ``jax.extend.core``
  from JAX 0.9; before that only in ``jax.core`` (where JAX 0.9+ deprecates them).
- ``set_user_context_global``: the context made by ``jax.make_user_context`` (new in JAX
  0.7.2, the oldest thing the core needs) has ``set_global`` only from JAX 0.9; in 0.8
  the same setter exists on the config object that the context wraps.
- ``rule_nondiff_argnums``: ``jax.custom_vjp(f)`` is a ``custom_vjp3`` object when the flag
  ``jax_custom_vjp3`` is on (JAX 0.8.1 onwards; its planned default), and that object keeps
  the positions as a frozenset ``static_argnums`` instead of the sorted tuple
  ``nondiff_argnums``.
- ``jit_name``: ``jax.jit`` names the program of a callable without ``__name__``
  ``<unnamed wrapped function>`` before JAX 0.10 and ``<unnamed function>`` after.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax._src.util import fun_name

try:
    from jax.extend.core import (
        get_opaque_trace_state as get_opaque_trace_state,
        jaxprs_in_params as jaxprs_in_params,
    )
except ImportError:  # JAX < 0.9: the same functions, only under jax.core.
    from jax.core import (  # type: ignore[no-redef]
        get_opaque_trace_state as get_opaque_trace_state,
        jaxprs_in_params as jaxprs_in_params,
    )


def set_user_context_global(context: Any, value: Any) -> None:
    """Sets the value that a ``jax.make_user_context`` context has in every thread.

    Args:
      context: what ``jax.make_user_context`` returned.
      value: the new process-wide value (part of ``jax.jit``'s cache key).

    Returns:
      None.

    Example:
      >>> import jax
      >>> from jaxoverride._compat import set_user_context_global
      >>> key = jax.make_user_context(0)
      >>> set_user_context_global(key, 1)
      >>> key.value
      1
    """
    setter = getattr(context, "set_global", None)
    if setter is None:  # JAX 0.8: only the wrapped config object has the setter.
        setter = context._obj.set_global
    setter(value)


def rule_nondiff_argnums(rule: Any) -> tuple[int, ...]:
    """The non-differentiable positions of a JAX ``custom_vjp``/``custom_jvp`` object.

    Args:
      rule: what ``jax.custom_vjp(f, ...)`` or ``jax.custom_jvp(f, ...)`` returned; a
        ``custom_vjp3`` object under ``jax_custom_vjp3``.

    Returns:
      The positions from ``nondiff_argnums`` and ``nondiff_argnames``, sorted.

    Example:
      >>> import jax
      >>> from jaxoverride._compat import rule_nondiff_argnums
      >>> rule_nondiff_argnums(jax.custom_vjp(lambda f, x: f(x), nondiff_argnums=(0,)))
      (0,)
    """
    argnums = getattr(rule, "nondiff_argnums", None)
    if argnums is None:  # custom_vjp3: a frozenset, under another name
        argnums = sorted(rule.static_argnums)
    return tuple(argnums)


@functools.cache
def _unnamed() -> str:
    class Nameless:
        def __call__(self, x: Any) -> Any:
            return x

    # What this JAX calls it, read off a trace (no compilation): the default moved. The
    # first caller may run under jax.disable_jit(), where jit would leave no equation.
    with jax.disable_jit(False):
        return jax.make_jaxpr(jax.jit(Nameless()))(0.0).eqns[0].params["name"]


def jit_name(fun: Callable[..., Any]) -> str:
    """The name ``jax.jit`` gives ``fun``'s program (a partial by its function).

    An adapter whose ``jit`` traces a wrapper of ``fun`` names the wrapper this, so that
    its lowering and jaxprs read as ``jax.jit(fun)``'s do.

    Args:
      fun: the function passed to ``jit``.

    Returns:
      Its ``__name__``, its partial's function's, or JAX's name for an unnamed callable.

    Example:
      >>> import functools
      >>> from jaxoverride._compat import jit_name
      >>> jit_name(functools.partial(max, 1))
      'max'
    """
    return fun_name(fun, _unnamed())


PRIVATE_SYMBOLS: dict[str, str] = {
    "jax._src.util.fun_name": (
        "the name jax.jit gives a callable's program (jit_name); JAX has no public helper"
    ),
}
"""Every private upstream name the core uses, with why no public name serves.

Each was read, with the same signature, in JAX 0.8.1 and 0.10.2 (tested), 0.11.0 and main
at 0.11.1.dev (read on 2026-08-08); ``ci/private_symbols.py`` re-checks them against JAX,
Haiku and Flax git checkouts. See "Private symbols and supported versions" in
``docs/design.md``. ``tests/test_private_symbols.py`` fails when the
core uses a private name not listed here, or one that has a public name.
"""


__all__ = [
    "get_opaque_trace_state",
    "jaxprs_in_params",
    "PRIVATE_SYMBOLS",
    "jit_name",
    "rule_nondiff_argnums",
    "set_user_context_global",
]
