"""Overrides of the neutral control flow: Haiku state threaded through, and init-exact.

Each override builds on ``jaxoverride_plain``'s combinator for the same function: at init
the combinator makes the creation pass (``_creation.create``) and then the apply pass,
which here is the *threaded* loop: JAX's loop (or the next override below) with the
Haiku state and rng in the carry, exactly as ``hk.scan`` & co. carry them, and params
closed over. Outside a transform, or where Haiku state is unusable, each override is the
implementation below it, untouched.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
from haiku._src import stateful

import jaxoverride as jo
import jaxoverride_plain as plain
from jaxoverride import adapter_kit as kit, lax as jlax
from jaxoverride.adapter_kit import NO_OPERAND as _NO_OPERAND
from jaxoverride_haiku._creation import create
from jaxoverride_haiku._frames import (
    InternalState,
    Threaded,
    check_same_state,
    initializing,
    leaf_ids,
    loop_state,
    state_usable,
)

_HOOKS: dict[str, Any] = {"initializing": initializing, "create": create}


def _finish(thread: Threaded, state: InternalState) -> None:
    stateful.update_internal_state(state)
    thread.finish()


# -- scan ------------------------------------------------------------------------------


def _threaded_scan(
    lower: Callable[..., Any],
    f: Callable[..., Any],
    init: Any,
    xs: Any,
    length: Any,
    reverse: bool,
    unroll: Any,
    _split_transpose: bool,
) -> Any:
    where = "jaxoverride.lax.scan"
    thread = Threaded(1, where)

    @functools.wraps(f)
    def body(carry: Any, x: Any) -> Any:
        value, state = carry
        with thread.frame(0, state):
            value, y = f(value, x)
            after = loop_state()
        check_same_state(where, state, after)
        return (value, after), y

    (value, state), ys = lower(
        body, (init, loop_state()), xs, length, reverse, unroll, _split_transpose
    )
    _finish(thread, state)
    return value, ys


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
    if not state_usable():
        return lower(f, init, xs, length, reverse, unroll, _split_transpose)
    return plain.init_safe_scan(
        f,
        init,
        xs,
        length,
        reverse,
        unroll,
        _split_transpose,
        default_scan=functools.partial(_threaded_scan, lower),
        **_HOOKS,
    )


# -- while_loop ------------------------------------------------------------------------


class _CondChangesStateError(Exception):
    """Raised while tracing a ``cond_fun`` that sets state or draws rng keys."""


def _while_read_only_cond(
    lower: Callable[..., Any],
    cond_fun: Callable[..., Any],
    body_fun: Callable[..., Any],
    init_val: Any,
) -> Any:
    where = "jaxoverride.lax.while_loop"
    thread = Threaded(2, where)

    @functools.wraps(cond_fun)
    def cond(carry: Any) -> Any:
        value, state = carry
        with thread.frame(0, state) as inner:
            before = leaf_ids(inner)
            pred = cond_fun(value)
            if leaf_ids(inner) != before:
                raise _CondChangesStateError
        return pred

    @functools.wraps(body_fun)
    def body(carry: Any) -> Any:
        value, state = carry
        with thread.frame(1, state):
            value = body_fun(value)
            after = loop_state()
        check_same_state(where, state, after)
        return value, after

    value, state = lower(cond, body, (init_val, loop_state()))
    _finish(thread, state)
    return value


def _while_stateful_cond(
    lower: Callable[..., Any],
    cond_fun: Callable[..., Any],
    body_fun: Callable[..., Any],
    init_val: Any,
) -> Any:
    # JAX's cond_fun cannot return state, so evaluate the predicate at the end of each
    # body instead, carrying it: cond, body, cond, body, ... exactly as Python would.
    where = "jaxoverride.lax.while_loop"
    first = jnp.asarray(cond_fun(init_val), dtype=bool)
    thread = Threaded(1, where)

    @functools.wraps(body_fun)
    def body(carry: Any) -> Any:
        value, state, _ = carry
        with thread.frame(0, state):
            value = body_fun(value)
            pred = jnp.asarray(cond_fun(value), dtype=bool)
            after = loop_state()
        check_same_state(where, state, after)
        return value, after, pred

    value, state, _ = lower(lambda carry: carry[2], body, (init_val, loop_state(), first))
    _finish(thread, state)
    return value


def _threaded_while(
    lower: Callable[..., Any],
    cond_fun: Callable[..., Any],
    body_fun: Callable[..., Any],
    init_val: Any,
) -> Any:
    try:
        return _while_read_only_cond(lower, cond_fun, body_fun, init_val)
    except _CondChangesStateError:
        return _while_stateful_cond(lower, cond_fun, body_fun, init_val)


def while_loop(cond_fun: Callable[..., Any], body_fun: Callable[..., Any], init_val: Any) -> Any:
    lower = jo.next_impl("lax.while_loop")
    if not state_usable():
        return lower(cond_fun, body_fun, init_val)
    return plain.init_safe_while_loop(
        cond_fun,
        body_fun,
        init_val,
        default_while_loop=functools.partial(_threaded_while, lower),
        **_HOOKS,
    )


# -- fori_loop -------------------------------------------------------------------------


def _threaded_fori(
    lower: Callable[..., Any],
    lower_bound: Any,
    upper_bound: Any,
    body_fun: Callable[..., Any],
    init_val: Any,
    *,
    unroll: Any = None,
) -> Any:
    where = "jaxoverride.lax.fori_loop"
    thread = Threaded(1, where)

    @functools.wraps(body_fun)
    def body(i: Any, carry: Any) -> Any:
        value, state = carry
        with thread.frame(0, state):
            value = body_fun(i, value)
            after = loop_state()
        check_same_state(where, state, after)
        return value, after

    value, state = lower(lower_bound, upper_bound, body, (init_val, loop_state()), unroll=unroll)
    _finish(thread, state)
    return value


def fori_loop(
    lower_bound: Any,
    upper_bound: Any,
    body_fun: Callable[..., Any],
    init_val: Any,
    *,
    unroll: Any = None,
) -> Any:
    lower = jo.next_impl("lax.fori_loop")
    if not state_usable():
        return lower(lower_bound, upper_bound, body_fun, init_val, unroll=unroll)
    return plain.init_safe_fori_loop(
        lower_bound,
        upper_bound,
        body_fun,
        init_val,
        unroll=unroll,
        default_fori_loop=functools.partial(_threaded_fori, lower),
        **_HOOKS,
    )


# -- cond and switch -------------------------------------------------------------------


def _branch(thread: Threaded, index: int, fun: Callable[..., Any]) -> Callable[[Any], Any]:
    def run(packed: Any) -> Any:
        state, operands = packed
        with thread.frame(index, state):
            out = fun(*operands)
            after = loop_state()
        check_same_state(thread.where, state, after)
        return out, after

    return functools.wraps(fun)(run) if callable(fun) else run


def _threaded_branches(
    lower: Callable[..., Any],
    where: str,
    selector: Any,
    branches: Sequence[Callable[..., Any]],
    operands: tuple[Any, ...],
    call: Callable[..., Any],
) -> Any:
    # One wrapper per distinct branch object, so JAX traces a repeated branch once, as
    # it does without the adapter.
    distinct = plain.distinct_functions(branches)
    thread = Threaded(len(distinct), where)
    by_id = {id(fun): _branch(thread, i, fun) for i, fun in enumerate(distinct)}
    wrapped = [by_id[id(fun)] for fun in branches]
    out, state = call(lower, selector, wrapped, (loop_state(), operands))
    _finish(thread, state)
    return out


def _threaded_cond(
    lower: Callable[..., Any],
    pred: Any,
    true_fun: Callable[..., Any],
    false_fun: Callable[..., Any],
    *operands: Any,
    operand: Any = _NO_OPERAND,
) -> Any:
    if operand is not _NO_OPERAND:
        operands = (operand,)
    return _threaded_branches(
        lower,
        "jaxoverride.lax.cond",
        pred,
        (true_fun, false_fun),
        operands,
        lambda lower, pred, fns, packed: lower(pred, fns[0], fns[1], packed),
    )


def cond(
    pred: Any, true_fun: Any, false_fun: Any, *operands: Any, operand: Any = _NO_OPERAND
) -> Any:
    lower = jo.next_impl("lax.cond")
    if not (callable(true_fun) and callable(false_fun)):
        if callable(false_fun) and len(operands) == 2 and callable(operands[1]):
            # JAX's deprecated cond(pred, x_true, f_true, x_false, f_false), as JAX recasts it.
            x_true, f_true, x_false, f_false = true_fun, false_fun, *operands
            return cond(pred, lambda x, _: f_true(x), lambda _, x: f_false(x), x_true, x_false)
        return lower(pred, true_fun, false_fun, *operands, operand=operand)
    keywords = {} if operand is _NO_OPERAND else {"operand": operand}
    if not state_usable() or (operands and keywords):
        return lower(pred, true_fun, false_fun, *operands, **keywords)
    return plain.init_safe_cond(
        pred,
        true_fun,
        false_fun,
        *operands,
        **keywords,
        default_cond=functools.partial(_threaded_cond, lower),
        **_HOOKS,
    )


def _threaded_switch(
    lower: Callable[..., Any],
    index: Any,
    branches: Sequence[Callable[..., Any]],
    *operands: Any,
    operand: Any = _NO_OPERAND,
) -> Any:
    if operand is not _NO_OPERAND:
        operands = (operand,)
    return _threaded_branches(
        lower,
        "jaxoverride.lax.switch",
        index,
        tuple(branches),
        operands,
        lambda lower, index, fns, packed: lower(index, fns, packed),
    )


def switch(
    index: Any, branches: Sequence[Callable[..., Any]], *operands: Any, operand: Any = _NO_OPERAND
) -> Any:
    lower = jo.next_impl("lax.switch")
    keywords = {} if operand is _NO_OPERAND else {"operand": operand}
    if (
        not state_usable()
        or (operands and keywords)
        or not branches
        or not all(callable(b) for b in branches)
    ):
        return lower(index, branches, *operands, **keywords)
    return plain.init_safe_switch(
        index,
        branches,
        *operands,
        **keywords,
        default_switch=functools.partial(_threaded_switch, lower),
        **_HOOKS,
    )


# -- map -------------------------------------------------------------------------------


def map(f: Callable[..., Any], xs: Any, *, batch_size: int | None = None) -> Any:
    """``lax.map`` as JAX writes it, in terms of the neutral ``scan`` and ``vmap``.

    JAX's map has no carry to thread state through; like ``hk.map``, this one is a scan
    (each element sees the state the previous one left), and with ``batch_size`` a scan
    of ``vmap``s (state is shared across a batch, as in ``jaxoverride.vmap``).
    """
    lower = jo.next_impl("lax.map")
    if not state_usable():
        return lower(f, xs, batch_size=batch_size)
    if batch_size is None:
        _, ys = jlax.scan(lambda _, x: ((), f(x)), (), xs)
        return ys
    blocks = lambda xs: jlax.scan(lambda _, x: ((), jo.vmap(f)(x)), (), xs)[1]
    return kit.batched_map(blocks, jo.vmap(f), xs, batch_size)
