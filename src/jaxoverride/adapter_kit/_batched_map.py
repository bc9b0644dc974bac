"""``lax.map`` with ``batch_size``: a scan over ``vmap``-ed blocks, then the remainder.

An adapter whose ``lax.map`` threads state runs JAX's own structure with its own scan
and ``vmap``: the elements split into full blocks of ``batch_size`` (scanned, each block
``vmap``-ed) and a remainder (one ``vmap``), and the results joined in order. The split
is JAX's own, so every batch size (0 included, which JAX versions read differently)
gives the blocks ``jax.lax.map`` would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

# Private in every supported JAX (0.8.1 to 0.10.2); the split must match jax.lax.map's.
from jax._src.lax.control_flow.loops import _batch_and_remainder


def split_batches(xs: Any, batch_size: int) -> tuple[Any | None, Any | None]:
    """``xs`` as ``(blocks, remainder)``, as ``jax.lax.map(..., batch_size=)`` splits it.

    Args:
      xs: the mapped pytree (leading axis: the elements).
      batch_size: elements per block; 0 puts every element in the remainder.

    Returns:
      ``blocks`` with leaves of shape ``(count // batch_size, batch_size, ...)`` (``None``
      when there is no full block), and the remaining elements (``None`` when none remain).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxoverride.adapter_kit import split_batches
      >>> blocks, rest = split_batches(jnp.arange(7), 3)
      >>> blocks.shape, rest.shape
      ((2, 3), (1,))
    """
    return _batch_and_remainder(xs, batch_size)


def join_batches(block_ys: Any | None, remainder_ys: Any | None) -> Any:
    """The results of ``split_batches``'s parts as one result, elements in order.

    Args:
      block_ys: what the scan over the blocks returned (leaves ``(blocks, batch, ...)``),
        or ``None``.
      remainder_ys: what the ``vmap`` over the remainder returned, or ``None``.

    Returns:
      The stacked results of every element.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxoverride.adapter_kit import join_batches
      >>> join_batches(jnp.zeros((2, 3)), jnp.ones(1)).tolist()
      [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    """
    if block_ys is None:
        return remainder_ys
    flat = jax.tree.map(lambda y: y.reshape(-1, *y.shape[2:]), block_ys)
    if remainder_ys is None:
        return flat
    return jax.tree.map(lambda y, r: jax.lax.concatenate([y, r], dimension=0), flat, remainder_ys)


def batched_map(
    map_blocks: Callable[[Any], Any],
    map_remainder: Callable[[Any], Any],
    xs: Any,
    batch_size: int,
) -> Any:
    """``jax.lax.map(f, xs, batch_size=batch_size)`` from an adapter's scan and ``vmap``.

    Args:
      map_blocks: maps the blocks (leaves ``(blocks, batch_size, ...)``), typically a
        scan whose body is ``vmap(f)``; returns leaves ``(blocks, batch_size, ...)``.
      map_remainder: maps the remaining elements, typically ``vmap(f)``.
      xs: the mapped pytree.
      batch_size: as for ``jax.lax.map``.

    Returns:
      What ``jax.lax.map`` returns.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxoverride.adapter_kit import batched_map
      >>> f = lambda x: x * 2
      >>> blocks = lambda b: jax.lax.scan(lambda _, x: ((), jax.vmap(f)(x)), (), b)[1]
      >>> batched_map(blocks, jax.vmap(f), jnp.arange(5.0), 2).tolist()
      [0.0, 2.0, 4.0, 6.0, 8.0]
    """
    blocks, remainder = split_batches(xs, batch_size)
    block_ys = None if blocks is None else map_blocks(blocks)
    remainder_ys = None if remainder is None else map_remainder(remainder)
    return join_batches(block_ys, remainder_ys)
