"""``shard_map`` that keeps relative identity; non-array leaves ride through as static data.

``in_specs`` is laid over the arguments with sharing expanded (a shared array is passed once,
with one spec); ``out_specs``, known per leaf only once the function has run, is handed over
as a ``Packed`` that the traced function fills in (``shard_map`` reads it after tracing).
"""

from __future__ import annotations

from collections.abc import Callable, Set
from typing import Any

import jaxoverride as jo
from jaxoverride.adapter_kit import INFER_SPECS as _INFER
from jaxoverride_dag._out import packing_outputs, unforward_tree
from jaxoverride_dag._plan import encode
from jaxoverride_dag._shardings import spread_shardings

_LABEL = "shard_map arguments"


def dag_shard_map(
    f: Callable[..., Any],
    /,
    *,
    out_specs: Any,
    in_specs: Any = _INFER,
    mesh: Any = None,
    axis_names: Set[Any] = frozenset(),
    check_vma: bool = True,
) -> Callable[..., Any]:
    """The ``"shard_map"`` override: ``jax.shard_map``'s signature, identity-preserving."""
    if not callable(f):
        raise TypeError(f"jaxoverride.shard_map: expected a callable value, got {f!r}.")
    below = jo.next_impl("shard_map")
    specs_by_plan: dict[Any, tuple[Any, ...]] = {}

    def spread_out_specs(out_plan: Any) -> tuple[Any, ...]:
        return spread_shardings(out_plan, out_specs, api="shard_map", what="out_specs")

    def mapped(*args: Any) -> Any:
        plan, dyn = encode((args, {}), _LABEL, "call")
        if in_specs is _INFER:
            specs: Any = _INFER
        else:
            specs = specs_by_plan.get(plan)
            if specs is None:
                specs = spread_shardings(
                    plan, (in_specs, {}), api="shard_map", what="in_specs", noun="spec"
                )
                if len(specs_by_plan) >= 256:
                    specs_by_plan.clear()
                specs_by_plan[plan] = specs
        traced, carrier = packing_outputs(f, plan, "shard_map outputs", spread_out_specs)
        traced.__name__ = getattr(f, "__name__", "traced")
        result = below(
            traced,
            out_specs=carrier,
            in_specs=specs,
            mesh=mesh,
            axis_names=axis_names,
            check_vma=check_vma,
        )(*dyn)
        return unforward_tree(result, dyn).unpack()

    mapped.__wrapped__ = f  # type: ignore[attr-defined]
    return mapped
