"""The ``pmap`` and ``shard_map`` overrides: tracked state enters and leaves replicated.

The tracked values are one extra argument every device sees whole (``in_axes=None``,
spec ``P()``); what the function writes leaves unmapped and is stored back once, so it
must be the same on every device (reduce it with ``lax.pmean`` or
``nnx.BatchNorm(axis_name=...)``). ``shard_map`` proves that with ``check_vma``;
``jax.pmap`` does not check, so before the first call with a new tracked set or shapes
the function is traced abstractly under a ``vmap`` of the same axis name, where a
per-device update shows up batched. One mapped function is built per tracked set.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax import tree_util as jtu
from jax.sharding import PartitionSpec

import jaxoverride as jo
from jaxoverride.adapter_kit import INFER_SPECS as _INFER, as_index_tuple, varying_axes
from jaxoverride_nnx._errors import StructureChangeError
from jaxoverride_nnx._lift import (
    call_plain,
    graph_objects,
    land,
    lift_arguments,
    named_like,
    run_given,
    static_positions,
)
from jaxoverride_nnx._touched import Threads, given_values
from jaxoverride_nnx._tracked import ACTIVE, Tracked, TrackKey, current
from jaxoverride_nnx._transforms import (
    _bind,
    _check_broadcast,
    _named,
    _no_keyword_modules,
    mapped_module_path,
)

_CACHE_LIMIT = 256


def _avals(tree: Any) -> tuple[Any, ...]:
    leaves, treedef = jtu.tree_flatten(tree)
    return (treedef, tuple((np.shape(x), getattr(x, "dtype", type(x))) for x in leaves))


def _lifted(fun: Callable[..., Any], where: str, check_vma: bool) -> Callable[..., Any]:
    """``fun`` as a function of ``(values, *args)`` run with the Variables of ``ACTIVE``."""

    def lifted(values: dict[int, Any], *args: Any, **kwargs: Any) -> Any:
        view = ACTIVE.get()
        assert view is not None
        result = run_given(view, values, fun, args, kwargs, where, _OWNER.get())
        if check_vma:
            _check_replicated(view, result[1], where)
        return result

    return named_like(lifted, fun)


def _check_replicated(view: Tracked, updates: dict[int, Any], where: str) -> None:
    for index, value in updates.items():
        for leaf in jtu.tree_leaves(value):
            axes = varying_axes(leaf)
            if axes:
                raise _varying(view, index, where, tuple(sorted(axes, key=str)))


def _varying(view: Tracked, index: int, where: str, axes: Any) -> StructureChangeError:
    names = ", ".join(repr(axis) for axis in axes)
    return StructureChangeError(
        f"jaxoverride_nnx: under {where} the tracked Variable `{view.path(index)}` was given "
        f"a value that may differ across the mapped axis {names}, but a Variable holds one "
        "value for every device (its state is replicated). Reduce it over the axis before "
        f"writing it, for instance with jax.lax.pmean(value, {names}) or "
        "nnx.BatchNorm(axis_name=...), or return per-device values as an output instead."
    )


def _per_set(build: Callable[[Any], Any]) -> Callable[[TrackKey, Any], Any]:
    """``build(extra)`` once per tracked set and ``extra``, pruned of dead sets."""
    cache: dict[Any, Any] = {}

    def get(key: TrackKey, extra: Any) -> Any:
        entry = cache.get((key, extra))
        if entry is None:
            if len(cache) >= _CACHE_LIMIT:
                for stale in [k for k in cache if not k[0].alive()]:
                    del cache[stale]
                if len(cache) >= _CACHE_LIMIT:
                    cache.clear()
            entry = cache[(key, extra)] = build(extra)
        return entry

    return get


# The mark of the probes of the mapped call being traced (see ``_touched``).
_OWNER: contextvars.ContextVar[object] = contextvars.ContextVar("jaxoverride_nnx_mapped_owner")


def _threaded(
    threads: Threads,
    view: Tracked,
    call: Callable[[dict[int, Any]], Any],
    where: str,
    fun: Callable[..., Any],
    arguments: Any = (),
) -> Any:
    """``call(values)`` given the tracked values of the modules the function touches."""

    def attempt(given: frozenset[int], owner: object) -> Any:
        token, owner_token = ACTIVE.set(view), _OWNER.set(owner)
        try:
            return call(given_values(view, given, (fun, arguments)))
        finally:
            _OWNER.reset(owner_token)
            ACTIVE.reset(token)

    return land(view, threads.run(view, attempt, (fun, arguments)), where)


# -- pmap -----------------------------------------------------------------------------


def _shared_build(
    name: str,
    default: Callable[..., Any],
    build: Callable[..., Callable[..., Any]],
    fun: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Callable[..., Any]:
    """``build(fun, below, plain, options)``, shared through ``jo.reuse_jit`` by every
    equal ``jaxoverride.<name>(fun, ...)`` (as ``jax.pmap`` shares its compilations);
    ``plain`` is ``below``'s own mapped ``fun``, ``options`` bound to ``default``."""
    below = jo.next_impl(name)
    options = _bind(default, fun, args, kwargs)
    key = (name, below, tuple(sorted(options.items())))
    shared = jo.reuse_jit(
        fun, key, lambda: build(fun, below, below(fun, *args, **kwargs), dict(options))
    )

    def call(*call_args: Any, **call_kwargs: Any) -> Any:
        return shared(*call_args, **call_kwargs)

    return _named(call, fun)


def pmap(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
    """The ``"pmap"`` override: tracked state is broadcast in and must come out replicated."""
    return _shared_build("pmap", jax.pmap, _build_pmap, fun, args, kwargs)


def _build_pmap(
    fun: Callable[..., Any], below: Callable[..., Any], plain: Any, options: dict[str, Any]
) -> Callable[..., Any]:
    axis_name = options.pop("axis_name", None)
    in_axes = options.pop("in_axes", 0)
    out_axes = options.pop("out_axes", 0)
    static = as_index_tuple(options.pop("static_broadcasted_argnums", ()))
    donate = as_index_tuple(options.pop("donate_argnums", ()))
    where = "jaxoverride.pmap"
    lifted = _lifted(fun, where, check_vma=False)
    probed: set[Any] = set()
    threads = Threads()  # the modules that ``fun`` touches

    def build(count: int) -> Any:
        fixed = static_positions(static, count)
        axes = in_axes if isinstance(in_axes, (tuple, list)) else (in_axes,) * count
        return below(
            lifted,
            axis_name,
            in_axes=(None, *axes),
            out_axes=(out_axes, None, None),
            static_broadcasted_argnums=tuple(n + 1 for n in sorted(fixed)),
            donate_argnums=tuple(n + 1 for n in donate if n >= 0),
            **options,
        )

    cached = _per_set(build)

    def call(*call_args: Any, **call_kwargs: Any) -> Any:
        count = len(call_args)
        fixed = static_positions(static, count)
        view, args_, kwargs_ = lift_arguments(current(), call_args, call_kwargs, fixed)
        if view is None:
            return call_plain(plain, call_args, call_kwargs, where)
        if isinstance(in_axes, (tuple, list)) and len(in_axes) != count:
            return call_plain(plain, call_args, call_kwargs, where)  # JAX's own complaint
        axes = tuple(in_axes) if isinstance(in_axes, (tuple, list)) else (in_axes,) * count
        dynamic_axes = tuple(a for i, a in enumerate(axes) if i not in fixed)
        _check_broadcast(
            dynamic_axes, [a for i, a in enumerate(args_) if i not in fixed], api=where
        )
        _no_keyword_modules(kwargs_, where)

        def run(values: dict[int, Any]) -> Any:
            probe_key = (view.key, count, _avals((values, args_, kwargs_)))
            if probe_key not in probed:
                _probe(view, values, lifted, axis_name, axes, out_axes, fixed, args_, kwargs_)
                if len(probed) >= _CACHE_LIMIT:
                    probed.clear()
                probed.add(probe_key)
            return cached(view.key, count)(values, *args_, **kwargs_)

        return _threaded(threads, view, run, where, fun, call_args)

    return call


def _probe(
    view: Tracked,
    values: dict[int, Any],
    lifted: Callable[..., Any],
    axis_name: Any,
    axes: tuple[Any, ...],
    out_axes: Any,
    fixed: set[int],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    """Traces under ``vmap``: a batched state update is one that differs per device.
    Only when one is (``vmap`` refuses ``out_axes=None`` for it), each update is tried
    on its own to name the Variable."""
    static_values = {i: args[i] for i in fixed}
    dynamic = [a for i, a in enumerate(args) if i not in fixed]
    dynamic_axes = tuple(a for i, a in enumerate(axes) if i not in fixed)
    keys: list[int] = []

    def probe(values: dict[int, Any], *inner: Any, **inner_kwargs: Any) -> Any:
        it = iter(inner)
        full = [static_values[i] if i in fixed else next(it) for i in range(len(args))]
        _, updates, _ = lifted(values, *full, **inner_kwargs)
        keys[:] = sorted(updates)
        return tuple(updates[k] for k in keys)

    def attempt(unmapped: Any) -> bool:
        mapped = jax.vmap(
            probe, in_axes=(None, *dynamic_axes), out_axes=unmapped, axis_name=axis_name
        )
        try:
            jax.eval_shape(mapped, values, *dynamic, **kwargs)
        except ValueError as error:
            if "out_axes" not in str(error):
                raise
            return False
        return True

    if attempt(None):
        return
    for position, index in enumerate(list(keys)):
        count = len(keys)
        if not attempt(tuple(None if j == position else 0 for j in range(count))):
            raise _varying(view, index, "jaxoverride.pmap", (axis_name,))


# -- shard_map ------------------------------------------------------------------------


def shard_map(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
    """The ``"shard_map"`` override: tracked state enters with spec ``P()`` and must leave
    replicated (``out_specs`` ``P()``), which ``check_vma`` proves."""
    return _shared_build("shard_map", jax.shard_map, _build_shard_map, fun, args, kwargs)


def _build_shard_map(
    fun: Callable[..., Any], below: Callable[..., Any], plain: Any, options: dict[str, Any]
) -> Callable[..., Any]:
    in_specs = options.pop("in_specs", _INFER)
    out_specs = options.pop("out_specs")
    check_vma = options.get("check_vma", True)
    where = "jaxoverride.shard_map"
    lifted = _lifted(fun, where, check_vma=check_vma)
    raise_infer = in_specs is _INFER
    threads = Threads()  # the modules that ``fun`` touches

    def pack(values: dict[int, Any], args: tuple[Any, ...]) -> Any:
        return lifted(values, *args)

    def build(_: Any) -> Any:
        mapped = below(
            pack,
            in_specs=(PartitionSpec(), in_specs),
            out_specs=(out_specs, PartitionSpec(), PartitionSpec()),
            **options,
        )
        return lambda values, *args: mapped(values, args)

    cached = _per_set(build)

    def call(*call_args: Any, **call_kwargs: Any) -> Any:
        view, args_, kwargs_ = lift_arguments(current(), call_args, call_kwargs)
        if view is None or call_kwargs:
            return call_plain(plain, call_args, call_kwargs, where)
        if raise_infer:
            raise ValueError(
                "jaxoverride_nnx: jaxoverride.shard_map needs explicit in_specs while NNX "
                "modules are tracked: the tracked state is passed replicated (spec P()) next "
                "to your arguments, and shard_map cannot infer specs for a mix. Pass "
                "in_specs=... for your arguments."
            )
        _check_specs(in_specs, call_args)
        mapped = cached(view.key, None)
        return _threaded(
            threads, view, lambda values: mapped(values, *args_, **kwargs_), where, fun, call_args
        )

    return call


def _check_specs(in_specs: Any, args: tuple[Any, ...]) -> None:
    """Modules are replicated: their spec must be ``P()`` (or ``None``)."""
    unmapped = lambda spec: spec is None or spec == PartitionSpec()
    found = mapped_module_path(in_specs, args, unmapped, graph_objects)
    if found is None:
        return
    path, spec = found
    raise ValueError(
        f"jaxoverride_nnx: jaxoverride.shard_map got in_specs{path}={spec!r} for an argument "
        "holding an NNX module or Variable. Module state is replicated on every device (as "
        "if closed over): give that argument the spec P(), e.g. in_specs=(P(), P('data'))."
    )
