"""``vmap`` that keeps relative identity; non-array leaves ride through unmapped.

``in_axes`` is laid over the expanded arguments; ``out_axes``, known per leaf only once the
function has run, is handed over as a ``Packed`` the traced function fills in.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

import jaxoverride as jo
from jaxoverride.adapter_kit import raise_as_jax
from jaxoverride_dag._axes import spread, spread_splitting
from jaxoverride_dag._out import packing_outputs, unforward_tree
from jaxoverride_dag._plan import Plan, encode
from jaxoverride_dag._reshare import rebase

_LABEL = "vmap arguments"


def _ignore(*args: Any, **kwargs: Any) -> None:
    """What JAX's checks replay on: never called, since JAX checks ``in_axes`` first."""


def check_in_axes(api: str, in_axes: Any) -> Any:
    """``in_axes`` as JAX canonicalises it (a list becomes a tuple), or JAX's error (the
    adapter's for ``pmap``, which JAX checks only when called)."""
    if isinstance(in_axes, list):
        in_axes = tuple(in_axes)
    if not (in_axes is None or isinstance(in_axes, int | tuple)):
        raw = jax.vmap if api == "vmap" else jax.pmap
        raise_as_jax(
            lambda: raw(_ignore, in_axes=in_axes),
            TypeError(
                f"jaxoverride_dag.{api}: in_axes must be an int, None, or a tuple with one "
                f"entry per positional argument of the function, but got {in_axes}."
            ),
        )
    return in_axes


def call_prefix(
    api: str, in_axes: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
) -> Any:
    """The prefix of the ``(args, kwargs)`` pair: keyword arguments are mapped on axis 0.
    A tuple ``in_axes`` of the wrong length raises JAX's own error for ``vmap``, the
    adapter's for ``pmap`` (whose ``args`` here are placeholders)."""
    if isinstance(in_axes, tuple) and len(in_axes) != len(args):
        ours = ValueError(
            f"jaxoverride_dag.{api}: in_axes must be an int, None, or a tuple with one "
            f"entry per positional argument of the function, but got {len(in_axes)} "
            f"entries for {len(args)} positional arguments."
        )
        if api != "vmap":
            raise ours
        raise_as_jax(lambda: jax.vmap(_ignore, in_axes=in_axes)(*args, **(kwargs or {})), ours)
    return (in_axes, 0)


def output_axes(plan: Plan, out_axes: Any, api: str) -> tuple[Any, ...]:
    """``out_axes`` spread over the traced leaves of the output plan."""
    if out_axes is None or isinstance(out_axes, int):
        return (out_axes,) * plan.n_dyn
    return spread(plan, out_axes, api=api, what="out_axes", noun="output axis")


class _AxesCache:
    """Spread ``in_axes`` per plan: the spreading walks the tree, the lookup does not."""

    __slots__ = ("_by_plan",)

    def __init__(self) -> None:
        self._by_plan: dict[Any, tuple[Any, ...]] = {}

    def get(self, plan: Plan, key: Any, prefix: Any, api: str) -> tuple[Plan, tuple[Any, ...]]:
        """``(plan to trace with, its axes)``: ``plan`` split where its axes disagree."""
        found = self._by_plan.get((plan, key))
        if found is None:
            if prefix == (0, 0):  # the default: every traced leaf on axis 0
                found = (plan, (0,) * plan.n_dyn)
            else:
                found = spread_splitting(plan, prefix, api=api, what="in_axes", noun="mapped axis")
            if len(self._by_plan) >= 256:
                self._by_plan.clear()
            self._by_plan[(plan, key)] = found
        return found


def _sizes_error(
    error: ValueError,
    fun: Callable[..., Any],
    in_axes: Any,
    axis_size: int | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> ValueError:
    """JAX's own error for inconsistent mapped sizes, naming the user's arguments, not a
    plan's flat leaves: a raw ``jax.vmap`` of a stand-in for ``fun`` over them (JAX checks
    sizes before tracing). Any other error keeps the adapter's."""
    if "inconsistent sizes" not in str(error):
        return error
    stand_in = functools.wraps(fun)(lambda *_, **__: None)
    try:
        jax.eval_shape(jax.vmap(stand_in, in_axes=in_axes, axis_size=axis_size), *args, **kwargs)
    except ValueError as jax_error:
        if "inconsistent sizes" in str(jax_error):
            return jax_error
    except Exception:  # arguments raw jax.vmap cannot map: keep the adapter's message
        pass
    return error


def dag_vmap(
    fun: Callable[..., Any],
    in_axes: Any = 0,
    out_axes: Any = 0,
    axis_name: Any = None,
    axis_size: int | None = None,
    spmd_axis_name: Any = None,
    **options: Any,
) -> Callable[..., Any]:
    """The ``"vmap"`` override: ``jax.vmap``'s signature, identity-preserving result."""
    if not callable(fun):
        raise TypeError(f"jaxoverride.vmap: expected a callable value, got {fun!r}.")
    in_axes = check_in_axes("vmap", in_axes)
    cache = _AxesCache()
    vmap_below = jo.next_impl("vmap")
    options = {
        "axis_name": axis_name,
        "axis_size": axis_size,
        "spmd_axis_name": spmd_axis_name,
        **options,
    }

    def spread_out_axes(out_plan: Plan) -> tuple[Any, ...]:
        return output_axes(out_plan, out_axes, "vmap")

    def mapped(*args: Any, **kwargs: Any) -> Any:
        prefix = call_prefix("vmap", in_axes, args, kwargs)
        call_plan, dyn = encode((args, kwargs), _LABEL, "call")
        plan, axes = cache.get(call_plan, len(args), prefix, "vmap")
        if plan is not call_plan:
            dyn = rebase(dyn, call_plan, plan)
        traced, carrier = packing_outputs(fun, plan, "vmap outputs", spread_out_axes)
        try:
            result = vmap_below(traced, in_axes=axes, out_axes=carrier, **options)(*dyn)
        except ValueError as error:
            clearer = _sizes_error(error, fun, in_axes, axis_size, args, kwargs)
            if clearer is error:
                raise
            raise clearer from None
        return unforward_tree(result, dyn).unpack()

    mapped.__wrapped__ = fun  # type: ignore[attr-defined]
    return mapped
