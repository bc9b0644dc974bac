"""Probes: what a tracked value that a traced function was not given holds meanwhile.

A ``Probe`` knows its shape and dtype; any other use of it (reading it into a
computation, indexing, writing into it, passing it to JAX) raises ``NeedsState``, which
aborts JAX's trace so that the caller traces again with the probe's module given (see
``_touched``). A probe is the adapter's own placeholder, inside a trace that the adapter
started: it is never a value that a raw transform could bake in (see ``_stale_reads``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxoverride.adapter_kit import TraceAbort


class NeedsState(TraceAbort):
    """A probe was used: the running function touches a tracked value it was not given.

    A ``BaseException`` (``adapter_kit.TraceAbort``), so that user code that catches
    ``Exception`` cannot swallow it (it is never seen outside the adapter); the catcher
    that traces again calls ``release()`` first.
    """

    def __init__(self, owner: object, index: int):
        super().__init__(owner, index)
        self.owner = owner
        self.index = index


def _raise(self: Probe, *args: Any, **kwargs: Any) -> Any:
    raise NeedsState(self._owner, self._index)


class Probe:
    """Stands for a tracked value that the running function was not given (see module)."""

    __slots__ = ("_index", "_owner", "dtype", "shape", "weak_type")

    def __init__(self, owner: object, index: int, like: Any):
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "shape", tuple(np.shape(like)))
        object.__setattr__(self, "dtype", getattr(like, "dtype", None))
        weak = isinstance(like, (int, float, complex)) or getattr(like, "weak_type", False)
        object.__setattr__(self, "weak_type", bool(weak))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    def __getattr__(self, name: str) -> Any:
        raise NeedsState(self._owner, self._index)

    __setattr__ = _raise
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"<tracked value {self._index}, not threaded>"


# ``__jax_array__``, ``__array__`` and the like are left to ``__getattr__``: JAX and NumPy
# look them up with ``hasattr``, which then raises ``NeedsState`` instead of answering.
_USES = (
    "__getitem__ __setitem__ __delitem__ __len__ __iter__ "
    "__contains__ __bool__ __float__ __int__ __index__ __complex__ __call__ __eq__ __ne__ "
    "__lt__ __le__ __gt__ __ge__ __neg__ __pos__ __abs__ __invert__ __round__ __format__ "
    "__dlpack__"
)
_OPERATORS = "add sub mul matmul truediv floordiv mod divmod pow lshift rshift and xor or"
for _name in _USES.split() + [
    f"__{prefix}{op}__" for op in _OPERATORS.split() for prefix in ("", "r", "i")
]:
    setattr(Probe, _name, _raise)


def is_probe(x: Any) -> bool:
    return type(x) is Probe


def probe_for(owner: object, index: int, value: Any) -> Any:
    """A probe in place of ``value`` (a pytree of arrays: one probe per leaf)."""
    if isinstance(value, (jax.Array, np.ndarray, np.generic, int, float, complex, bool)):
        return Probe(owner, index, value)
    return jax.tree.map(lambda leaf: Probe(owner, index, leaf), value)


def has_probe(value: Any) -> bool:
    """Whether ``value`` (a tracked value: a pytree of arrays) holds a probe."""
    return any(map(is_probe, jax.tree.leaves(value)))


def probe_types(value: Any) -> Any:
    """``value`` (a probed tracked value: every leaf a probe, ``probe_for``) with each
    probe replaced by its type (a ``jax.ShapeDtypeStruct``)."""
    return jax.tree.map(
        lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, weak_type=p.weak_type), value
    )


def check_given(values: Sequence[Any]) -> None:
    """Raises ``NeedsState`` if one of ``values`` (about to be threaded) is a probe."""
    for value in values:
        for leaf in jax.tree.leaves(value):
            if type(leaf) is Probe:
                raise NeedsState(leaf._owner, leaf._index)
