"""Overrides of the neutral transforms that trace their function once per call.

``vmap``, ``grad``, ``value_and_grad``, ``jacfwd``, ``jacrev``, ``hessian``,
``checkpoint``/``remat`` and the calls ``jvp``, ``vjp``, ``linearize`` and ``eval_shape``:
the function runs in a Haiku frame built from the caller's state (params, state, rng),
closed over, and returns what changed (``stateful.difference``) as an auxiliary output
that JAX does not map, differentiate or batch. So a counter increments once per call,
not once per basis vector, and rng keys are drawn as if the transform were not there.
Parameters created inside (at init) come out the same way. A new traced function is made
per call, so JAX's own caches (``checkpoint``'s) can never replay a stale Haiku trace.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
from haiku._src import stateful

import jaxoverride as jo
from jaxoverride import adapter_kit as kit
from jaxoverride_haiku._creation import init_safe_call
from jaxoverride_haiku._frames import Threaded, state_usable
from jaxoverride_haiku._rng import update_state


class _TracedCall:
    """One call of a function that a JAX transform traces once, Haiku state threaded."""

    __slots__ = ("state", "thread")

    def __init__(self, where: str):
        self.state = stateful.internal_state()
        self.thread = Threaded(1, where, check_params=False)

    def run(
        self,
        fun: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        state: Any = None,
    ) -> tuple[Any, Any]:
        """``fun`` in a frame holding ``state`` (the captured state if None)."""
        state = self.state if state is None else state
        with self.thread.frame(0, state):
            out = fun(*args, **kwargs)
            changed = stateful.difference(state, stateful.internal_state())
        return out, changed

    def finish(self, changed: Any) -> None:
        update_state(changed)
        self.thread.finish()


def _wraps(fun: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    try:
        return functools.wraps(fun)
    except (AttributeError, TypeError):  # pragma: no cover - exotic callables
        return lambda f: f


# -- vmap ------------------------------------------------------------------------------


def _batched_state_error(err: ValueError) -> ValueError:
    return ValueError(
        "jaxoverride.vmap: a Haiku parameter, state value or rng key computed inside the "
        "mapped function depends on the mapped axis. Haiku state is shared across the batch "
        "(as with hk.vmap(split_rng=False)): parameters must be created from rng and "
        "shapes only, and state updates must not depend on mapped inputs (reduce over the "
        "batch with an axis_name first, or keep per-example values in the outputs). "
        f"JAX said: {err}"
    )


def vmap(
    fun: Callable[..., Any], in_axes: Any = 0, out_axes: Any = 0, *args: Any, **kwargs: Any
) -> Callable[..., Any]:
    lower = jo.next_impl("vmap")
    plain = lower(fun, in_axes, out_axes, *args, **kwargs)

    @_wraps(fun)
    def mapped(*call_args: Any, **call_kwargs: Any) -> Any:
        if not state_usable():
            return plain(*call_args, **call_kwargs)
        call = _TracedCall("jaxoverride.vmap")
        pure = _wraps(fun)(lambda *a, **k: call.run(fun, a, k))
        try:
            out, changed = lower(pure, in_axes, (out_axes, None), *args, **kwargs)(
                *call_args, **call_kwargs
            )
        except ValueError as err:
            if "out_axes" in str(err) and "None" in str(err):
                raise _batched_state_error(err) from err
            raise
        call.finish(changed)
        return out

    return mapped


# -- differentiation -------------------------------------------------------------------


def _differentiating(name: str, value_first: bool) -> Callable[..., Callable[..., Any]]:
    """The override of ``grad``-like transforms: run with ``has_aux=True``, state in aux."""
    signature = inspect.signature(getattr(jax, name))

    def transform(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
        lower = jo.next_impl(name)
        plain = lower(fun, *args, **kwargs)
        bound = signature.bind(fun, *args, **kwargs)
        has_aux = bool(bound.arguments.get("has_aux", False))
        bound.arguments["has_aux"] = True
        options = dict(bound.arguments)
        del options[next(iter(signature.parameters))]

        @_wraps(fun)
        def differentiated(*call_args: Any, **call_kwargs: Any) -> Any:
            if not state_usable():
                return plain(*call_args, **call_kwargs)
            call = _TracedCall(f"jaxoverride.{name}")

            @_wraps(fun)
            def pure(*a: Any, **k: Any) -> Any:
                out, changed = call.run(fun, a, k)
                value, aux = out if has_aux else (out, None)
                return value, (aux, changed)

            result = lower(pure, **options)(*call_args, **call_kwargs)
            if value_first:  # value_and_grad: ((value, (aux, changed)), grads)
                (value, (aux, changed)), grads = result
                call.finish(changed)
                return ((value, aux), grads) if has_aux else (value, grads)
            derivative, (aux, changed) = result
            call.finish(changed)
            return (derivative, aux) if has_aux else derivative

        return differentiated

    transform.__name__ = transform.__qualname__ = name
    return transform


grad = _differentiating("grad", value_first=False)
value_and_grad = _differentiating("value_and_grad", value_first=True)
jacfwd = _differentiating("jacfwd", value_first=False)
jacrev = _differentiating("jacrev", value_first=False)
hessian = _differentiating("hessian", value_first=False)


def _with_aux(name: str) -> Callable[..., Any]:
    """The override of ``vjp`` and ``linearize``: ``(out, fn[, aux])`` with state in aux."""

    def call_impl(
        fun: Callable[..., Any], *primals: Any, has_aux: bool = False, **kwargs: Any
    ) -> Any:
        lower = jo.next_impl(name)
        if not state_usable():
            return lower(fun, *primals, has_aux=has_aux, **kwargs)
        call = _TracedCall(f"jaxoverride.{name}")

        @_wraps(fun)
        def pure(*a: Any) -> Any:
            out, changed = call.run(fun, a, {})
            value, aux = out if has_aux else (out, None)
            return value, (aux, changed)

        out, function, (aux, changed) = lower(pure, *primals, has_aux=True, **kwargs)
        call.finish(changed)
        return (out, function, aux) if has_aux else (out, function)

    call_impl.__name__ = call_impl.__qualname__ = name
    return call_impl


vjp = _with_aux("vjp")
linearize = _with_aux("linearize")


def jvp(fun: Callable[..., Any], primals: Any, tangents: Any, has_aux: bool = False) -> Any:
    lower = jo.next_impl("jvp")
    if not state_usable():
        return lower(fun, primals, tangents, has_aux=has_aux)
    call = _TracedCall("jaxoverride.jvp")

    @_wraps(fun)
    def pure(*a: Any) -> Any:
        out, changed = call.run(fun, a, {})
        value, aux = out if has_aux else (out, None)
        return value, (aux, changed)

    out, tangent_out, (aux, changed) = lower(pure, primals, tangents, has_aux=True)
    call.finish(changed)
    return (out, tangent_out, aux) if has_aux else (out, tangent_out)


# -- checkpoint / remat ----------------------------------------------------------------


def _after_state(
    lower: Callable[..., Any],
    fun: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``checkpoint``'s options for a function given one extra leading argument."""
    bound = inspect.signature(lower).bind_partial(fun, *args, **kwargs)
    static = bound.arguments.get("static_argnums")
    if static is not None:
        numbers = (static,) if isinstance(static, int) else tuple(static)
        bound.arguments["static_argnums"] = kit.shift_argnums(numbers)
    return bound.args[1:], bound.kwargs


def _rematerializing(name: str) -> Callable[..., Callable[..., Any]]:
    def transform(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
        lower = jo.next_impl(name)
        plain = lower(fun, *args, **kwargs)

        @_wraps(fun)
        def rematerialized(*call_args: Any, **call_kwargs: Any) -> Any:
            if not state_usable():
                return plain(*call_args, **call_kwargs)
            call = _TracedCall(f"jaxoverride.{name}")
            # The state goes in as an argument, as hk.remat passes it: closed over, JAX's
            # rematerialisation may rebuild a scalar integer param as a Python literal.
            pure = _wraps(fun)(lambda state, *a, **k: call.run(fun, a, k, state))
            shifted = _after_state(lower, fun, args, kwargs)
            out, changed = lower(pure, *shifted[0], **shifted[1])(
                call.state, *call_args, **call_kwargs
            )
            call.finish(changed)
            return out

        return rematerialized

    transform.__name__ = transform.__qualname__ = name
    return transform


checkpoint = _rematerializing("checkpoint")
remat = _rematerializing("remat")


# -- eval_shape ------------------------------------------------------------------------


def _concrete(tree: Any) -> Any:
    """What ``eval_shape`` traces ``fun`` on, made concrete for the creation pass: zeros for
    ``ShapeDtypeStruct`` leaves, and every other leaf as the array JAX would make of it."""
    return kit.as_jax_operands(kit.zeros_for(tree))


def eval_shape(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    lower = jo.next_impl("eval_shape")
    if not state_usable():
        return lower(fun, *args, **kwargs)

    def creation() -> None:
        fun(*_concrete(args), **_concrete(kwargs))

    def apply() -> Any:
        # As hk.eval_shape: state changes and rng draws are discarded; modules made
        # inside still take their names.
        call = _TracedCall("jaxoverride.eval_shape")
        pure = _wraps(fun)(lambda *a, **k: call.run(fun, a, k)[0])
        out = lower(pure, *args, **kwargs)
        call.thread.finish()
        return out

    return init_safe_call(creation, apply)
