"""Overrides of ``pmap`` and ``shard_map``: Haiku state enters replicated, leaves unmapped.

Every device runs the function with the caller's params, state and rng (``in_axes=None``;
``PartitionSpec()``); what it changes comes back once, unmapped, so it must be the same on
every device: reduce it with ``lax.pmean``/``lax.psum`` first (``shard_map`` with
``check_vma=True`` names a state value that varies; ``pmap`` keeps device 0's). Keys drawn
with ``hk.next_rng_key()`` are the same on every device. At init the function first runs
once on device 0's slice or block, with collectives over the mapped axes bound to size 1.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
from haiku._src import base
from jax.sharding import PartitionSpec

import jaxoverride as jo
from jaxoverride import adapter_kit as kit
from jaxoverride_haiku._creation import create
from jaxoverride_haiku._frames import initializing, state_usable
from jaxoverride_haiku._transforms import TracedCall

_PMAP = inspect.signature(jax.pmap)
_SHARD_MAP = inspect.signature(jax.shard_map)
_INFER: Any = kit.INFER_SPECS


def _init_exact(
    creation: Callable[[], Any], apply: Callable[[], Any], axis_names: Sequence[Hashable]
) -> Any:
    return kit.init_safe_call(
        creation,
        apply,
        initializing=initializing,
        create=kit.create_binding_axes(create, axis_names, inside=base.push_jax_trace_level),
    )


# -- pmap ------------------------------------------------------------------------------


def pmap(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
    below = jo.next_impl("pmap")
    plain_mapped = below(fun, *args, **kwargs)
    options = _PMAP.bind(fun, *args, **kwargs).arguments
    del options["fun"]
    axis_name = options.get("axis_name")
    in_axes = options.get("in_axes", 0)
    out_axes = options.get("out_axes", 0)
    static = kit.as_index_tuple(options.get("static_broadcasted_argnums", ()))
    donate = kit.as_index_tuple(options.get("donate_argnums", ()))

    @kit.wraps(fun)
    def mapped(*call_args: Any, **call_kwargs: Any) -> Any:
        if not state_usable():
            return plain_mapped(*call_args, **call_kwargs)

        def creation() -> None:
            dynamic = [a for i, a in enumerate(call_args) if i not in static]
            sliced = iter(kit.unbatched_arguments(tuple(dynamic), _dynamic_axes(in_axes)))
            one = [a if i in static else next(sliced) for i, a in enumerate(call_args)]
            keywords = kit.unbatched_arguments(tuple(call_kwargs.values()), 0)
            fun(*one, **dict(zip(call_kwargs, keywords, strict=True)))

        def apply() -> Any:
            call = TracedCall("jaxoverride.pmap")

            def pure(state: Any, *a: Any, **k: Any) -> Any:
                return call.run(fun, a, k, state)

            inner_options = dict(options)
            inner_options["in_axes"] = _with_state_axis(in_axes, len(call_args), static)
            inner_options["out_axes"] = (out_axes, None)
            inner_options["static_broadcasted_argnums"] = tuple(i + 1 for i in static)
            inner_options["donate_argnums"] = tuple(i + 1 for i in donate)
            inner = below(kit.wraps(fun)(pure), **inner_options)
            out, changed = inner(call.state, *call_args, **call_kwargs)
            call.finish(changed)
            return out

        return _init_exact(creation, apply, [] if axis_name is None else [axis_name])

    return mapped


def _dynamic_axes(in_axes: Any) -> Any:
    # pmap's in_axes (when a sequence) already describes the non-static arguments only.
    return tuple(in_axes) if isinstance(in_axes, (list, tuple)) else in_axes


def _with_state_axis(in_axes: Any, count: int, static: tuple[int, ...]) -> Any:
    if isinstance(in_axes, (list, tuple)):
        return (None, *in_axes)
    return (None, *([in_axes] * (count - len(static))))


# -- shard_map -------------------------------------------------------------------------


def _varying_state_error(names: list[str], axes: set[Any]) -> ValueError:
    where = " over mesh axes " + ", ".join(repr(a) for a in sorted(axes, key=str))
    return ValueError(
        "jaxoverride.shard_map: Haiku state "
        + ", ".join(names)
        + f" written inside the mapped function varies{where}, but Haiku state is one value "
        "shared by every device (it leaves shard_map with out_specs P()). Reduce it with "
        "jax.lax.pmean or jax.lax.psum over "
        + ", ".join(repr(a) for a in sorted(axes, key=str))
        + " before writing it (hk.set_state), or return per-device values as outputs."
    )


def _check_replicated(changed: Any) -> None:
    varying: list[str] = []
    axes: set[Any] = set()
    for path, leaf in jax.tree_util.tree_leaves_with_path(changed):
        vma = kit.varying_axes(leaf)
        if vma:
            varying.append(_state_name(path))
            axes |= set(vma)
    if varying:
        raise _varying_state_error(varying, axes)


def _state_name(path: Any) -> str:
    keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    # InternalState(params, state, rng): name the module/name, or say which field.
    field = keys[0] if keys else "?"
    if field in ("state", "1") and len(keys) >= 3:
        return f"{keys[1]}/{keys[2]}"
    if field in ("rng", "2"):
        return "rng"
    return "/".join(keys[1:3]) or field


def shard_map(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
    below = jo.next_impl("shard_map")
    plain_mapped = below(fun, *args, **kwargs)
    options = _SHARD_MAP.bind(fun, *args, **kwargs).arguments
    del options["f"]
    in_specs = options.get("in_specs", _INFER)
    out_specs = options["out_specs"]
    mesh = options.get("mesh")
    axis_names = options.get("axis_names") or frozenset()
    check_vma = options.get("check_vma", True)

    @kit.wraps(fun)
    def mapped(*call_args: Any, **call_kwargs: Any) -> Any:
        if not state_usable():
            return plain_mapped(*call_args, **call_kwargs)

        def creation() -> None:
            fun(*kit.shard_block_arguments(call_args, in_specs, mesh), **call_kwargs)

        def apply() -> Any:
            call = TracedCall("jaxoverride.shard_map")

            def pure(state: Any, *a: Any, **k: Any) -> Any:
                out, changed = call.run(fun, a, k, state)
                if check_vma:
                    _check_replicated(changed)
                return out, changed

            inner_options = dict(options)
            inner_options["in_specs"] = _with_state_spec(in_specs, len(call_args))
            inner_options["out_specs"] = (out_specs, PartitionSpec())
            inner = below(kit.wraps(fun)(pure), **inner_options)
            out, changed = inner(call.state, *call_args, **call_kwargs)
            call.finish(changed)
            return out

        names = tuple(axis_names) or tuple(
            (mesh if mesh is not None else jax.sharding.get_abstract_mesh()).axis_names
        )
        return _init_exact(creation, apply, names)

    return mapped


def _with_state_spec(in_specs: Any, count: int) -> Any:
    if in_specs is _INFER:
        return _INFER
    if isinstance(in_specs, (list, tuple)) and not isinstance(in_specs, PartitionSpec):
        return (PartitionSpec(), *in_specs)
    return (PartitionSpec(), *([in_specs] * count))
