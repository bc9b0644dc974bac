"""Overrides of the neutral transforms other than ``jit``, and of the transform-like calls.

They lift with *closure* semantics: inside the transform the tracked Variables keep their
values (constants of the trace, as closed-over arrays are) but are writable, and what the
function writes leaves as an auxiliary output, stored back afterwards. Modules passed as
arguments are threaded the same way; in the differentiated arguments of ``grad`` and
friends a module stands for its ``nnx.Param`` Variables, with an ``nnx.State`` gradient,
as with ``nnx.grad``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx

import jaxoverride as jo
from jaxoverride.adapter_kit import as_index_tuple, shift_argnums
from jaxoverride_nnx._errors import StructureChangeError
from jaxoverride_nnx._graph import RAW, is_graph_object
from jaxoverride_nnx._lift import (
    HAS_REFS,
    NO_REFS,
    call_plain,
    changed,
    from_refs,
    land,
    lift_arguments,
    named_like,
    refs_of,
    refuse_modules,
    run_given,
    run_lifted,
    static_positions,
    to_refs,
    with_arguments,
    write_back,
)
from jaxoverride_nnx._probes import has_probe, probe_types
from jaxoverride_nnx._solve import discarded, policy_for, written
from jaxoverride_nnx._stale_reads import own_jit_trace
from jaxoverride_nnx._touched import Threads, given_values
from jaxoverride_nnx._tracked import Tracked, current


def run_closure(
    tracked: Tracked,
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    where: str,
    policy: Any = None,
) -> tuple[Any, dict[int, Any]]:
    """``run_lifted`` with the current values (frozen under ``policy``, a
    ``jaxoverride.solve_state`` participant); returns the output and the changes."""
    before = list(map(RAW.__get__, tracked.variables))
    out, after = run_lifted(tracked, None, fn, args, kwargs, where, policy=policy)
    return out, changed(before, after)


def _bind(
    default: Callable[..., Any],
    fun: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> dict[str, Any]:
    """The options of a transform call such as ``jax.vmap(fun, ...)``, by name."""
    bound = inspect.signature(default).bind(fun, *args, **kwargs)
    options = dict(bound.arguments)
    options.pop(next(iter(inspect.signature(default).parameters)))
    return options


# -- vmap -----------------------------------------------------------------------------

_BATCHED = re.compile(r"out_axes\[1\]\[(\d+)\]")


def batched_state_error(error: ValueError, tracked: Tracked, where: str) -> BaseException:
    """Rephrases JAX's complaint about a batched output whose ``out_axes`` is ``None``."""
    match = _BATCHED.search(str(error))
    if match is None or "batched" not in str(error):
        return error
    path = tracked.path(int(match.group(1)))
    return StructureChangeError(
        f"jaxoverride_nnx: under {where} the tracked Variable `{path}` was given a value "
        "that differs across the mapped axis, but a Variable holds one value for the whole "
        "batch (vmap broadcasts tracked state to every example). Make the update the same "
        "for every example, for instance by reducing over the axis (nnx.BatchNorm("
        "axis_name=...) with vmap(axis_name=...), or jax.lax.pmean), or loop over the "
        "examples with jaxoverride.lax.map or scan so that each one updates the state."
    )


def run_mapped(
    mapped: Callable[..., tuple[Any, Any]],
    tracked: Tracked,
    where: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    policy: Any = None,
) -> Any:
    """``mapped(*args, **kwargs)``, a ``vmap`` that returns ``(out, updates)`` with the
    updates unbatched: writes them back (as ``policy``, a ``jaxoverride.solve_state``
    participant, says) and returns ``out``. A batched update is refused with the
    Variable's path (``batched_state_error``)."""
    try:
        out, updates = mapped(*args, **kwargs)
    except ValueError as error:
        clearer = batched_state_error(error, tracked, where)
        if clearer is error:
            raise
        raise clearer from None
    write_back(tracked, written(policy, tracked, updates), where)
    return out


def mapped_module_path(
    prefix: Any, args: Any, unmapped: Callable[[Any], bool], holds_module: Callable[[Any], Any]
) -> tuple[str, Any] | None:
    """Where a prefix tree of ``in_axes``/``in_specs`` maps an argument that holds an NNX
    module (modules are shared by every example or device, as if closed over): the path,
    e.g. ``"[1]['m']"``, and the prefix given there; None if every module is unmapped."""
    if unmapped(prefix) or not holds_module(args):
        return None
    if isinstance(prefix, (tuple, list)) and isinstance(args, (tuple, list)):
        if len(prefix) == len(args):
            pairs = [(f"[{i}]", p, a) for i, (p, a) in enumerate(zip(prefix, args, strict=True))]
        else:
            return "", prefix
    elif isinstance(prefix, dict) and isinstance(args, dict):
        pairs = [(f"[{key!r}]", prefix.get(key), a) for key, a in args.items()]
    else:
        return "", prefix
    for step, sub_prefix, sub_args in pairs:
        found = mapped_module_path(sub_prefix, sub_args, unmapped, holds_module)
        if found is not None:
            return step + found[0], found[1]
    return None


def _check_broadcast(in_axes: Any, args: Any, api: str = "jaxoverride.vmap") -> None:
    """Modules are broadcast: ``in_axes`` must be ``None`` wherever a module is passed."""
    found = mapped_module_path(in_axes, args, lambda axes: axes is None, refs_of)
    if found is None:
        return
    path, axes = found
    raise ValueError(
        f"jaxoverride_nnx: {api} got in_axes{path}={axes!r} for an argument holding an "
        "NNX module or Variable. Modules are broadcast to every example (their state is "
        "shared, as if closed over): give that argument in_axes=None, e.g. "
        f"{api.split('.')[-1]}(f, in_axes=(None, 0))(model, xs). Mapping over a module's "
        "state (an ensemble) is nnx.vmap's job."
    )


def _no_keyword_modules(kwargs: dict[str, Any], api: str) -> None:
    if refs_of(kwargs):
        raise ValueError(
            f"jaxoverride_nnx: {api} maps keyword arguments over axis 0, so NNX modules "
            "cannot be passed by keyword; pass them positionally with in_axes=None."
        )


def vmap(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
    """The ``"vmap"`` override."""
    below = jo.next_impl("vmap")
    plain = below(fun, *args, **kwargs)
    options = _bind(jax.vmap, fun, args, kwargs)
    in_axes = options.get("in_axes", 0)
    out_axes = options.get("out_axes", 0)
    where = "jaxoverride.vmap"

    def call(*call_args: Any, **call_kwargs: Any) -> Any:
        view, args_, kwargs_ = lift_arguments(current(), call_args, call_kwargs)
        if view is None:
            return call_plain(plain, call_args, call_kwargs, where)
        _check_broadcast(in_axes, args_)
        _no_keyword_modules(kwargs_, where)
        policy = policy_for(view)

        def pure(*inner_args: Any, **inner_kwargs: Any) -> Any:
            inner_args, inner_kwargs = from_refs((inner_args, inner_kwargs), view)
            out, updates = run_closure(view, fun, inner_args, inner_kwargs, where, policy)
            return to_refs(out, view)[0], updates

        # ``pure`` takes the user's arguments: under the user's name and signature, JAX's
        # messages (inconsistent sizes, say) name them as jax.vmap(fun) would.
        mapped = below(_named(pure, fun), **{**options, "out_axes": (out_axes, None)})
        return from_refs(run_mapped(mapped, view, where, args_, kwargs_, policy), view)

    return _named(call, fun)


def _named(call: Callable[..., Any], fun: Callable[..., Any]) -> Callable[..., Any]:
    named_like(call, fun).__wrapped__ = fun  # type: ignore[attr-defined]
    return call


# -- differentiation ------------------------------------------------------------------


@functools.partial(jax.tree_util.register_dataclass, data_fields=["state"], meta_fields=["index"])
@dataclasses.dataclass(eq=False, slots=True)
class _ParamsOf:
    """A module in a differentiated argument: its ``nnx.Param`` values, and which module."""

    state: Any
    index: int


def _params(obj: Any, index: int) -> _ParamsOf:
    if is_graph_object(obj) and not isinstance(obj, nnx.Variable):
        return _ParamsOf(nnx.state(obj, nnx.Param), index)
    return _ParamsOf(obj.get_raw_value(), index)


def _load(wrapped: _ParamsOf, objects: Sequence[Any]) -> Any:
    """Inside the trace: put the differentiated values into the module; return the module."""
    obj = objects[wrapped.index]
    if isinstance(obj, nnx.Variable):
        obj.set_raw_value(wrapped.state)
    else:
        nnx.update(obj, wrapped.state)
    return obj


def _gradient(wrapped: _ParamsOf, objects: Sequence[Any]) -> Any:
    """Outside: the gradient for a module argument, as ``nnx.grad`` gives it."""
    obj = objects[wrapped.index]
    if isinstance(obj, nnx.Variable):
        return obj.replace(wrapped.state)
    return wrapped.state


def _is_params(x: Any) -> bool:
    return type(x) is _ParamsOf


def _argnums(argnums: int | Sequence[int], count: int) -> tuple[int, ...]:
    return tuple(n % count if n < 0 and count else n for n in as_index_tuple(argnums))


def _differentiating(name: str, default: Callable[..., Any]) -> Callable[..., Any]:
    """The override of ``grad``, ``value_and_grad``, ``jacfwd``, ``jacrev`` or ``hessian``."""
    where = f"jaxoverride.{name}"
    returns_value = name == "value_and_grad"

    def impl(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
        below = jo.next_impl(name)
        plain = below(fun, *args, **kwargs)
        options = _bind(default, fun, args, kwargs)
        argnums = options.get("argnums", 0)
        has_aux = options.get("has_aux", False)

        def call(*call_args: Any, **call_kwargs: Any) -> Any:
            view = with_arguments(current(), call_args, call_kwargs)
            if view is None:
                return call_plain(plain, call_args, call_kwargs, where)
            policy = policy_for(view)
            nums = _argnums(argnums, len(call_args))
            objects: list[Any] = []

            def wrap(obj: Any) -> Any:
                if is_graph_object(obj):
                    objects.append(obj)
                    return _params(obj, len(objects) - 1)
                return obj

            args_ = [
                jax.tree_util.tree_map(wrap, a, is_leaf=is_graph_object)
                if i in nums
                else to_refs(a, view)[0]
                for i, a in enumerate(call_args)
            ]
            kwargs_ = to_refs(call_kwargs, view)[0]

            def pure(*inner_args: Any, **inner_kwargs: Any) -> Any:
                baseline: list[Any] = []

                def run(*a: Any, **k: Any) -> Any:
                    a = tuple(
                        jax.tree_util.tree_map(
                            lambda x: _load(x, objects) if _is_params(x) else x,
                            arg,
                            is_leaf=_is_params,
                        )
                        if i in nums
                        else arg
                        for i, arg in enumerate(a)
                    )
                    a, k = from_refs((a, k), view)
                    baseline.extend(map(RAW.__get__, view.variables))
                    return fun(*a, **k)

                out, after = run_lifted(
                    view, None, run, inner_args, inner_kwargs, where, policy=policy
                )
                updates = changed(baseline, after)
                if has_aux:
                    value, aux = out
                    aux, has_refs = to_refs(aux, view)
                else:
                    value, aux, has_refs = out, None, False
                return value, (aux, updates, HAS_REFS if has_refs else NO_REFS)

            transformed = below(pure, **{**options, "has_aux": True})
            result = transformed(*args_, **kwargs_)
            if returns_value:
                (value, (aux, updates, refs)), derivative = result
            else:
                value, (derivative, (aux, updates, refs)) = None, result
            write_back(view, written(policy, view, updates), where)
            derivative = jax.tree_util.tree_map(
                lambda x: _gradient(x, objects) if _is_params(x) else x,
                derivative,
                is_leaf=_is_params,
            )
            if refs.value:
                aux = from_refs(aux, view)
            if returns_value:
                return ((value, aux) if has_aux else value), derivative
            return (derivative, aux) if has_aux else derivative

        return _named(call, fun)

    impl.__name__ = impl.__qualname__ = name
    return impl


grad = _differentiating("grad", jax.grad)
value_and_grad = _differentiating("value_and_grad", jax.value_and_grad)
jacfwd = _differentiating("jacfwd", jax.jacfwd)
jacrev = _differentiating("jacrev", jax.jacrev)
hessian = _differentiating("hessian", jax.hessian)


# -- checkpoint -----------------------------------------------------------------------


def _checkpointing(name: str, default: Callable[..., Any]) -> Callable[..., Any]:
    where = f"jaxoverride.{name}"

    def impl(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
        below = jo.next_impl(name)
        plain = below(fun, *args, **kwargs)
        options = _bind(default, fun, args, kwargs)
        static = as_index_tuple(options.get("static_argnums", ()))
        prevent_cse = options.get("prevent_cse", True)
        shifted = dict(options)
        shifted["static_argnums"] = shift_argnums(static)
        if isinstance(prevent_cse, (tuple, list)):
            shifted["prevent_cse"] = (True, *prevent_cse)
        threads = Threads()  # the modules that ``fun`` touches

        def call(*call_args: Any, **call_kwargs: Any) -> Any:
            fixed = static_positions(static, len(call_args))
            view, args_, kwargs_ = lift_arguments(current(), call_args, call_kwargs, fixed)
            if view is None:
                return call_plain(plain, call_args, call_kwargs, where)
            policy = policy_for(view)

            def attempt(given: frozenset[int], owner: object) -> Any:
                def pure(values: dict[int, Any], *inner: Any, **inner_kwargs: Any) -> Any:
                    return run_given(view, values, fun, inner, inner_kwargs, where, owner, policy)

                values = given_values(view, given, (fun, call_args, call_kwargs))
                return below(pure, **shifted)(values, *args_, **kwargs_)

            result = threads.run(view, attempt, (fun, call_args, call_kwargs))
            return land(view, result, where, policy)

        return _named(call, fun)

    impl.__name__ = impl.__qualname__ = name
    return impl


checkpoint = _checkpointing("checkpoint", jax.checkpoint)
remat = _checkpointing("remat", jax.remat)


# -- calls: eval_shape, jvp, vjp, linearize -------------------------------------------


def eval_shape(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The ``"eval_shape"`` override: runs nothing, so tracked modules do not change."""
    below = jo.next_impl("eval_shape")
    view, args_, kwargs_ = lift_arguments(current(), args, kwargs)
    if view is None:
        return call_plain(below, (fun, *args), kwargs, "jaxoverride.eval_shape")
    # Under ``jaxoverride.solve_state`` a boundary of its own, whose last state (a value
    # of eval_shape's trace) is dropped with it, as the writes are.
    policy = policy_for(view)

    # A Variable that holds a probe (a rule's function traced by JAX after the call,
    # which was not given it) enters as an argument of its type: eval_shape computes
    # types only, so any value of the Variable's type gives the same result.
    now = view.read()
    probed = {i: probe_types(v) for i, v in enumerate(now) if has_probe(v)}

    @own_jit_trace  # a fresh function per call, traced through jit: reads are not stale
    def pure(stand_ins: dict[int, Any], /, *inner_args: Any, **inner_kwargs: Any) -> Any:
        inner_args, inner_kwargs = from_refs((inner_args, inner_kwargs), view)
        values = None
        if stand_ins:
            values = [stand_ins.get(i, v) for i, v in enumerate(now)]
        with discarded(policy):
            where = "jaxoverride.eval_shape"
            out, _ = run_lifted(view, values, fun, inner_args, inner_kwargs, where)
        return to_refs(out, view)[0]

    return from_refs(below(pure, probed, *args_, **kwargs_), view)


def _no_modules(where: str, primals: Any) -> None:
    fix = (
        "Close over the module (tracked with jaxoverride_nnx.track) and pass arrays, for "
        "instance nnx.state(model, nnx.Param), as primals instead."
    )
    refuse_modules(primals, where, "among its primals", fix)


def _aux_call(
    name: str, fun: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], primals: Any
) -> Any:
    """``jax.jvp``, ``vjp`` or ``linearize`` of ``fun`` (given ``args``, ``kwargs`` with
    ``has_aux``) with the tracked state closed over: its writes leave as auxiliary output."""
    where = f"jaxoverride.{name}"
    below = jo.next_impl(name)
    tracked = current()
    if tracked is None:
        return call_plain(below, (fun, *args), kwargs, where)
    _no_modules(where, primals)
    has_aux = kwargs.pop("has_aux")
    policy = policy_for(tracked)

    def pure(*primals: Any) -> Any:
        out, updates = run_closure(tracked, fun, primals, {}, where, policy)
        if has_aux:
            value, aux = out
            return value, (to_refs(aux, tracked)[0], updates)
        return out, (None, updates)

    out, result, (aux, updates) = below(pure, *args, has_aux=True, **kwargs)
    write_back(tracked, written(policy, tracked, updates), where)
    return (out, result, from_refs(aux, tracked)) if has_aux else (out, result)


def jvp(fun: Callable[..., Any], primals: Any, tangents: Any, has_aux: bool = False) -> Any:
    """The ``"jvp"`` override."""
    return _aux_call("jvp", fun, (primals, tangents), {"has_aux": has_aux}, primals)


def vjp(fun: Callable[..., Any], *primals: Any, has_aux: bool = False, **kwargs: Any) -> Any:
    """The ``"vjp"`` override."""
    return _aux_call("vjp", fun, primals, {"has_aux": has_aux, **kwargs}, primals)


def linearize(fun: Callable[..., Any], *primals: Any, has_aux: bool = False) -> Any:
    """The ``"linearize"`` override."""
    return _aux_call("linearize", fun, primals, {"has_aux": has_aux}, primals)
