"""Generic init-safe control flow for code that creates parameters as it first runs.

``init_context()`` marks parameter creation; the ``init_safe_*`` combinators run each
body or branch once to create its parameters, then run the ordinary JAX loop, so that
init returns what apply returns. ``init_safe_transform`` does the same around ``jit``,
``grad`` and the other transforms. ``context()`` makes the neutral API use them. No
dependency beyond jaxoverride.
"""

# Helpers this package documented before they moved to ``jaxoverride.adapter_kit``,
# where new code should import them from; kept here so that existing imports work.
from jaxoverride.adapter_kit import (
    applying as applying,
    as_jax_operands as as_jax_operands,
    bwd_cotangents as bwd_cotangents,
    create_binding_axes as create_binding_axes,
    distinct_functions as distinct_functions,
    fwd_output_pair as fwd_output_pair,
    init_context as init_context,
    init_safe_control,
    instantiate_zeros as instantiate_zeros,
    is_applying as is_applying,
    is_initializing as is_initializing,
    mesh_axis_sizes as mesh_axis_sizes,
    nondiff_positions as nondiff_positions,
    perturbed_leaves as perturbed_leaves,
    positional_arguments as positional_arguments,
    shard_block_arguments as shard_block_arguments,
    unbatched_arguments as unbatched_arguments,
    unwrap_primals as unwrap_primals,
    varying_axes as varying_axes,
    zero_tangents as zero_tangents,
    zeros_for as zeros_for,
)
from jaxoverride.adapter_kit.init_safe_control import *  # noqa: F403  (the kit's list of them)
from jaxoverride_plain._context import context as context
from jaxoverride_plain._transforms import init_safe_transform as init_safe_transform

__all__ = [
    "applying",
    "as_jax_operands",
    "bwd_cotangents",
    "context",
    "create_binding_axes",
    "distinct_functions",
    "fwd_output_pair",
    "init_context",
    "init_safe_transform",
    "instantiate_zeros",
    "is_applying",
    "is_initializing",
    "mesh_axis_sizes",
    "nondiff_positions",
    "perturbed_leaves",
    "positional_arguments",
    "shard_block_arguments",
    "unbatched_arguments",
    "unwrap_primals",
    "varying_axes",
    "zero_tangents",
    "zeros_for",
]
__all__ += init_safe_control.__all__
