"""The adapter kit: what every jaxoverride adapter is written on.

**Who it is for.** Authors of adapters: packages that plug a framework (Haiku, Flax,
a toy of your own) into the override stack, as ``jaxoverride_haiku``, ``jaxoverride_nnx``,
``jaxoverride_plain``, ``jaxoverride_dag`` and ``jaxoverride_debug`` do. Library and model
authors never need it: they use ``jaxoverride`` and an adapter's ``context()``.

An adapter imports the public core (``jaxoverride``), this kit, ``jaxoverride.errors``
and its own framework, and nothing from ``jaxoverride._*``. What more than one adapter
needs lives here, once: the adapter contract (``Adapter``), the name tables, custom-rule
lifting (``LiftedRule``), state threading through JAX's control flow and transforms for
any framework that describes its state as a ``StateSource``, the init phase and the
init-safe combinators. The API reference page of ``jaxoverride.adapter_kit`` lists every
name by topic; the guide "Writing an adapter" builds a complete adapter on them.

**Stability.** Semi-public, in the way ``equinox.internal`` is: every name here is
documented and tested, and the adapters in this repository reach the core's internals
through nothing else, but it may change in a minor release, when JAX or an adapter
needs it to. Pin jaxoverride's minor version if you ship an adapter outside this
repository. Names not exported here (``jaxoverride.adapter_kit._*``) are private.

Example:
  >>> import jaxoverride as jo
  >>> from jaxoverride import adapter_kit as kit
  >>> sorted(kit.RULES)
  ['custom_jvp', 'custom_vjp']
  >>> kit.check_name("lax.scan", where="example")
  'lax.scan'
"""

from jaxoverride._compat import (
    jit_name,
    resolve_argnums,
    rule_jvp,
)
from jaxoverride._context import (
    calls_inside,
)
from jaxoverride._names import (
    CALLS,
    JAX_IMPLS,
    OVERRIDEABLE,
    RULES,
    TRANSFORMS,
    check_name,
)
from jaxoverride.adapter_kit import init_safe_control
from jaxoverride.adapter_kit._adapter import (
    Adapter,
    OverrideTable,
    declared_adapters,
    overrides_in,
    unhandled_names,
)
from jaxoverride.adapter_kit._argnums import (
    as_index_tuple,
    infer_argnums_and_argnames,
    shift_argnums,
)
from jaxoverride.adapter_kit._batched_map import (
    batched_map,
    join_batches,
    split_batches,
)
from jaxoverride.adapter_kit._cache import (
    WrapperCache,
)
from jaxoverride.adapter_kit._control_overrides import (
    threaded_control_flow,
)
from jaxoverride.adapter_kit._conversion import (
    CONVERTED_WRITE_REASON,
    conversion_overrides,
)
from jaxoverride.adapter_kit._declared_conversion import (
    declared_closure_convert,
    declared_make_jaxpr,
)
from jaxoverride.adapter_kit._frameworks import (
    Framework,
    declare_handler,
    register_framework,
)
from jaxoverride.adapter_kit._handed import (
    kept,
)
from jaxoverride.adapter_kit._installer import (
    ScopedInstaller,
)
from jaxoverride.adapter_kit._jax_arguments import (
    jax_arguments,
    scan_arguments,
)
from jaxoverride.adapter_kit._leaks import (
    adapter_check_on,
    escaped_tracers,
    jit_traces,
    raw_read_error,
    raw_transform_error,
)
from jaxoverride.adapter_kit._lifted_rule import (
    LiftedRule,
)
from jaxoverride.adapter_kit._mapped import (
    INFER_SPECS,
    create_binding_axes,
    mesh_axis_sizes,
    shard_block_arguments,
    varying_axes,
)
from jaxoverride.adapter_kit._operands import (
    NO_OPERAND,
    as_jax_operands,
    distinct_functions,
    traced_arguments,
    unbatched_arguments,
    zeros_for,
)
from jaxoverride.adapter_kit._phase import (
    applying,
    init_context,
    is_applying,
    is_initializing,
)
from jaxoverride.adapter_kit._position import (
    OverridePosition,
    describe_impl,
    get_opaque_trace_state,
    override_position,
)
from jaxoverride.adapter_kit._publish import (
    publish_errors,
)
from jaxoverride.adapter_kit._raw import (
    SOLVER_LIBRARIES,
    interpose_fix,
    raw_import_time_transforms,
)
from jaxoverride.adapter_kit._replay import (
    branch_error,
    check_loop_carry,
    check_scan_output,
    output_shapes,
    raise_as_jax,
)
from jaxoverride.adapter_kit._rule_args import (
    bwd_cotangents,
    fwd_output_pair,
    instantiate_zeros,
    nondiff_positions,
    perturbed_leaves,
    positional_arguments,
    unwrap_primals,
    zero_tangents,
)
from jaxoverride.adapter_kit._rule_checks import (
    argument_types,
    check_bwd_types,
    jvp_output_pair,
)
from jaxoverride.adapter_kit._solve_policy import (
    Participant,
    StatePart,
    declarations_entered,
    participant,
    register_solve_source,
    resumed,
    unregister_solve_source,
)
from jaxoverride.adapter_kit._staged_reads import (
    StagedPrimal,
    staged,
)
from jaxoverride.adapter_kit._state_source import (
    DictStateSource,
    EnterLeaveSource,
    ScopedStateSource,
    StateSource,
)
from jaxoverride.adapter_kit._state_threading import (
    StateStructureError,
    Threaded,
    init_safe,
    threaded_call,
    threaded_cond,
    threaded_fori_loop,
    threaded_map,
    threaded_scan,
    threaded_switch,
    threaded_while_loop,
)
from jaxoverride.adapter_kit._stateful_transforms import (
    StatefulCall,
    TransformState,
    source_transform_state,
    stateful_transforms,
    wraps,
)
from jaxoverride.adapter_kit._trace_abort import (
    TraceAbort,
)
from jaxoverride.adapter_kit._write_out import (
    Written,
    ahead_of_evaluation,
    write_out,
)
from jaxoverride.adapter_kit.init_safe_control import *  # noqa: F403  (its __all__, listed once)

__all__ = [
    "CALLS",
    "CONVERTED_WRITE_REASON",
    "INFER_SPECS",
    "JAX_IMPLS",
    "NO_OPERAND",
    "OVERRIDEABLE",
    "RULES",
    "SOLVER_LIBRARIES",
    "TRANSFORMS",
    "Adapter",
    "DictStateSource",
    "EnterLeaveSource",
    "Framework",
    "LiftedRule",
    "OverridePosition",
    "OverrideTable",
    "Participant",
    "ScopedInstaller",
    "ScopedStateSource",
    "StagedPrimal",
    "StatePart",
    "StateSource",
    "StateStructureError",
    "StatefulCall",
    "Threaded",
    "TraceAbort",
    "TransformState",
    "WrapperCache",
    "Written",
    "adapter_check_on",
    "ahead_of_evaluation",
    "applying",
    "argument_types",
    "as_index_tuple",
    "as_jax_operands",
    "batched_map",
    "branch_error",
    "bwd_cotangents",
    "calls_inside",
    "check_bwd_types",
    "check_loop_carry",
    "check_name",
    "check_scan_output",
    "conversion_overrides",
    "create_binding_axes",
    "declarations_entered",
    "declare_handler",
    "declared_adapters",
    "declared_closure_convert",
    "declared_make_jaxpr",
    "describe_impl",
    "distinct_functions",
    "escaped_tracers",
    "fwd_output_pair",
    "get_opaque_trace_state",
    "infer_argnums_and_argnames",
    "init_context",
    "init_safe",
    "instantiate_zeros",
    "interpose_fix",
    "is_applying",
    "is_initializing",
    "jax_arguments",
    "jit_name",
    "jit_traces",
    "join_batches",
    "jvp_output_pair",
    "kept",
    "mesh_axis_sizes",
    "nondiff_positions",
    "output_shapes",
    "override_position",
    "overrides_in",
    "participant",
    "perturbed_leaves",
    "positional_arguments",
    "publish_errors",
    "raise_as_jax",
    "raw_import_time_transforms",
    "raw_read_error",
    "raw_transform_error",
    "register_framework",
    "register_solve_source",
    "resolve_argnums",
    "resumed",
    "rule_jvp",
    "scan_arguments",
    "shard_block_arguments",
    "shift_argnums",
    "source_transform_state",
    "split_batches",
    "staged",
    "stateful_transforms",
    "threaded_call",
    "threaded_cond",
    "threaded_control_flow",
    "threaded_fori_loop",
    "threaded_map",
    "threaded_scan",
    "threaded_switch",
    "threaded_while_loop",
    "traced_arguments",
    "unbatched_arguments",
    "unhandled_names",
    "unregister_solve_source",
    "unwrap_primals",
    "varying_axes",
    "wraps",
    "write_out",
    "zero_tangents",
    "zeros_for",
]
__all__ += init_safe_control.__all__
publish_errors(globals())  # StateStructureError prints as jaxoverride.adapter_kit's
