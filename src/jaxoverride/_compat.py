"""Every JAX difference across the supported range (``jax>=0.8.1,<0.11``), in one place.

The core, the adapters, the tests and the benchmarks import these names from here rather
than from JAX, so a JAX release that moves one is handled by this file alone:

- ``get_opaque_trace_state`` and ``jaxprs_in_params``: public in ``jax.extend.core``
  from JAX 0.9; before that only in ``jax.core`` (where JAX 0.9+ deprecates them).
- ``set_user_context_global``: the context made by ``jax.make_user_context`` (new in JAX
  0.7.2, the oldest thing the core needs) has ``set_global`` only from JAX 0.9; in 0.8
  the same setter exists on the config object that the context wraps.
"""

from __future__ import annotations

from typing import Any

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


__all__ = ["get_opaque_trace_state", "jaxprs_in_params", "set_user_context_global"]
