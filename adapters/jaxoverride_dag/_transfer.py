"""Moving large numpy leaves to the CPU device with one copy.

A shared numpy array is one traced leaf, transferred once. On CPU JAX adopts a 64-byte
aligned host buffer without a copy, but copies an unaligned one (numpy's large arrays are
usually 16-byte aligned) at about twice a ``memcpy``; so the adapter makes the one copy
itself into an aligned buffer nobody else holds, and the caller may change its array right
after the call. An aligned array is handed over as it is, under ``jax.jit``'s rule: JAX may
adopt it and read it asynchronously.
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
