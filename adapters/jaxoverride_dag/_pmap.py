"""``pmap`` that keeps relative identity; non-array leaves ride through unmapped.

``jax.pmap`` reads ``out_axes`` before any trace, so a tree of ``out_axes`` needs the output
plan first: one abstract trace (``eval_shape`` of a ``vmap`` with the same axis name) finds
it, once per argument plan and shapes.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import jax

import jaxoverride as jo
from jaxoverride.adapter_kit import as_index_tuple
from jaxoverride_dag._axes import spread, spread_splitting
from jaxoverride_dag._out import Packed
from jaxoverride_dag._plan import Plan, encode
from jaxoverride_dag._reshare import rebase
from jaxoverride_dag._static_args import Layout, StaticArgs
from jaxoverride_dag._vmap import call_prefix, check_in_axes, output_axes

_LABEL = "pmap arguments"


def _avals(dyn: list[Any]) -> tuple[Any, ...]:
    return tuple((getattr(x, "shape", ()), getattr(x, "dtype", type(x))) for x in dyn)


class _PmapState:
    __slots__ = (
        "__weakref__",  # jo.reuse_jit holds the state of a non-function weakly
        "_entries",
        "axis_name",
        "donate",
        "fun",
        "in_axes",
        "lower_pmap",
        "options",
        "out_axes",
        "static",
    )

    def __init__(
        self,
        fun: Callable[..., Any],
        axis_name: Any,
        in_axes: Any,
        out_axes: Any,
        static: tuple[int, ...],
        donate: tuple[int, ...],
        options: dict[str, Any],
        lower_pmap: Callable[..., Any],
    ):
        self.lower_pmap = lower_pmap
        self.fun = fun
        self.axis_name = axis_name
        self.in_axes = in_axes
        self.out_axes = out_axes
        self.static = StaticArgs(static, ())
        self.donate = donate
        self.options = options
        self._entries: dict[Any, Any] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        layout, values, rest, rest_kwargs = self.static.split(args, kwargs)
        plan, dyn = encode((rest, rest_kwargs), _LABEL, "call")
        tree_out = not (self.out_axes is None or isinstance(self.out_axes, int))
        key = (layout, plan, _avals(dyn) if tree_out else None)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._make(plan, layout, values, dyn, rest_kwargs, tree_out)
            if len(self._entries) >= 256:
                self._entries.clear()
            self._entries[key] = entry
        fn, split = entry
        if split is not plan:
            dyn = rebase(dyn, plan, split)
        return fn(*values, *dyn).unpack()

    def _make(
        self,
        plan: Plan,
        layout: Layout,
        values: tuple[Any, ...],
        dyn: list[Any],
        kwargs: dict[str, Any],
        tree_out: bool,
    ) -> tuple[Callable[..., Any], Plan]:
        """The mapped function, and the plan it takes (``plan``, or it split per axis)."""
        count, positions, _ = layout
        in_axes = self.in_axes
        if isinstance(in_axes, tuple):
            if len(in_axes) != count:
                call_prefix("pmap", in_axes, (None,) * count)  # raises JAX's complaint
            in_axes = tuple(a for i, a in enumerate(in_axes) if i not in positions)
        rest_count = count - len(positions)
        call_plan = plan
        plan, axes = spread_splitting(
            plan,
            call_prefix("pmap", in_axes, (None,) * rest_count),
            api="pmap",
            what="in_axes",
            noun="mapped axis",
        )
        dyn = rebase(dyn, call_plan, plan)
        k = len(values)
        fun = self.fun

        def traced(*inputs: Any) -> Packed:
            rest, rest_kwargs = plan.decode_inside(inputs[k:])
            call_args, call_kwargs = StaticArgs.merge(layout, inputs[:k], rest, rest_kwargs)
            out_plan, out_dyn = encode(fun(*call_args, **call_kwargs), "pmap outputs")
            return Packed(tuple(out_dyn), out_plan)

        out_axes = self.out_axes
        if tree_out:
            found: list[Plan] = []

            def probe(*inputs: Any) -> tuple[Any, ...]:
                packed = traced(*values, *inputs)
                found.append(packed.plan)  # type: ignore[arg-type]
                return tuple(packed.leaves)

            jax.eval_shape(jax.vmap(probe, in_axes=axes, axis_name=self.axis_name), *dyn)
            out_plan = found[-1]
            out_axes = Packed(output_axes(out_plan, self.out_axes, "pmap"), out_plan)
        options = dict(self.options)
        donated = ()
        if self.donate:
            flags = (
                tuple(i in self.donate for i in range(count) if i not in positions),
                dict.fromkeys(kwargs, False),
            )
            marks = spread(
                plan, flags, api="pmap", what="donate_argnums", noun="donation", merge=operator.or_
            )
            donated = tuple(k + i for i, flag in enumerate(marks) if flag)
        mapped = self.lower_pmap(
            traced,
            axis_name=self.axis_name,
            in_axes=(None,) * k + axes,
            out_axes=out_axes,
            static_broadcasted_argnums=tuple(range(k)),
            donate_argnums=donated,
            **options,
        )
        return mapped, plan


def dag_pmap(
    fun: Callable[..., Any],
    axis_name: Any = None,
    *,
    in_axes: Any = 0,
    out_axes: Any = 0,
    static_broadcasted_argnums: int | Any = (),
    donate_argnums: int | Any = (),
    **options: Any,
) -> Callable[..., Any]:
    """The ``"pmap"`` override: ``jax.pmap``'s signature, identity-preserving result."""
    if not callable(fun):
        raise TypeError(f"jaxoverride.pmap: expected a callable value, got {fun!r}.")
    checked_in_axes = check_in_axes("pmap", in_axes)
    static = as_index_tuple(static_broadcasted_argnums)
    donate = as_index_tuple(donate_argnums)
    below = jo.next_impl("pmap")
    # One state per function and options, shared by every wrapper of them (as jax.pmap
    # shares its cache): an eager ``jo.pmap(f)(x)`` built again compiles nothing again.
    key = (_PmapState, below, axis_name, in_axes, out_axes, static, donate)
    state = jo.reuse_jit(
        fun,
        (*key, tuple(sorted(options.items()))),
        lambda: _PmapState(
            fun, axis_name, checked_in_axes, out_axes, static, donate, options, below
        ),
    )

    def mapped(*args: Any, **kwargs: Any) -> Any:
        return state(*args, **kwargs)

    mapped.__wrapped__ = fun  # type: ignore[attr-defined]
    return mapped
