"""Creation passes for device-mapped functions: one shard's block, collectives bound.

The creation pass runs a ``pmap``/``shard_map`` body on the slice or block device 0
would see. A collective (``lax.psum``, ``lax.axis_index``) needs its axis bound: only
when one names an unbound mapped axis is the pass run again inside
``jax.vmap(axis_size=1)`` per axis (``psum`` sums one copy, ``axis_index`` is 0).
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxoverride._compat import ShardingTypeError

Thunk = Callable[[], Any]

INFER_SPECS: Any = inspect.signature(jax.shard_map).parameters["in_specs"].default
"""The default of ``jax.shard_map``'s ``in_specs``: read each argument's spec off its
sharding. An override of ``shard_map`` tests ``in_specs is INFER_SPECS``."""


def _is_spec(node: Any) -> bool:
    return node is None or isinstance(node, PartitionSpec)


def _leaf_spec(leaf: Any) -> PartitionSpec:
    """The spec ``in_specs=Infer`` reads off an argument: its ``NamedSharding``'s, else none."""
    spec = getattr(getattr(leaf, "sharding", None), "spec", None)
    return spec if isinstance(spec, PartitionSpec) else PartitionSpec()


def _block(leaf: Any, spec: PartitionSpec | None, sizes: dict[Any, int]) -> Any:
    leaf = jnp.asarray(leaf)
    if spec is None:
        return leaf
    index = []
    for dim, entry in enumerate(tuple(spec)):
        names = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        parts = math.prod(sizes[name] for name in names)
        index.append(slice(0, leaf.shape[dim] // parts))
    try:
        return leaf[tuple(index)]
    except ShardingTypeError:
        # An array sharded over an Explicit mesh axis: say the block is replicated.
        sharding = jax.typeof(leaf).sharding
        return leaf.at[tuple(index)].get(out_sharding=sharding.update(spec=PartitionSpec()))


def varying_axes(value: Any) -> frozenset[Any]:
    """The mesh axes over which ``value`` may differ between devices inside ``shard_map``.

    State written inside ``shard_map`` is written back once, unmapped, so it must vary
    over no axis. Reads JAX's record (``check_vma=True``) where the running JAX keeps it
    (``manual_axis_type.varying`` in JAX 0.10, ``vma`` before).

    Args:
      value: an array or tracer.

    Returns:
      The axis names, empty outside ``shard_map`` and for values reduced over every axis.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> from jaxoverride import adapter_kit
      >>> mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
      >>> seen = []
      >>> def body(block):
      ...     total = jax.lax.psum(block, "data")
      ...     seen.append([sorted(adapter_kit.varying_axes(v)) for v in (block, total)])
      ...     return block
      >>> _ = jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"))(
      ...     jnp.ones(1)
      ... )
      >>> seen
      [[['data'], []]]
    """
    aval = jax.typeof(value)
    manual = getattr(aval, "manual_axis_type", None)
    varying = getattr(manual, "varying", None) if manual is not None else None
    return frozenset(getattr(aval, "vma", ()) if varying is None else varying)


def mesh_axis_sizes(mesh: Any) -> dict[Any, int]:
    """The size of each axis of ``mesh``; the mesh in context (``jax.set_mesh``) when None.

    Args:
      mesh: a ``jax.sharding.Mesh``, an ``AbstractMesh`` or None.

    Returns:
      ``{axis_name: size}``.

    Example:
      >>> import jax
      >>> from jaxoverride.adapter_kit import mesh_axis_sizes
      >>> mesh_axis_sizes(jax.make_mesh((1,), ("data",)))
      {'data': 1}
    """
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
    return dict(mesh.shape)


def shard_block_arguments(args: tuple[Any, ...], in_specs: Any, mesh: Any) -> tuple[Any, ...]:
    """The block of ``shard_map`` arguments that the first device sees.

    Args:
      args: the positional arguments of the ``shard_map``-ped call.
      in_specs: as for ``jax.shard_map``: one ``PartitionSpec`` for every argument, or a
        tuple with a prefix tree of specs per argument; ``jax.sharding.Infer`` reads each
        argument's own ``NamedSharding``.
      mesh: the ``shard_map``'s mesh (None: the mesh in context).

    Returns:
      The arguments cut to one block: each dimension split over named mesh axes keeps
      its first ``size / prod(axis sizes)`` entries.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from jaxoverride.adapter_kit import shard_block_arguments
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> a, b = shard_block_arguments((jnp.ones((4, 3)), jnp.ones(2)), (P("data"), P()), mesh)
      >>> a.shape, b.shape
      ((4, 3), (2,))
    """
    sizes = mesh_axis_sizes(mesh)
    if in_specs is INFER_SPECS:
        return tuple(
            jax.tree_util.tree_map(lambda leaf: _block(leaf, _leaf_spec(leaf), sizes), arg)
            for arg in args
        )
    specs = tuple(in_specs) if isinstance(in_specs, (tuple, list)) and not isinstance(
        in_specs, PartitionSpec
    ) else (in_specs,) * len(args)  # fmt: skip
    return tuple(
        jax.tree_util.tree_map(
            lambda spec, subtree: jax.tree_util.tree_map(
                lambda leaf: _block(leaf, spec, sizes), subtree
            ),
            specs,
            tuple(args),
            is_leaf=_is_spec,
        )
    )


def _unbound_axis(error: NameError, axis_names: Sequence[Hashable]) -> bool:
    message = str(error)
    return "unbound axis name" in message and any(str(name) in message for name in axis_names)


def _with_axes_bound(
    thunk: Thunk, axis_names: Sequence[Hashable], inside: Callable[[], Any]
) -> Callable[[], None]:
    def run() -> None:
        def body() -> None:
            with inside():
                thunk()

        bound: Callable[[], None] = body
        for name in reversed(axis_names):
            bound = jax.vmap(bound, axis_name=name, axis_size=1, out_axes=None)
        bound()

    return run


def create_binding_axes(
    create: Callable[[Thunk], Any],
    axis_names: Sequence[Hashable],
    *,
    inside: Callable[[], Any] = contextlib.nullcontext,
) -> Callable[[Thunk], Any]:
    """A ``create`` hook for mapped bodies: collectives over ``axis_names`` work in it.

    The hook runs ``create(thunk)``; if a collective names an unbound axis of
    ``axis_names``, it runs it again inside ``jax.vmap(axis_size=1, axis_name=...)`` per
    axis. ``create`` must undo a failed pass (Haiku's removes what it made).

    Args:
      create: the ``create`` hook to extend (see ``init_safe_scan``).
      axis_names: the mapped axes of the ``pmap``/``shard_map`` whose body is created.
      inside: a context manager factory entered inside the ``vmap`` trace, around the
        thunk (Haiku moves its frame to that trace level with it).

    Returns:
      The ``create`` hook.

    Example:
      >>> import jax.numpy as jnp
      >>> from jax import lax
      >>> from jaxoverride.adapter_kit import create_binding_axes
      >>> seen = []
      >>> hook = create_binding_axes(lambda thunk: thunk(), ["i"])
      >>> hook(lambda: seen.append(lax.psum(jnp.float32(2.0), "i")))
      >>> [float(x) for x in seen]
      [2.0]
    """
    names = tuple(axis_names)

    def create_mapped(thunk: Thunk) -> Any:
        try:
            return create(thunk)
        except NameError as error:
            if not _unbound_axis(error, names):
                raise
        return create(_with_axes_bound(thunk, names, inside))

    return create_mapped
