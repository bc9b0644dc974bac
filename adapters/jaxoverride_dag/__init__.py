"""Identity-preserving transforms: shared sub-objects and arrays stay shared.

``jaxoverride_dag.context()`` makes every neutral transform (``jaxoverride.jit``,
``vmap``, ``pmap``, ``shard_map``, ``grad`` and the rest) and the neutral control flow
(``jaxoverride.lax.scan`` and the rest) keep the relative identity of pytrees: shared
nodes and arrays stay shared, tied parameters get one summed gradient, shared arrays
are transferred once, and non-array leaves ride along as static data. It needs nothing
beyond JAX.
"""

from jaxoverride.adapter_kit import publish_errors as _publish_errors
from jaxoverride_dag._context import context as context
from jaxoverride_dag._errors import SharingError as SharingError
from jaxoverride_dag._tree_map import tree_map as tree_map

__all__ = ["SharingError", "context", "tree_map"]

_publish_errors(globals())  # its errors print as jaxoverride_dag.<Name>
