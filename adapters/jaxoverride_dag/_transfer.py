"""Moving large numpy leaves to the CPU device with one copy.

A shared numpy array is one traced leaf, so it is transferred once however many times
it is referenced. On the CPU backend JAX adopts a 64-byte aligned host buffer without
copying it, but copies an unaligned one on a path that costs about twice a ``memcpy``
(and numpy's large arrays are usually only 16-byte aligned). For large arrays the
adapter therefore makes the one copy itself, synchronously, into an aligned buffer that
nobody else holds, and lets JAX adopt it: the caller's array may then be changed straight
after the call without effect. An aligned array is handed to JAX as it is, and JAX's rule
holds for it as under ``jax.jit``: JAX may adopt it without a copy and reads it
asynchronously, so the caller must not change it before the result is ready.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

_ALIGNMENT = 64
_MIN_BYTES = 1 << 20


def _aligned_copy(x: np.ndarray) -> np.ndarray:
    buffer = np.empty(x.nbytes + _ALIGNMENT, np.uint8)
    offset = (-buffer.ctypes.data) % _ALIGNMENT
    out = buffer[offset : offset + x.nbytes].view(x.dtype).reshape(x.shape)
    np.copyto(out, x)
    return out


def _worth_it(x: Any) -> bool:
    return (
        type(x) is np.ndarray
        and x.nbytes >= _MIN_BYTES
        and x.ctypes.data % _ALIGNMENT != 0
        and jax.dtypes.canonicalize_dtype(x.dtype) == x.dtype
    )


def transfer_shared(dyn: list[Any], jit_kwargs: dict[str, Any]) -> list[Any]:
    """``dyn`` with each large, unaligned numpy array already on the CPU device.

    Arrays stay as they are on other backends, or when the jit names a device or a
    backend, so that placement is JAX's decision there.
    """
    if not any(map(_worth_it, dyn)):
        return dyn
    if jit_kwargs.get("device") is not None or jit_kwargs.get("backend") is not None:
        return dyn
    if jax.default_backend() != "cpu":
        return dyn
    return [jax.device_put(_aligned_copy(x), may_alias=True) if _worth_it(x) else x for x in dyn]
