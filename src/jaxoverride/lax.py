"""Neutral ``jax.lax``: ``scan``, ``while_loop``, ``fori_loop``, ``cond``, ``switch`` and
``map`` dispatch through the override stack; every other attribute *is* ``jax.lax``'s.

Example:
  >>> import jax
  >>> from jaxoverride import lax as jlax
  >>> jlax.add is jax.lax.add
  True
"""

from __future__ import annotations

from typing import Any

import jax.lax as _jax_lax
from jax.lax import *  # noqa: F403  # pyright: ignore[reportWildcardImportFromLibrary]

# After the star import, so that these names shadow jax.lax's.
from jaxoverride._lax import (
    cond as cond,
    fori_loop as fori_loop,
    map as map,
    scan as scan,
    switch as switch,
    while_loop as while_loop,
)

NEUTRAL = ("scan", "while_loop", "fori_loop", "cond", "switch", "map")


def __getattr__(name: str) -> Any:
    # Attributes that ``import *`` does not bring, such as submodules, come from jax.lax.
    try:
        return getattr(_jax_lax, name)
    except AttributeError:
        raise AttributeError(f"module 'jaxoverride.lax' has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted(set(dir(_jax_lax)) | set(NEUTRAL))
