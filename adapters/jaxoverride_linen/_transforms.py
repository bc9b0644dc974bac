"""Overrides of the neutral transforms inside bound Linen modules.

Each transformed function runs with the module's threaded state installed (closed over,
or as an argument where JAX would otherwise bake it in) and returns the state it left as
an auxiliary output that JAX does not map or differentiate; the caller's variables are
updated once per call. At init a creation pass first calls the function outside JAX
(for ``vmap``/``pmap`` on the first slice of the mapped arguments), so the variables it
uses exist before JAX traces it.

``jit`` inside a bound module calls its function inline: the enclosing computation
(``jax.jit(model.apply)``, or the eager method) is what JAX compiles, so Linen's state
never crosses a separate trace.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import jaxoverride as jo
from jaxoverride import adapter_kit as kit
from jaxoverride_linen._scope import in_bound_module, source


def _wraps(fun: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    try:
        return functools.wraps(fun)
    except (AttributeError, TypeError):  # pragma: no cover - exotic callables
        return lambda f: f


class _Call:
    """One call of a transformed function, with the modules' state threaded.

    ``state_source`` (default: a new one) is the source of a call that may meet variables
    first written inside the function (a ``sow``): that source records them, and the kit
    runs the call again with a slot for them (``kit.init_safe`` retries).
    """

    __slots__ = ("source", "state", "thread")

    def __init__(self, where: str, state_source: Any = None):
        self.source = source(where) if state_source is None else state_source
        self.thread = kit.Threaded(self.source, 1, where)
        self.state = self.source.read()

    def run(
        self,
        fun: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        state: Any = None,
    ) -> tuple[Any, Any]:
        state = self.state if state is None else state
        return self.thread.run(0, state, lambda: fun(*args, **kwargs))

    def finish(self, after: Any) -> None:
        self.thread.finish(after)


def _init_safe(where: str, creation: Callable[[], Any], call: Callable[[], Any]) -> Any:
    return kit.init_safe(source(where), creation, call)


def _init_safe_fresh(where: str, creation: Callable[[], Any], call: Callable[[Any], Any]) -> Any:
    """``_init_safe`` for a function that may ``sow``: ``call(state_source)`` gets one
    source that keeps, across the kit's retries, the variables first written inside."""
    state_source = source(where, allow_fresh=True)
    return kit.init_safe(state_source, creation, lambda: call(state_source))


def _concrete(tree: Any) -> Any:
    def leaf(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct):
            return jnp.zeros(x.shape, x.dtype)
        return x

    return jax.tree.map(leaf, tree)


def _slice(tree: Any, axis: Any) -> Any:
    if axis is None:
        return tree
    if isinstance(axis, int):
        return jax.tree.map(lambda x: jnp.take(jnp.asarray(x), 0, axis=axis), tree)
    return jax.tree.map(
        lambda ax, x: x if ax is None else jnp.take(jnp.asarray(x), 0, axis=ax),
        axis,
        tree,
        is_leaf=lambda node: node is None,
    )


def _unbatched(args: tuple[Any, ...], in_axes: Any) -> tuple[Any, ...]:
    if isinstance(in_axes, (list, tuple)):
        return tuple(_slice(a, ax) for a, ax in zip(args, in_axes, strict=False))
    return tuple(_slice(a, in_axes) for a in args)


# -- vmap and pmap ---------------------------------------------------------------------


def _batched_state_error(where: str, err: Exception) -> ValueError:
    return ValueError(
        f"{where}: a Linen variable or rng key written inside the mapped function depends "
        "on the mapped axis. Linen state is shared across the batch (as nn.vmap with "
        "variable_axes={} does): reduce state updates over the batch first (an axis_name "
        f"and lax.pmean), or return per-example values as outputs. JAX said: {err}"
    )


def _mapping(name: str) -> Callable[..., Callable[..., Any]]:
    signature = inspect.signature(getattr(jax, name))

    def transform(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
        lower = jo.next_impl(name)
        plain = lower(fun, *args, **kwargs)
        bound = signature.bind(fun, *args, **kwargs)
        bound.apply_defaults()
        options = dict(bound.arguments)
        del options["fun"]
        in_axes, out_axes = options["in_axes"], options["out_axes"]
        where = f"jaxoverride.{name}"

        @_wraps(fun)
        def mapped(*call_args: Any, **call_kwargs: Any) -> Any:
            if not in_bound_module():
                return plain(*call_args, **call_kwargs)

            def call(state_source: Any) -> Any:
                state_call = _Call(where, state_source)
                pure = _wraps(fun)(lambda *a, **k: state_call.run(fun, a, k))
                # Variables first written inside (a sow) come out stacked along the mapped
                # axis, as nn.vmap's with variable_axes={collection: 0}; the others are
                # shared across the batch.
                state_axes = state_source.fresh_axes(0)
                try:
                    out, after = lower(pure, **{**options, "out_axes": (out_axes, state_axes)})(
                        *call_args, **call_kwargs
                    )
                except ValueError as err:
                    if "out_axes" in str(err) and "None" in str(err):
                        raise _batched_state_error(where, err) from err
                    raise
                state_call.finish(after)
                return out

            creation = lambda: fun(*_unbatched(call_args, in_axes), **call_kwargs)
            return _init_safe_fresh(where, creation, call)

        return mapped

    transform.__name__ = transform.__qualname__ = name
    return transform


vmap = _mapping("vmap")
pmap = _mapping("pmap")


# -- differentiation -------------------------------------------------------------------


def _differentiating(name: str, value_first: bool) -> Callable[..., Callable[..., Any]]:
    """``grad``-like transforms: run with ``has_aux=True``, the state in the aux output."""
    signature = inspect.signature(getattr(jax, name))

    def transform(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
        lower = jo.next_impl(name)
        plain = lower(fun, *args, **kwargs)
        bound = signature.bind(fun, *args, **kwargs)
        has_aux = bool(bound.arguments.get("has_aux", False))
        bound.arguments["has_aux"] = True
        options = dict(bound.arguments)
        del options[next(iter(signature.parameters))]
        where = f"jaxoverride.{name}"

        @_wraps(fun)
        def differentiated(*call_args: Any, **call_kwargs: Any) -> Any:
            if not in_bound_module():
                return plain(*call_args, **call_kwargs)

            def call(state_source: Any) -> Any:
                state_call = _Call(where, state_source)

                @_wraps(fun)
                def pure(*a: Any, **k: Any) -> Any:
                    out, after = state_call.run(fun, a, k)
                    value, aux = out if has_aux else (out, None)
                    return value, (aux, after)

                result = lower(pure, **options)(*call_args, **call_kwargs)
                if value_first:
                    (value, (aux, after)), grads = result
                    state_call.finish(after)
                    return ((value, aux), grads) if has_aux else (value, grads)
                derivative, (aux, after) = result
                state_call.finish(after)
                return (derivative, aux) if has_aux else derivative

            return _init_safe_fresh(where, lambda: fun(*call_args, **call_kwargs), call)

        return differentiated

    transform.__name__ = transform.__qualname__ = name
    return transform


grad = _differentiating("grad", value_first=False)
value_and_grad = _differentiating("value_and_grad", value_first=True)
jacfwd = _differentiating("jacfwd", value_first=False)
jacrev = _differentiating("jacrev", value_first=False)
hessian = _differentiating("hessian", value_first=False)


def _with_aux(name: str) -> Callable[..., Any]:
    """``vjp`` and ``linearize``: ``(out, fn[, aux])`` with the state in the aux output."""

    def call_impl(
        fun: Callable[..., Any], *primals: Any, has_aux: bool = False, **kwargs: Any
    ) -> Any:
        lower = jo.next_impl(name)
        if not in_bound_module():
            return lower(fun, *primals, has_aux=has_aux, **kwargs)
        where = f"jaxoverride.{name}"

        def call(state_source: Any) -> Any:
            state_call = _Call(where, state_source)

            @_wraps(fun)
            def pure(*a: Any) -> Any:
                out, after = state_call.run(fun, a, {})
                value, aux = out if has_aux else (out, None)
                return value, (aux, after)

            out, function, (aux, after) = lower(pure, *primals, has_aux=True, **kwargs)
            state_call.finish(after)
            return (out, function, aux) if has_aux else (out, function)

        return _init_safe_fresh(where, lambda: fun(*primals), call)

    call_impl.__name__ = call_impl.__qualname__ = name
    return call_impl


vjp = _with_aux("vjp")
linearize = _with_aux("linearize")


def jvp(fun: Callable[..., Any], primals: Any, tangents: Any, has_aux: bool = False) -> Any:
    lower = jo.next_impl("jvp")
    if not in_bound_module():
        return lower(fun, primals, tangents, has_aux=has_aux)
    where = "jaxoverride.jvp"

    def call(state_source: Any) -> Any:
        state_call = _Call(where, state_source)

        @_wraps(fun)
        def pure(*a: Any) -> Any:
            out, after = state_call.run(fun, a, {})
            value, aux = out if has_aux else (out, None)
            return value, (aux, after)

        out, tangent_out, (aux, after) = lower(pure, primals, tangents, has_aux=True)
        state_call.finish(after)
        return (out, tangent_out, aux) if has_aux else (out, tangent_out)

    return _init_safe_fresh(where, lambda: fun(*primals), call)


# -- checkpoint / remat ----------------------------------------------------------------


def _shifted(lower: Callable[..., Any], fun: Any, args: Any, kwargs: Any) -> Any:
    """``checkpoint``'s options for a function given one extra leading argument."""
    bound = inspect.signature(lower).bind_partial(fun, *args, **kwargs)
    static = bound.arguments.get("static_argnums")
    if static is not None:
        numbers = (static,) if isinstance(static, int) else tuple(static)
        bound.arguments["static_argnums"] = tuple(n + 1 if n >= 0 else n for n in numbers)
    return bound.args[1:], bound.kwargs


def _rematerializing(name: str) -> Callable[..., Callable[..., Any]]:
    def transform(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
        lower = jo.next_impl(name)
        plain = lower(fun, *args, **kwargs)
        shifted_args, shifted_kwargs = _shifted(lower, fun, args, kwargs)
        where = f"jaxoverride.{name}"

        @_wraps(fun)
        def rematerialized(*call_args: Any, **call_kwargs: Any) -> Any:
            if not in_bound_module():
                return plain(*call_args, **call_kwargs)

            def call() -> Any:
                state_call = _Call(where)
                # The state goes in as an argument: closed over, rematerialisation could
                # rebuild a scalar integer variable as a Python literal.
                pure = _wraps(fun)(lambda state, *a, **k: state_call.run(fun, a, k, state))
                out, after = lower(pure, *shifted_args, **shifted_kwargs)(
                    state_call.state, *call_args, **call_kwargs
                )
                state_call.finish(after)
                return out

            return _init_safe(where, lambda: fun(*call_args, **call_kwargs), call)

        return rematerialized

    transform.__name__ = transform.__qualname__ = name
    return transform


checkpoint = _rematerializing("checkpoint")
remat = _rematerializing("remat")


# -- jit -------------------------------------------------------------------------------


def jit(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
    lower = jo.next_impl("jit")
    plain = lower(fun, *args, **kwargs)

    @_wraps(fun)
    def inline(*call_args: Any, **call_kwargs: Any) -> Any:
        if not in_bound_module():
            return plain(*call_args, **call_kwargs)
        # Inside a bound module the enclosing computation is what JAX compiles: calling
        # the function inline keeps Linen's variables, rng and names in one trace.
        return fun(*call_args, **call_kwargs)

    for attribute in ("lower", "trace", "eval_shape", "clear_cache"):
        if hasattr(plain, attribute):
            setattr(inline, attribute, getattr(plain, attribute))
    return inline


# -- eval_shape and make_jaxpr ---------------------------------------------------------


def eval_shape(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    lower = jo.next_impl("eval_shape")
    if not in_bound_module():
        return lower(fun, *args, **kwargs)
    where = "jaxoverride.eval_shape"

    def call() -> Any:
        # As jax.eval_shape: state changes and rng draws inside are discarded.
        state_call = _Call(where)
        out = lower(_wraps(fun)(lambda *a, **k: state_call.run(fun, a, k)[0]), *args, **kwargs)
        state_call.finish(state_call.state)
        return out

    return _init_safe(where, lambda: fun(*_concrete(args), **_concrete(kwargs)), call)


def make_jaxpr(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
    lower = jo.next_impl("make_jaxpr")
    plain = lower(fun, *args, **kwargs)

    @_wraps(fun)
    def traced(*call_args: Any, **call_kwargs: Any) -> Any:
        if not in_bound_module():
            return plain(*call_args, **call_kwargs)
        where = "jaxoverride.make_jaxpr"

        def call() -> Any:
            state_call = _Call(where)
            pure = _wraps(fun)(lambda *a, **k: state_call.run(fun, a, k)[0])
            out = lower(pure, *args, **kwargs)(*call_args, **call_kwargs)
            state_call.finish(state_call.state)
            return out

        return _init_safe(where, lambda: fun(*call_args, **call_kwargs), call)

    return traced


# -- shard_map -------------------------------------------------------------------------


def shard_map(f: Any = None, /, **options: Any) -> Any:
    lower = jo.next_impl("shard_map")
    if f is None:
        return functools.partial(shard_map, **options)
    plain = lower(f, **options)
    where = "jaxoverride.shard_map"

    @_wraps(f)
    def sharded(*call_args: Any, **call_kwargs: Any) -> Any:
        if not in_bound_module():
            return plain(*call_args, **call_kwargs)

        def call() -> Any:
            state_call = _Call(where)
            pure = _wraps(f)(lambda *a, **k: state_call.run(f, a, k))
            specs = {**options, "out_specs": (options["out_specs"], jax.sharding.PartitionSpec())}
            out, after = lower(pure, **specs)(*call_args, **call_kwargs)
            state_call.finish(after)
            return out

        # At init, the first device's block creates the variables, once.
        in_specs = options.get("in_specs", kit.INFER_SPECS)
        block = lambda: kit.shard_block_arguments(call_args, in_specs, options.get("mesh"))
        return _init_safe(where, lambda: f(*block(), **call_kwargs), call)

    return sharded


OVERRIDES: dict[str, Callable[..., Any]] = {
    "jit": jit,
    "vmap": vmap,
    "pmap": pmap,
    "shard_map": shard_map,
    "grad": grad,
    "value_and_grad": value_and_grad,
    "jacfwd": jacfwd,
    "jacrev": jacrev,
    "hessian": hessian,
    "checkpoint": checkpoint,
    "remat": remat,
    "jvp": jvp,
    "vjp": vjp,
    "linearize": linearize,
    "eval_shape": eval_shape,
    "make_jaxpr": make_jaxpr,
}
"""Neutral name -> Linen override, for the transforms."""
