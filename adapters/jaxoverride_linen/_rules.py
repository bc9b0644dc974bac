"""The implicit-differentiation names: ``custom_vjp``, ``custom_jvp``, ``closure_convert``,
``lax.custom_root`` and ``lax.custom_linear_solve`` inside bound Linen modules.

HOOK (owned by the ``linenlibs`` work): ``IMPLICIT_OVERRIDES`` maps each of those
neutral names to its Linen override. A name absent from it passes through to the layer
below (an outer override, or JAX), as names without an override always do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

IMPLICIT_OVERRIDES: dict[str, Callable[..., Any]] = {}
"""Neutral name -> Linen override, for the implicit-differentiation names."""
