"""Init-safe transforms: the same creation pass, then apply pass, around ``jit``, ``grad``...

A parameter created inside a transform's trace would leak a tracer: at init these wrappers
first call the function outside any transform (``vmap``/``pmap``: on one slice).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jaxoverride as jo
from jaxoverride.adapter_kit import create_by_calling, init_safe_call, is_initializing

# What ``transformed`` must have to be treated as a jitted function.
_JITTED = ("lower", "trace", "eval_shape", "clear_cache", "_cache_size")


def init_safe_transform(
    transformed: Callable[..., Any],
    creation: Callable[..., Any],
    *,
    initializing: Callable[[], bool] = is_initializing,
    create: Callable[[Callable[[], Any]], Any] = create_by_calling,
) -> Callable[..., Any]:
    """Wraps a transformed function so that calling it at init creates parameters first.

    Args:
      transformed: the transformed function, such as ``jax.jit(f)``.
      creation: called with the same arguments as ``transformed`` to create the
        parameters, outside any transform (for ``jax.grad(f)`` that is ``f`` itself).
      initializing, create: the hooks of ``init_safe_scan``.

    Returns:
      A function with the signature of ``transformed`` (and a jitted function's API, whose
      staging at init also runs the creation pass first).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxoverride_plain import init_context, init_safe_transform, is_initializing
      >>> params = {}
      >>> def f(x):
      ...     if is_initializing():
      ...         params.setdefault("w", jnp.ones(()) * 2.0)  # created outside the trace
      ...     return params["w"] * x
      >>> g = init_safe_transform(jax.grad(f), f)
      >>> with init_context():
      ...     slope = g(1.0)
      >>> float(slope), type(params["w"]).__name__
      (2.0, 'ArrayImpl')
    """

    # A jitted function keeps JAX's API; staging it at init creates the parameters first,
    # as a call does, so that the trace reads them instead of creating them.
    def stage(method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return init_safe_call(
            lambda: creation(*args, **kwargs),
            lambda: getattr(transformed, method)(*args, **kwargs),
            initializing=initializing,
            create=create,
        )

    def call(*args: Any, **kwargs: Any) -> Any:
        return stage("__call__", args, kwargs)

    if not all(hasattr(transformed, name) for name in _JITTED):
        return call
    return jo.jit_api(
        call,
        getattr(transformed, "__wrapped__", creation),
        stage=stage,
        jitted=lambda: (transformed,),
    )
