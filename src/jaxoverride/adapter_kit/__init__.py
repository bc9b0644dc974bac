"""The adapter kit: what every jaxoverride adapter is written on.

**Who it is for.** Authors of adapters: packages that plug a framework (Haiku, Flax,
a toy of your own) into the override stack, as ``jaxoverride_haiku``, ``jaxoverride_nnx``,
``jaxoverride_plain``, ``jaxoverride_dag`` and ``jaxoverride_debug`` do. Library and model
authors never need it: they use ``jaxoverride`` and an adapter's ``context()``.

An adapter imports the public core (``jaxoverride``), this kit, ``jaxoverride.errors``
and its own framework, and nothing from ``jaxoverride._*``. What more than one adapter
needs lives here, once:

- the contract: ``Adapter`` (which names an adapter overrides, which it passes
  through to the layer below), ``OverrideTable`` that declares it, and
  ``unhandled_names``, which checks it;
- the name tables (``TRANSFORMS``, ``RULES``, ``CALLS``, ``JAX_IMPLS``) and
  ``check_name``;
- where the running override sits in the stack (``override_position``), and
  ``describe_impl``, ``jit_name`` and ``get_opaque_trace_state``; ``calls_inside``,
  for a context that is also a decorator;
- custom-rule lifting (``LiftedRule``; ``StagedPrimal`` and ``staged``: where JAX stages
  a lifted ``custom_jvp``, its primal traced once, so that it takes only the values it
  reads), the rule a JAX ``custom_jvp`` holds
  (``rule_jvp``) and the arguments of lifted rules
  (``positional_arguments``, ``fwd_output_pair``, ``bwd_cotangents``, the
  symbolic-zero helpers), and JAX's checks of the user's part of a lifted rule's
  output (``jvp_output_pair``, ``argument_types``, ``check_bwd_types``);
- the arguments of a call as JAX's function reads them (``jax_arguments``,
  ``scan_arguments``);
  argnum inference (``infer_argnums_and_argnames``, ``resolve_argnums``,
  ``shift_argnums``), a weak-keyed wrapper cache (``WrapperCache``; ``kept``: what an
  adapter keeps next to the functions handed to JAX), the replay
  that raises JAX's own error (``raise_as_jax``), batched ``lax.map``
  (``batched_map``) and the ``NO_OPERAND`` sentinel;
- the init phase (``init_context``, ``is_initializing``, ``applying``,
  ``is_applying``) and the init-safe combinators on which adapters without a state
  source build their creation pass (``init_safe_call``, ``init_safe_scan``, ...);
- the overrides of the names that convert a function into a jaxpr
  (``conversion_overrides``: ``closure_convert``, ``make_jaxpr``, the custom solves);
- the process-wide, scoped installation of an adapter entered by a hook in its
  framework (``ScopedInstaller``: ``install``, ``uninstall``, ``is_installed``);
- operands and mapped arguments as JAX hands them to a body (``as_jax_operands``,
  ``unbatched_arguments``, ``shard_block_arguments``, ...);
- state threading through JAX's control flow and transforms, for any framework that
  describes its state as a ``StateSource`` (read it, run a function with it, write it
  back; ``EnterLeaveSource`` runs with ``enter``/``leave``): ``threaded_scan``,
  ``threaded_while_loop``, ``threaded_fori_loop``, ``threaded_cond``,
  ``threaded_switch``, ``threaded_map`` and ``threaded_call`` (the Linen and Haiku
  adapters are written on all of them, NNX on ``scan``, ``while_loop``, ``fori_loop``,
  ``cond``, ``switch`` and its stateful ``map``), and ``control_flow_overrides`` /
  ``threaded_control_flow``, which make an adapter's control-flow overrides, with JAX's
  signatures, from them. Where frameworks differ, the source overrides an optional part
  of the contract, declared on ``StateSource`` with its default: ``reuse_key`` (hand JAX
  the same wrappers, and ``threaded_map`` the same scan bodies, on every call, so an
  identical eager call compiles once: Haiku, NNX), ``carried_predicate`` (``while_loop``
  tests before the loop and at the end of each step, as a Python ``while``: NNX),
  ``abort_changed_predicate`` and ``init_call`` (Haiku), ``retrace`` and
  ``alternative_branches`` (Linen);
- the transforms that trace their function once per call (``vmap``, ``grad``-like,
  ``jvp``/``vjp``/``linearize``, ``checkpoint``), for a framework that describes one
  such call as a ``TransformState`` (``stateful_mapping``, ``stateful_differentiation``,
  ...).

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
    jit_name as jit_name,
    resolve_argnums as resolve_argnums,
    rule_jvp as rule_jvp,
)
from jaxoverride._context import calls_inside as calls_inside
from jaxoverride._names import (
    CALLS as CALLS,
    JAX_IMPLS as JAX_IMPLS,
    OVERRIDEABLE as OVERRIDEABLE,
    RULES as RULES,
    TRANSFORMS as TRANSFORMS,
    check_name as check_name,
)
from jaxoverride.adapter_kit import init_safe_control
from jaxoverride.adapter_kit._adapter import (
    Adapter as Adapter,
    OverrideTable as OverrideTable,
    declared_adapters as declared_adapters,
    overrides_in as overrides_in,
    unhandled_names as unhandled_names,
)
from jaxoverride.adapter_kit._argnums import (
    as_index_tuple as as_index_tuple,
    infer_argnums_and_argnames as infer_argnums_and_argnames,
    shift_argnums as shift_argnums,
)
from jaxoverride.adapter_kit._batched_map import (
    batched_map as batched_map,
    join_batches as join_batches,
    split_batches as split_batches,
)
from jaxoverride.adapter_kit._cache import WrapperCache as WrapperCache
from jaxoverride.adapter_kit._control_overrides import (
    control_flow_overrides as control_flow_overrides,
    threaded_control_flow as threaded_control_flow,
)
from jaxoverride.adapter_kit._conversion import (
    CONVERTED_WRITE_REASON as CONVERTED_WRITE_REASON,
    conversion_overrides as conversion_overrides,
)
from jaxoverride.adapter_kit._frameworks import (
    Framework as Framework,
    declare_handler as declare_handler,
    register_framework as register_framework,
)
from jaxoverride.adapter_kit._handed import kept as kept
from jaxoverride.adapter_kit._installer import ScopedInstaller as ScopedInstaller
from jaxoverride.adapter_kit._jax_arguments import (
    jax_arguments as jax_arguments,
    scan_arguments as scan_arguments,
)
from jaxoverride.adapter_kit._leaks import (
    adapter_check_on as adapter_check_on,
    escaped_tracers as escaped_tracers,
    jit_traces as jit_traces,
    raw_read_error as raw_read_error,
    raw_transform_error as raw_transform_error,
)
from jaxoverride.adapter_kit._lifted_rule import LiftedRule as LiftedRule
from jaxoverride.adapter_kit._mapped import (
    INFER_SPECS as INFER_SPECS,
    create_binding_axes as create_binding_axes,
    mesh_axis_sizes as mesh_axis_sizes,
    shard_block_arguments as shard_block_arguments,
    varying_axes as varying_axes,
)
from jaxoverride.adapter_kit._operands import (
    NO_OPERAND as NO_OPERAND,
    as_jax_operands as as_jax_operands,
    distinct_functions as distinct_functions,
    traced_arguments as traced_arguments,
    unbatched_arguments as unbatched_arguments,
    zeros_for as zeros_for,
)
from jaxoverride.adapter_kit._phase import (
    applying as applying,
    init_context as init_context,
    is_applying as is_applying,
    is_initializing as is_initializing,
)
from jaxoverride.adapter_kit._position import (
    OverridePosition as OverridePosition,
    describe_impl as describe_impl,
    get_opaque_trace_state as get_opaque_trace_state,
    override_position as override_position,
)
from jaxoverride.adapter_kit._publish import publish_errors as publish_errors
from jaxoverride.adapter_kit._raw import (
    SOLVER_LIBRARIES as SOLVER_LIBRARIES,
    interpose_fix as interpose_fix,
    raw_import_time_transforms as raw_import_time_transforms,
)
from jaxoverride.adapter_kit._replay import (
    branch_error as branch_error,
    check_loop_carry as check_loop_carry,
    check_scan_output as check_scan_output,
    output_shapes as output_shapes,
    raise_as_jax as raise_as_jax,
)
from jaxoverride.adapter_kit._rule_args import (
    bwd_cotangents as bwd_cotangents,
    fwd_output_pair as fwd_output_pair,
    instantiate_zeros as instantiate_zeros,
    nondiff_positions as nondiff_positions,
    perturbed_leaves as perturbed_leaves,
    positional_arguments as positional_arguments,
    unwrap_primals as unwrap_primals,
    zero_tangents as zero_tangents,
)
from jaxoverride.adapter_kit._rule_checks import (
    argument_types as argument_types,
    check_bwd_types as check_bwd_types,
    jvp_output_pair as jvp_output_pair,
)
from jaxoverride.adapter_kit._staged_reads import StagedPrimal as StagedPrimal, staged as staged
from jaxoverride.adapter_kit._trace_abort import TraceAbort as TraceAbort
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
    "StagedPrimal",
    "OverridePosition",
    "OverrideTable",
    "ScopedInstaller",
    "ScopedStateSource",
    "StateSource",
    "StateStructureError",
    "StatefulCall",
    "Threaded",
    "TraceAbort",
    "TransformState",
    "WrapperCache",
    "applying",
    "argument_types",
    "as_index_tuple",
    "as_jax_operands",
    "traced_arguments",
    "batched_map",
    "branch_error",
    "bwd_cotangents",
    "calls_inside",
    "check_bwd_types",
    "check_loop_carry",
    "check_name",
    "check_scan_output",
    "control_flow_overrides",
    "conversion_overrides",
    "create_binding_axes",
    "declare_handler",
    "declared_adapters",
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
    "join_batches",
    "jvp_output_pair",
    "kept",
    "mesh_axis_sizes",
    "nondiff_positions",
    "output_shapes",
    "override_position",
    "overrides_in",
    "perturbed_leaves",
    "positional_arguments",
    "publish_errors",
    "raise_as_jax",
    "raw_import_time_transforms",
    "raw_transform_error",
    "raw_read_error",
    "jit_traces",
    "adapter_check_on",
    "register_framework",
    "resolve_argnums",
    "rule_jvp",
    "scan_arguments",
    "shard_block_arguments",
    "shift_argnums",
    "source_transform_state",
    "staged",
    "split_batches",
    "stateful_differentiation",
    "stateful_jvp",
    "stateful_mapping",
    "stateful_rematerialization",
    "stateful_transforms",
    "stateful_with_aux",
    "threaded_call",
    "threaded_cond",
    "threaded_control_flow",
    "threaded_fori_loop",
    "threaded_map",
    "threaded_scan",
    "threaded_switch",
    "threaded_while_loop",
    "unbatched_arguments",
    "unhandled_names",
    "unwrap_primals",
    "varying_axes",
    "wraps",
    "zero_tangents",
    "zeros_for",
]
from jaxoverride.adapter_kit._declared_conversion import (
    declared_closure_convert as declared_closure_convert,
    declared_custom_root as declared_custom_root,
    declared_linear_solve as declared_linear_solve,
    declared_make_jaxpr as declared_make_jaxpr,
)
from jaxoverride.adapter_kit._solve_policy import (
    NamesFramework as NamesFramework,
    Participant as Participant,
    StatePart as StatePart,
    declarations_entered as declarations_entered,
    participant as participant,
    register_solve_source as register_solve_source,
    resumed as resumed,
    unregister_solve_source as unregister_solve_source,
)
from jaxoverride.adapter_kit._state_source import (
    DictStateSource as DictStateSource,
    EnterLeaveSource as EnterLeaveSource,
    ScopedStateSource as ScopedStateSource,
    StateSource as StateSource,
)
from jaxoverride.adapter_kit._state_threading import (
    StateStructureError as StateStructureError,
    Threaded as Threaded,
    init_safe as init_safe,
    threaded_call as threaded_call,
    threaded_cond as threaded_cond,
    threaded_fori_loop as threaded_fori_loop,
    threaded_map as threaded_map,
    threaded_scan as threaded_scan,
    threaded_switch as threaded_switch,
    threaded_while_loop as threaded_while_loop,
)
from jaxoverride.adapter_kit._stateful_transforms import (
    StatefulCall as StatefulCall,
    TransformState as TransformState,
    source_transform_state as source_transform_state,
    stateful_differentiation as stateful_differentiation,
    stateful_jvp as stateful_jvp,
    stateful_mapping as stateful_mapping,
    stateful_rematerialization as stateful_rematerialization,
    stateful_transforms as stateful_transforms,
    stateful_with_aux as stateful_with_aux,
    wraps as wraps,
)
from jaxoverride.adapter_kit._write_out import (
    Written as Written,
    ahead_of_evaluation as ahead_of_evaluation,
    write_out as write_out,
    write_out_p as write_out_p,
)

__all__ += init_safe_control.__all__
__all__ += [
    "NamesFramework",
    "Participant",
    "declared_closure_convert",
    "declared_make_jaxpr",
    "declared_custom_root",
    "declared_linear_solve",
    "write_out",
    "ahead_of_evaluation",
    "write_out_p",
    "Written",
    "StatePart",
    "declarations_entered",
    "participant",
    "register_solve_source",
    "resumed",
    "unregister_solve_source",
]
publish_errors(globals())  # StateStructureError prints as jaxoverride.adapter_kit's
