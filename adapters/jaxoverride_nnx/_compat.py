"""Every Flax difference across the supported range (``flax>=0.12.1,<0.13``), in one place.

The adapter reads Flax NNX internals (``graphlib``, ``variablelib``, ``pytreelib``,
``tracers``), which is why ``pyproject.toml`` bounds Flax above. Within the range:

- ``flax.nnx.graphlib`` is named ``flax.nnx.graph`` before Flax 0.12.5 (0.12.5 renamed
  it and kept ``graph`` as a re-export).
- ``graphlib.DataElem`` / ``StaticElem`` (0.12.5+) wrap a node's items to mark them as
  data or static. Earlier releases never wrap an item, so here they stand for classes that
  nothing is an instance of, and the ``isinstance`` checks are simply false.
"""

from __future__ import annotations

from typing import Any

try:
    from flax.nnx import graphlib as graphlib
except ImportError:  # Flax < 0.12.5: the same module under its old name.
    from flax.nnx import graph as graphlib  # type: ignore[no-redef]


class _NeverWrapped:
    """Stands for an item wrapper that this Flax release does not have."""

    value: Any


DataElem: type = getattr(graphlib, "DataElem", _NeverWrapped)
StaticElem: type = getattr(graphlib, "StaticElem", _NeverWrapped)

__all__ = ["DataElem", "StaticElem", "graphlib"]
