"""``context()``: the init-safe combinators as overrides of the neutral control flow."""

from __future__ import annotations

from typing import Any

import jaxoverride as jo

from jaxoverride_plain import _combinators as c


def _scan(f: Any, init: Any, xs: Any = None, length: Any = None, reverse: bool = False,
          unroll: Any = 1, _split_transpose: bool = False) -> Any:
    return c.init_safe_scan(f, init, xs, length, reverse, unroll, _split_transpose,
                            default_scan=jo.next_impl("lax.scan"))


def _while_loop(cond_fun: Any, body_fun: Any, init_val: Any) -> Any:
    return c.init_safe_while_loop(cond_fun, body_fun, init_val,
                                  default_while_loop=jo.next_impl("lax.while_loop"))


def _fori_loop(lower: Any, upper: Any, body_fun: Any, init_val: Any, *, unroll: Any = None
               ) -> Any:
    return c.init_safe_fori_loop(lower, upper, body_fun, init_val, unroll=unroll,
                                 default_fori_loop=jo.next_impl("lax.fori_loop"))


def _cond(pred: Any, true_fun: Any, false_fun: Any, *operands: Any, **operand: Any) -> Any:
    return c.init_safe_cond(pred, true_fun, false_fun, *operands, **operand,
                            default_cond=jo.next_impl("lax.cond"))


def _switch(index: Any, branches: Any, *operands: Any, **operand: Any) -> Any:
    return c.init_safe_switch(index, branches, *operands, **operand,
                              default_switch=jo.next_impl("lax.switch"))


def _map(f: Any, xs: Any, *, batch_size: Any = None) -> Any:
    return c.init_safe_map(f, xs, batch_size=batch_size, default_map=jo.next_impl("lax.map"))


_CONTEXT = jo.override_context(
    {
        "lax.scan": _scan,
        "lax.while_loop": _while_loop,
        "lax.fori_loop": _fori_loop,
        "lax.cond": _cond,
        "lax.switch": _switch,
        "lax.map": _map,
    },
    name="jaxoverride_plain",
)


def context() -> jo.OverrideContext:
    """Makes the neutral control flow init-safe: ``jaxoverride.lax.scan``, ``while_loop``,
    ``fori_loop``, ``cond``, ``switch`` and ``map`` run the combinators of this package.

    Outside ``init_context()`` they delegate straight to the implementation below, so
    the context can stay entered around both init and apply.

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
