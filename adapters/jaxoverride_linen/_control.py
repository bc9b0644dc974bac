"""Overrides of the neutral control flow: Linen state threaded through, and init-exact.

Each override is the kit's threaded combinator over the state source of the Linen modules
running now (``_scope.LinenSource``). Outside a bound module each one is the
implementation below it, untouched.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax

import jaxoverride as jo
from jaxoverride import adapter_kit as kit
from jaxoverride_linen._scope import in_bound_module, source

_NO_OPERAND: Any = inspect.signature(jax.lax.cond).parameters["operand"].default


def scan(
    f: Callable[..., Any],
    init: Any,
    xs: Any = None,
    length: Any = None,
    reverse: bool = False,
    unroll: Any = 1,
    _split_transpose: bool = False,
) -> Any:
    lower = jo.next_impl("lax.scan")
    if not in_bound_module():
        return lower(f, init, xs, length, reverse, unroll, _split_transpose)
    return kit.threaded_scan(
        source("jaxoverride.lax.scan", allow_fresh=True),
        lower,
        f,
        init,
        xs,
        length,
        reverse,
        unroll,
        _split_transpose,
    )


def while_loop(cond_fun: Callable[..., Any], body_fun: Callable[..., Any], init_val: Any) -> Any:
    lower = jo.next_impl("lax.while_loop")
    if not in_bound_module():
        return lower(cond_fun, body_fun, init_val)
    return kit.threaded_while_loop(
        source("jaxoverride.lax.while_loop", allow_fresh=True), lower, cond_fun, body_fun, init_val
    )


def fori_loop(
    lower_bound: Any,
    upper_bound: Any,
    body_fun: Callable[..., Any],
    init_val: Any,
    *,
    unroll: Any = None,
) -> Any:
    lower = jo.next_impl("lax.fori_loop")
    if not in_bound_module():
        return lower(lower_bound, upper_bound, body_fun, init_val, unroll=unroll)
    return kit.threaded_fori_loop(
        source("jaxoverride.lax.fori_loop", allow_fresh=True),
        lower,
        lower_bound,
        upper_bound,
        body_fun,
        init_val,
        unroll=unroll,
    )


def cond(
    pred: Any, true_fun: Any, false_fun: Any, *operands: Any, operand: Any = _NO_OPERAND
) -> Any:
    lower = jo.next_impl("lax.cond")
    keywords = {} if operand is _NO_OPERAND else {"operand": operand}
    if (
        not in_bound_module()
        or not (callable(true_fun) and callable(false_fun))
        or (operands and keywords)
    ):
        return lower(pred, true_fun, false_fun, *operands, **keywords)
    return kit.threaded_cond(
        source("jaxoverride.lax.cond", allow_fresh=True),
        lower,
        pred,
        true_fun,
        false_fun,
        *operands,
        **keywords,
    )


def switch(
    index: Any, branches: Sequence[Callable[..., Any]], *operands: Any, operand: Any = _NO_OPERAND
) -> Any:
    lower = jo.next_impl("lax.switch")
    keywords = {} if operand is _NO_OPERAND else {"operand": operand}
    if (
        not in_bound_module()
        or (operands and keywords)
        or not branches
        or not all(callable(b) for b in branches)
    ):
        return lower(index, branches, *operands, **keywords)
    return kit.threaded_switch(
        source("jaxoverride.lax.switch", allow_fresh=True),
        lower,
        index,
        branches,
        *operands,
        **keywords,
    )


def lax_map(f: Callable[..., Any], xs: Any, *, batch_size: int | None = None) -> Any:
    lower = jo.next_impl("lax.map")
    if not in_bound_module():
        return lower(f, xs, batch_size=batch_size)
    return kit.threaded_map(jo.lax.scan, jo.vmap, f, xs, batch_size=batch_size)
