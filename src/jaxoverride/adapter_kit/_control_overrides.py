"""Overrides of the neutral control flow, with JAX's signatures, written once.

Every stateful adapter overrides ``lax.scan``, ``lax.while_loop``, ``lax.fori_loop``,
``lax.cond``, ``lax.switch`` and ``lax.map`` the same way: where its framework's state is
not usable, or the call is one it cannot thread (a non-callable body, both ``operands``
and ``operand``), the override is the implementation below it, untouched; otherwise it
runs the kit's ``threaded_*`` combinator over the framework's ``StateSource``.

Stability: semi-public, as the rest of the kit.

Example:
  >>> import jax.numpy as jnp
  >>> import jaxoverride as jo
  >>> from jaxoverride import adapter_kit as kit
  >>> store = {"steps": jnp.int32(0)}
  >>> table = kit.threaded_control_flow(lambda: True, lambda where: kit.DictStateSource(store))
  >>> def body(i, x):
  ...     store["steps"] = store["steps"] + 1
  ...     return x + i
  >>> with jo.override_context(table):
  ...     out = jo.lax.fori_loop(0, 4, body, 0)
  >>> int(out), int(store["steps"])
  (6, 4)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jaxoverride as jo
from jaxoverride.adapter_kit import _state_threading as state_threading
from jaxoverride.adapter_kit._jax_arguments import jax_arguments, scan_arguments
from jaxoverride.adapter_kit._operands import NO_OPERAND
from jaxoverride.adapter_kit._state_source import StateSource


def when_active(
    name: str, active: Callable[[], bool], override: Callable[..., Any]
) -> Callable[..., Any]:
    """The override of ``name`` that runs ``override(below, *args, **kwargs)`` while
    ``active()``, ``below`` the implementation below it; otherwise that implementation,
    untouched."""

    def call(*args: Any, **kwargs: Any) -> Any:
        below = jo.next_impl(name)
        if not active():
            return below(*args, **kwargs)
        return override(below, *args, **kwargs)

    # Named as ``override``, for call logs (``describe_impl``).
    call.__module__, call.__name__ = override.__module__, override.__name__
    call.__qualname__ = override.__qualname__
    return call


def threaded_control_flow(
    active: Callable[[], bool], source: Callable[[str], StateSource], module: str | None = None
) -> dict[str, Callable[..., Any]]:
    """The control-flow overrides of an adapter, on the kit's ``threaded_*`` combinators.

    Args:
      active: whether the framework's state is usable here.
      source: ``source(where)``, the state source of the code running now.
      module: the adapter's module, which call logs (``jaxoverride_debug``) then name
        as the overrides' (``module.scan``); the kit's own if None.

    Returns:
      ``{"lax.scan": ..., "lax.while_loop": ..., "lax.fori_loop": ..., "lax.cond": ...,
      "lax.switch": ..., "lax.map": ...}``, each taking the arguments of JAX's function.
      JAX's deprecated ``cond(pred, true_operand, true_fun, false_operand, false_fun)``
      is recast as JAX recasts it, and then threaded; ``lax.map`` is a scan of the
      neutral ``jaxoverride.lax.scan`` (``threaded_map``).

    Example:
      >>> import jaxoverride as jo
      >>> from jaxoverride import adapter_kit as kit
      >>> table = kit.threaded_control_flow(lambda: False, lambda w: kit.DictStateSource({}))
      >>> with jo.override_context(table):
      ...     out = jo.lax.cond(True, lambda: 1, lambda: 2)
      >>> int(out)
      1
    """

    def scan_override(below: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        arguments = scan_arguments(*args, **kwargs)
        if not callable(arguments[0]):
            return below(*args, **kwargs)
        where = "jaxoverride.lax.scan"
        return state_threading.threaded_scan(source(where), below, *arguments)

    def while_override(below: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        cond_fun, body_fun, init_val = jax_arguments("lax.while_loop", *args, **kwargs)
        if not (callable(cond_fun) and callable(body_fun)):
            return below(*args, **kwargs)
        where = "jaxoverride.lax.while_loop"
        return state_threading.threaded_while_loop(
            source(where), below, cond_fun, body_fun, init_val
        )

    def fori_override(below: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        *arguments, unroll = jax_arguments("lax.fori_loop", *args, **kwargs)
        if not callable(arguments[2]):  # body_fun
            return below(*args, **kwargs)
        where = "jaxoverride.lax.fori_loop"
        return state_threading.threaded_fori_loop(source(where), below, *arguments, unroll=unroll)

    def cond_override(below: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        pred, true_fun, false_fun, operands, operand = jax_arguments("lax.cond", *args, **kwargs)
        if operand is not NO_OPERAND:
            if operands:
                return below(*args, **kwargs)
            operands = (operand,)
        if not (callable(true_fun) and callable(false_fun)):
            if callable(false_fun) and len(operands) == 2 and callable(operands[1]):
                # JAX's deprecated cond(pred, x_true, f_true, x_false, f_false), as JAX recasts it.
                x_true, f_true, x_false, f_false = true_fun, false_fun, *operands
                recast = (lambda x, _: f_true(x), lambda _, x: f_false(x), x_true, x_false)
                return cond_override(below, pred, *recast)
            return below(*args, **kwargs)
        where = "jaxoverride.lax.cond"
        return state_threading.threaded_cond(
            source(where), below, pred, true_fun, false_fun, *operands
        )

    def switch_override(below: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        index, branches, operands, operand = jax_arguments("lax.switch", *args, **kwargs)
        if operand is not NO_OPERAND:
            if operands:
                return below(*args, **kwargs)
            operands = (operand,)
        if not branches or not all(callable(b) for b in branches):
            return below(*args, **kwargs)
        where = "jaxoverride.lax.switch"
        return state_threading.threaded_switch(source(where), below, index, branches, *operands)

    def map_override(below: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        f, xs, batch_size = jax_arguments("lax.map", *args, **kwargs)
        return state_threading.threaded_map(jo.lax.scan, jo.vmap, f, xs, batch_size=batch_size)

    overrides = {
        name: when_active(name, active, override)
        for name, override in {
            "lax.scan": scan_override,
            "lax.while_loop": while_override,
            "lax.fori_loop": fori_override,
            "lax.cond": cond_override,
            "lax.switch": switch_override,
            "lax.map": map_override,
        }.items()
    }
    for name, override in overrides.items():
        override.__name__ = override.__qualname__ = name.removeprefix("lax.")
        if module is not None:
            override.__module__ = module
    return overrides
