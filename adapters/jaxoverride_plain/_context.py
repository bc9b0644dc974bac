"""``context()``: the init-safe combinators as overrides of the neutral API."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax

import jaxoverride as jo
from jaxoverride import adapter_kit as kit
from jaxoverride.adapter_kit import (
    INFER_SPECS,
    as_jax_operands,
    create_binding_axes,
    create_by_calling,
    infer_argnums_and_argnames,
    init_safe_call,
    shard_block_arguments,
    unbatched_arguments,
    zeros_for,
)
from jaxoverride_plain import _rules
from jaxoverride_plain._transforms import init_safe_transform


def _scan(*args: Any, **kwargs: Any) -> Any:
    return kit.init_safe_scan(*args, **kwargs, default_scan=jo.next_impl("lax.scan"))


def _while_loop(cond_fun: Any, body_fun: Any, init_val: Any) -> Any:
    return kit.init_safe_while_loop(
        cond_fun, body_fun, init_val, default_while_loop=jo.next_impl("lax.while_loop")
    )


def _fori_loop(lower: Any, upper: Any, body_fun: Any, init_val: Any, *, unroll: Any = None) -> Any:
    return kit.init_safe_fori_loop(
        lower, upper, body_fun, init_val, unroll=unroll,
        default_fori_loop=jo.next_impl("lax.fori_loop"),
    )  # fmt: skip


def _cond(pred: Any, true_fun: Any, false_fun: Any, *operands: Any, **operand: Any) -> Any:
    return kit.init_safe_cond(
        pred, true_fun, false_fun, *operands, **operand, default_cond=jo.next_impl("lax.cond")
    )


def _switch(index: Any, branches: Any, *operands: Any, **operand: Any) -> Any:
    return kit.init_safe_switch(
        index, branches, *operands, **operand, default_switch=jo.next_impl("lax.switch")
    )


def _map(f: Any, xs: Any, *, batch_size: Any = None) -> Any:
    return kit.init_safe_map(f, xs, batch_size=batch_size, default_map=jo.next_impl("lax.map"))


def _same_arguments(name: str, zeros: bool = False) -> Callable[..., Any]:
    """A transform override whose creation pass calls ``fun`` with the call's arguments
    (``zeros``: concrete zeros for any ``ShapeDtypeStruct``, which ``make_jaxpr`` accepts)."""

    def transform(fun: Any, *args: Any, **kwargs: Any) -> Any:
        creation = (lambda *a, **k: fun(*zeros_for(a), **zeros_for(k))) if zeros else fun
        return init_safe_transform(jo.next_impl(name)(fun, *args, **kwargs), creation)

    transform.__qualname__ = f"init_safe_{name}"
    return transform


def _positions(numbers: tuple[int, ...], count: int) -> set[int]:
    """The argument positions that ``argnums``-style ``numbers`` name in a call of ``count``."""
    return {n + count if n < 0 else n for n in numbers}


def _differentiating(name: str) -> Callable[..., Any]:
    """A ``grad``-family override: the creation pass sees the ``argnums`` arguments as the
    arrays JAX differentiates with respect to, and the others as given, as JAX passes them."""
    signature = inspect.signature(getattr(jax, name))

    def transform(fun: Any, *args: Any, **kwargs: Any) -> Any:
        argnums = signature.bind(fun, *args, **kwargs).arguments.get("argnums", 0)
        numbers = (argnums,) if isinstance(argnums, int) else tuple(argnums)

        def creation(*call_args: Any, **call_kwargs: Any) -> Any:
            wanted = _positions(numbers, len(call_args))
            converted = [as_jax_operands(a) if i in wanted else a for i, a in enumerate(call_args)]
            return fun(*converted, **call_kwargs)

        return init_safe_transform(jo.next_impl(name)(fun, *args, **kwargs), creation)

    transform.__qualname__ = f"init_safe_{name}"
    return transform


def _mapped(name: str) -> Callable[..., Any]:
    """A ``vmap``/``pmap`` override whose creation pass calls ``fun`` on one slice.

    Collectives over the mapped ``axis_name`` work in the creation pass (bound to size 1).
    """
    signature = inspect.signature(getattr(jax, name))

    def transform(fun: Any, *args: Any, **kwargs: Any) -> Any:
        arguments = signature.bind(fun, *args, **kwargs).arguments
        in_axes = arguments.get("in_axes", 0)
        axis_name = arguments.get("axis_name")
        create = create_by_calling
        if axis_name is not None:
            create = create_binding_axes(create_by_calling, [axis_name])

        def creation(*call_args: Any, **call_kwargs: Any) -> Any:
            # As in JAX, keyword arguments are always mapped over their leading axis.
            keywords = unbatched_arguments(tuple(call_kwargs.values()), 0)
            return fun(
                *unbatched_arguments(call_args, in_axes),
                **dict(zip(call_kwargs, keywords, strict=True)),
            )

        return init_safe_transform(
            jo.next_impl(name)(fun, *args, **kwargs), creation, create=create
        )

    transform.__qualname__ = f"init_safe_{name}"
    return transform


_SHARD_MAP = inspect.signature(jax.shard_map)


def _shard_map(fun: Any, *args: Any, **kwargs: Any) -> Any:
    """``shard_map`` whose creation pass calls ``fun`` on the first device's block."""
    arguments = _SHARD_MAP.bind(fun, *args, **kwargs).arguments
    in_specs = arguments.get("in_specs", INFER_SPECS)
    mesh = arguments.get("mesh")
    axis_names = arguments.get("axis_names") or ()
    transformed = jo.next_impl("shard_map")(fun, *args, **kwargs)

    def creation(*call_args: Any, **call_kwargs: Any) -> Any:
        return fun(*shard_block_arguments(call_args, in_specs, mesh), **call_kwargs)

    def create(thunk: Any) -> Any:
        # The mesh is looked up at call time: shard_map(mesh=None) uses the one in context.
        names = tuple(axis_names) or tuple(
            (mesh if mesh is not None else jax.sharding.get_abstract_mesh()).axis_names
        )
        return create_binding_axes(create_by_calling, names)(thunk)

    return init_safe_transform(transformed, creation, create=create)


def _primal_call(name: str, primals: Callable[..., tuple[Any, ...]]) -> Callable[..., Any]:
    """A ``jvp``/``vjp``/``linearize``/``eval_shape`` override: create on the primal call."""

    def call(fun: Any, *args: Any, **kwargs: Any) -> Any:
        below = jo.next_impl(name)
        return init_safe_call(
            # JAX traces ``fun`` on the primals as arrays, so the creation pass does too.
            lambda: fun(*as_jax_operands(primals(*args, **kwargs))),
            lambda: below(fun, *args, **kwargs),
        )

    call.__qualname__ = f"init_safe_{name}"
    return call


def _jvp_primals(primals: Any, tangents: Any, **_: Any) -> tuple[Any, ...]:
    return tuple(primals)


def _positional_primals(*primals: Any, **_: Any) -> tuple[Any, ...]:
    return primals


def _eval_shape_primals(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
    if kwargs:
        raise NotImplementedError(
            "jaxoverride_plain: eval_shape with keyword arguments at init is not supported; "
            "pass them positionally."
        )
    return zeros_for(args)


def _jit(fun: Any, *args: Any, **kwargs: Any) -> Any:
    """``jit`` whose creation pass sees the dynamic arguments as the arrays JAX traces, and
    the static ones as given."""
    arguments = inspect.signature(jax.jit).bind(fun, *args, **kwargs).arguments
    static_numbers, static_names = infer_argnums_and_argnames(
        fun, arguments.get("static_argnums"), arguments.get("static_argnames")
    )

    def creation(*call_args: Any, **call_kwargs: Any) -> Any:
        static = _positions(static_numbers, len(call_args))
        positional = [a if i in static else as_jax_operands(a) for i, a in enumerate(call_args)]
        keywords = {
            k: v if k in static_names else as_jax_operands(v) for k, v in call_kwargs.items()
        }
        return fun(*positional, **keywords)

    return init_safe_transform(jo.next_impl("jit")(fun, *args, **kwargs), creation)


_SAME_ARGUMENTS = ("checkpoint", "remat")
_DIFFERENTIATING = ("grad", "value_and_grad", "jacfwd", "jacrev", "hessian")

# Every overridable name is init-safe; nothing passes through.
TABLE = kit.OverrideTable(
    "jaxoverride_plain",
    {
        "lax.scan": _scan,
        "lax.while_loop": _while_loop,
        "lax.fori_loop": _fori_loop,
        "lax.cond": _cond,
        "lax.switch": _switch,
        "lax.map": _map,
        "jit": _jit,
        **{name: _same_arguments(name) for name in _SAME_ARGUMENTS},
        **{name: _differentiating(name) for name in _DIFFERENTIATING},
        "vmap": _mapped("vmap"),
        "pmap": _mapped("pmap"),
        "shard_map": _shard_map,
        "jvp": _primal_call("jvp", _jvp_primals),
        "vjp": _primal_call("vjp", _positional_primals),
        "linearize": _primal_call("linearize", _positional_primals),
        "eval_shape": _primal_call("eval_shape", _eval_shape_primals),
        "make_jaxpr": _same_arguments("make_jaxpr", zeros=True),
        "custom_vjp": _rules.rule("custom_vjp"),
        "custom_jvp": _rules.rule("custom_jvp"),
        "closure_convert": _rules.CONVERSIONS["closure_convert"],
        "lax.custom_root": _rules.CONVERSIONS["lax.custom_root"],
        "lax.custom_linear_solve": _rules.CONVERSIONS["lax.custom_linear_solve"],
    },
)
_CONTEXT = TABLE.context()


def context() -> jo.OverrideContext:
    """Makes the neutral API init-safe: control flow runs the combinators of this package,
    and ``jit``, ``grad``-like transforms, ``vmap``/``pmap``, ``jvp``/``vjp``/``linearize``
    and ``eval_shape`` create parameters outside their trace first; so do the implicit-
    differentiation names: ``custom_vjp``/``custom_jvp`` (the primal function runs once
    before JAX traces it), ``closure_convert`` (so the parameters it hoists exist),
    ``make_jaxpr``, ``lax.custom_root`` (on ``f(initial_guess)``) and
    ``lax.custom_linear_solve`` (on ``matvec(b)``).

    Outside ``init_context()`` every override delegates straight to the implementation
    below, so the context can stay entered around both init and apply.

    Returns:
      An ``OverrideContext`` (reusable; also a decorator and a mapping).

    Example:
      >>> import jax.numpy as jnp
      >>> import jaxoverride as jo, jaxoverride_plain as plain
      >>> params = {}
      >>> def body(carry, x):
      ...     if plain.is_initializing():
      ...         params.setdefault("w", jnp.float32(3.0))
      ...     return carry * params["w"], None
      >>> with plain.context(), plain.init_context():
      ...     carry, _ = jo.lax.scan(body, 1.0, length=2)
      >>> float(carry)
      9.0
    """
    return _CONTEXT
