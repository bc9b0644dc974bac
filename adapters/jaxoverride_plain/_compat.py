"""The private upstream names the plain adapter uses, in one place.

- ``fun_signature`` and ``infer_argnums_and_argnames``: ``jax.jit``'s own reading of
  ``static_argnums``/``static_argnames`` against a signature, so the creation pass at init
  treats exactly JAX's static arguments as static. JAX has no public equivalent.
"""

from __future__ import annotations

from jax._src.api_util import (
    fun_signature as fun_signature,
    infer_argnums_and_argnames as infer_argnums_and_argnames,
)

PRIVATE_SYMBOLS: dict[str, str] = {
    "jax._src.api_util.fun_signature": "jit's own reading of a signature",
    "jax._src.api_util.infer_argnums_and_argnames": "jit's own static-argument resolution",
}
"""Every private upstream name the plain adapter uses, with why no public name serves.

Read, with the same signatures, in JAX 0.8.1 and 0.10.2 (tested), 0.11.0 and main at
0.11.1.dev (2026-08-08). ``ci/private_symbols.py`` re-checks them against a JAX checkout;
``tests/test_private_symbols.py`` fails when the adapter uses a private name not listed
here, or one that has a public name.
"""

__all__ = ["PRIVATE_SYMBOLS", "fun_signature", "infer_argnums_and_argnames"]
