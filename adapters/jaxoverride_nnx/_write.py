"""Writing new values into tracked Variables at the calling level, all or nothing."""

from __future__ import annotations

from typing import Any

from jax.core import Tracer

from jaxoverride_nnx._errors import LevelError
from jaxoverride_nnx._graph import RAW, TRACE
from jaxoverride_nnx._tracked import Tracked


def write_back(tracked: Tracked, updates: dict[int, Any], where: str) -> None:
    """Stores new Variable values at the calling level; all or nothing."""
    variables = tracked.variables
    for index, value in updates.items():
        if isinstance(value, Tracer) and not TRACE.__get__(variables[index]).is_valid():
            raise LevelError(
                f"jaxoverride_nnx: {where} updated the tracked Variable `{tracked.path(index)}`, "
                "but it was called inside a JAX transform that is not a jaxoverride neutral "
                "function (a raw jax.* or nnx.* transform), where the Variable cannot hold the "
                "new value. Use the neutral function there too (jaxoverride.jit, "
                "jaxoverride.grad, ...)."
            )
    for index, value in updates.items():
        RAW.__set__(variables[index], value)
