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

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import jaxoverride as jo
from jaxoverride import adapter_kit as kit
from jaxoverride_linen._source import in_bound_module, source

# A function under vmap, grad, vjp or jvp may sow: its call records what it sows first
# (stacked along vmap's axis, as nn.vmap's variable_axes={collection: 0}), and runs again.
_STATE = kit.source_transform_state(
    in_bound_module, source, lambda where: source(where, allow_fresh=True)
)


def _concrete(tree: Any) -> Any:
    def leaf(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct):
            return jnp.zeros(x.shape, x.dtype)
        return x

    return jax.tree.map(leaf, tree)


# -- vmap and pmap ---------------------------------------------------------------------


def _batched_state_error(where: str, err: Exception) -> ValueError:
    return ValueError(
        f"{where}: a Linen variable or rng key written inside the mapped function depends "
        "on the mapped axis. Linen state is shared across the batch (as nn.vmap with "
        "variable_axes={} does): reduce state updates over the batch first (an axis_name "
        f"and lax.pmean), or return per-example values as outputs. JAX said: {err}"
    )


def _in_modules(
    fun: Callable[..., Any], plain: Callable[..., Any], inside: Callable[..., Any]
) -> Callable[..., Any]:
    """A function with ``fun``'s metadata that calls ``plain`` (the transformed function
    below) outside every bound Linen module, and ``inside`` in one."""

    @kit.wraps(fun)
    def call(*call_args: Any, **call_kwargs: Any) -> Any:
        if not in_bound_module():
            return plain(*call_args, **call_kwargs)
        return inside(*call_args, **call_kwargs)

    return call


# -- jit -------------------------------------------------------------------------------


def jit(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
    plain = jo.next_impl("jit")(fun, *args, **kwargs)
    # Inside a bound module the enclosing computation is what JAX compiles: calling the
    # function inline keeps Linen's variables, rng and names in one trace.
    inline = _in_modules(fun, plain, fun)
    for attribute in ("lower", "trace", "eval_shape", "clear_cache"):
        if hasattr(plain, attribute):
            setattr(inline, attribute, getattr(plain, attribute))
    return inline


# -- eval_shape and make_jaxpr ---------------------------------------------------------


def eval_shape(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    below = jo.next_impl("eval_shape")
    if not in_bound_module():
        return below(fun, *args, **kwargs)
    where = "jaxoverride.eval_shape"

    def call() -> Any:
        # As jax.eval_shape: state changes and rng draws inside are discarded.
        state_call = _STATE.begin(where)
        out = below(kit.wraps(fun)(lambda *a, **k: state_call.run(fun, a, k)[0]), *args, **kwargs)
        state_call.finish(state_call.state)
        return out

    creation = lambda: fun(*kit.traced_arguments(_concrete(args)), **_concrete(kwargs))
    return _STATE.init_safe(where, creation, call)


def make_jaxpr(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
    below = jo.next_impl("make_jaxpr")

    def traced(*call_args: Any, **call_kwargs: Any) -> Any:
        where = "jaxoverride.make_jaxpr"

        def call() -> Any:
            state_call = _STATE.begin(where)
            pure = kit.wraps(fun)(lambda *a, **k: state_call.run(fun, a, k)[0])
            out = below(pure, *args, **kwargs)(*call_args, **call_kwargs)
            state_call.finish(state_call.state)
            return out

        # As JAX hands them: arrays, but for the static arguments.
        static = kwargs.get("static_argnums", args[0] if args else ())
        traced = lambda: kit.traced_arguments(call_args, static)
        return _STATE.init_safe(where, lambda: fun(*traced(), **call_kwargs), call)

    return _in_modules(fun, below(fun, *args, **kwargs), traced)


OVERRIDES: dict[str, Callable[..., Any]] = {
    **kit.stateful_transforms(
        _STATE, _batched_state_error, mapped=("vmap", "pmap", "shard_map"), module=__name__
    ),
    "jit": jit,
    "eval_shape": eval_shape,
    "make_jaxpr": make_jaxpr,
}
"""Neutral name -> Linen override, for the transforms."""
