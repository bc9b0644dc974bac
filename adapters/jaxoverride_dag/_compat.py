"""The private upstream names the DAG adapter uses, in one place.

- ``ArrayImpl``: JAX's concrete array class. Its constructor makes a new array object over
  an existing array's device buffers, without a copy (``_alias.fresh_alias``). Without it
  (``None``) the adapter pays for a copy instead.
"""

from __future__ import annotations

from typing import Any

ArrayImpl: Any
try:
    from jax._src.array import ArrayImpl
except ImportError:  # pragma: no cover - a JAX that moved it: copies instead of aliases
    ArrayImpl = None

PRIVATE_SYMBOLS: dict[str, str] = {
    "jax._src.array.ArrayImpl": "a new array object over the same buffers, without a copy",
}
"""Every private upstream name the DAG adapter uses, with why no public name serves.

Read, with the same constructor, in JAX 0.8.1, 0.10.2 and 0.11.2 (tested), 0.11.0, main at
0.11.1.dev (2026-08-08) and 0.12.0 (where the Python class only states the signature of
jaxlib's C++ one; a failure falls back to a copy). ``ci/private_symbols.py`` re-checks
them against a JAX checkout;
``tests/test_private_symbols.py`` fails when the adapter uses a private name not listed
here, or one that has a public name.
"""

__all__ = ["PRIVATE_SYMBOLS", "ArrayImpl"]
