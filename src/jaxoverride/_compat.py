"""Every JAX difference across the supported range (``jax>=0.8.1,<0.11``), in one place.

The core itself uses only public JAX (``jax.make_user_context``, new in JAX 0.7.2, is
the oldest thing it needs). The adapters, tests and benchmarks in this repository import
these names from here rather than from JAX, so a JAX release that moves one is handled
by this file alone:

- ``get_opaque_trace_state`` and ``jaxprs_in_params``: public in ``jax.extend.core``
  from JAX 0.9; before that only in ``jax.core`` (where JAX 0.9+ deprecates them).
"""

from __future__ import annotations

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

__all__ = ["get_opaque_trace_state", "jaxprs_in_params"]
