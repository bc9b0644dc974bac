"""Neutral ``jax.lax``: ``scan``, ``while_loop``, ``fori_loop``, ``cond``, ``switch``,
``map``, ``custom_root`` and ``custom_linear_solve`` dispatch through the override stack;
every other attribute *is* ``jax.lax``'s.

Example:
  >>> import jax
  >>> from jaxoverride import lax as jlax
  >>> jlax.add is jax.lax.add
  True
"""

# Only underscored names of our own at module level: ``from jaxoverride.lax import *``
# must export exactly what ``from jax.lax import *`` does (jax.lax has no ``__all__``), so
# no ``from __future__ import annotations`` (it binds ``annotations``) and no ``Any``.
import typing as _typing

import jax.lax as _jax_lax
from jax.lax import *  # noqa: F403  # pyright: ignore[reportWildcardImportFromLibrary]

# After the star import, so that these names shadow jax.lax's.
from jaxoverride._lax import (
    cond as cond,
    custom_linear_solve as custom_linear_solve,
    custom_root as custom_root,
    fori_loop as fori_loop,
    map as map,
    scan as scan,
    switch as switch,
    while_loop as while_loop,
)
from jaxoverride._names import JAX_IMPLS as _JAX_IMPLS

# The overridable names are listed once, in ``_names``; this module's are the "lax." ones.
_NEUTRAL = tuple(name[4:] for name in _JAX_IMPLS if name.startswith("lax."))


def __getattr__(name: str) -> _typing.Any:
    # Attributes that ``import *`` does not bring, such as submodules, come from jax.lax.
    try:
        return getattr(_jax_lax, name)
    except AttributeError:
        raise AttributeError(f"module 'jaxoverride.lax' has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted(set(dir(_jax_lax)) | set(_NEUTRAL))
