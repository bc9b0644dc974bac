"""``checkpoint`` (``remat``) and ``eval_shape`` that keep relative identity."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jaxoverride as jo
from jaxoverride.adapter_kit import infer_argnums_and_argnames
from jaxoverride_dag._jit import pack_output, unpack_output
from jaxoverride_dag._out import packing_outputs, unforward_tree
from jaxoverride_dag._plan import encode
from jaxoverride_dag._static_args import StaticArgs


def _checkpoint(
    api: str,
    fun: Callable[..., Any],
    static_argnums: Any,
    static_argnames: Any,
    options: dict[str, Any],
) -> Callable[..., Any]:
    if not callable(fun):
        raise TypeError(f"jaxoverride.{api}: expected a callable value, got {fun!r}.")
    prevent_cse = options.get("prevent_cse", True)
    if not isinstance(prevent_cse, bool):
        raise NotImplementedError(
            f"jaxoverride_dag.{api}: prevent_cse must be a single bool here, got "
            f"{prevent_cse!r}: a shared leaf is passed once, so a per-argument flag would be "
            "ambiguous for it. Pass True or False."
        )
    static = StaticArgs(*infer_argnums_and_argnames(fun, static_argnums, static_argnames))
    below = jo.next_impl(api)

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        layout, values, rest, rest_kwargs = static.split(args, kwargs)
        plan, dyn = encode((rest, rest_kwargs), f"{api} arguments", "call")

        def traced(*inputs: Any) -> Any:
            inner_rest, inner_kwargs = plan.decode_inside(inputs)
            call_args, call_kwargs = StaticArgs.merge(layout, values, inner_rest, inner_kwargs)
            return pack_output(fun(*call_args, **call_kwargs), f"{api} outputs")

        out = below(traced, **options)(*dyn)
        return unpack_output(unforward_tree(out, dyn))

    checkpointed.__wrapped__ = fun  # type: ignore[attr-defined]
    return checkpointed


def dag_checkpoint(
    fun: Callable[..., Any], *, static_argnums: Any = (), static_argnames: Any = (), **options: Any
) -> Callable[..., Any]:
    """The ``"checkpoint"`` override: ``jax.checkpoint``'s signature."""
    return _checkpoint("checkpoint", fun, static_argnums, static_argnames, options)


def dag_remat(
    fun: Callable[..., Any], *, static_argnums: Any = (), static_argnames: Any = (), **options: Any
) -> Callable[..., Any]:
    """The ``"remat"`` override: ``jax.remat``'s signature."""
    return _checkpoint("remat", fun, static_argnums, static_argnames, options)


def dag_eval_shape(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The ``"eval_shape"`` override: shapes of traced outputs, static outputs as they are."""
    below = jo.next_impl("eval_shape")
    if not callable(fun):  # JAX's own error
        return below(fun, *args, **kwargs)
    plan, dyn = encode((args, kwargs), "eval_shape arguments", "call")
    traced, _ = packing_outputs(fun, plan, "eval_shape outputs", lambda _: ())
    return below(traced, *dyn).unpack()
