"""Overrides of the neutral control flow: Haiku state threaded through, and init-exact.

Each override hands JAX (or the next override below) the *threaded* loop: the Haiku
state and rng in the carry, exactly as ``hk.scan`` & co. carry them. Outside a
transform, or where Haiku state is unusable, each override is the implementation below
it, untouched.

At init the loop is traced once, as at apply, and a parameter that a body or branch
creates is made at the call's site (``_site``): outside the trace, under the name Haiku
gives it there, so that init returns what apply returns and a loop that runs zero times
has still created its parameters. Only where a body creates Haiku *state* (which would
change the carry) does init fall back to ``jaxoverride_plain``'s creation pass first.

At apply the functions handed to JAX are reused across calls (``_reuse``) and params
ride in the carry instead of being closed over, so that an identical eager call hits
JAX's caches and compiles once.
"""

from __future__ import annotations

import copy
import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax.numpy as jnp

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
    state_names,
    state_usable,
)
from jaxoverride_haiku._reuse import Build, Getter, Handed, Wrappers, fresh, reused
from jaxoverride_haiku._rng import update_state
from jaxoverride_haiku._site import creating_site, current_site, init_once

_HOOKS: dict[str, Any] = {"initializing": initializing, "create": create}
T = TypeVar("T")


def _finish(thread: Threaded, state: InternalState) -> None:
    # Params are read-only in a loop: what came out of the carry is not written back.
    update_state(state._replace(params=None))
    thread.finish()


def _check(where: str, before: InternalState, after: InternalState) -> InternalState:
    """``after``, checked to hold the state entries of ``before``.

    At init, state created inside the body is left out instead (the carry keeps its
    structure, and the trace completes: an aborted one would keep tracers alive), and
    the site records it, so that the outermost call starts again with a creation pass.
    """
    site = current_site()
    if site is not None and state_names(after.state) - state_names(before.state):
        site.state_created = True
        kept = copy.copy(after.state)  # the mapping types of the carry, kept
        for module in list(kept):
            if module not in before.state:
                del kept[module]
                continue
            bundle = kept[module] = copy.copy(kept[module])
            for name in list(bundle):
                if name not in before.state[module]:
                    del bundle[name]
        return after._replace(state=kept)
    check_same_state(where, before, after)
    return after


def _wrappers(
    where: str, functions: Sequence[Any], build: Build, count: int | None = None
) -> Wrappers:
    if creating_site():  # init: traced once, parameters made at the site
        return fresh(where, functions, build, count, check_params=False)
    return reused(where, functions, build, count)


# -- scan ------------------------------------------------------------------------------


def _scan_build(carry_params: bool) -> Build:
    def build(thread: Threaded, refs: Sequence[Getter]) -> list[Handed]:
        def run(f: Callable[..., Any], carry: Any, x: Any) -> Any:
            value, state = carry
            with thread.frame(0, state):
                value, y = f(value, x)
                after = loop_state(carry_params)
            after = _check(thread.where, state, after)
            return (value, after), y

        return [Handed(refs[0], run)]

    return build


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
    carry_params = not creating_site()
    wrappers = _wrappers("jaxoverride.lax.scan", [f], _scan_build(carry_params))
    (value, state), ys = lower(
        wrappers.functions[0],
        (init, loop_state(carry_params)),
        xs,
        length,
        reverse,
        unroll,
        _split_transpose,
    )
    _finish(wrappers.thread, state)
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
    if not state_usable() or not callable(f):
        return lower(f, init, xs, length, reverse, unroll, _split_transpose)
    threaded = functools.partial(_threaded_scan, lower)
    return init_once(
        lambda: threaded(f, init, xs, length, reverse, unroll, _split_transpose),
        lambda: plain.init_safe_scan(
            f, init, xs, length, reverse, unroll, _split_transpose, default_scan=threaded, **_HOOKS
        ),
    )


# -- while_loop ------------------------------------------------------------------------


class _CondChangesStateError(Exception):
    """Raised while tracing a ``cond_fun`` that sets state or draws rng keys."""


def _while_read_only_build(carry_params: bool) -> Build:
    def build(thread: Threaded, refs: Sequence[Getter]) -> list[Handed]:
        def cond(cond_fun: Callable[..., Any], carry: Any) -> Any:
            value, state = carry
            with thread.frame(0, state) as inner:
                before = leaf_ids(inner)
                pred = cond_fun(value)
                if leaf_ids(inner) != before:
                    raise _CondChangesStateError
            return pred

        def body(body_fun: Callable[..., Any], carry: Any) -> Any:
            value, state = carry
            with thread.frame(1, state):
                value = body_fun(value)
                after = loop_state(carry_params)
            after = _check(thread.where, state, after)
            return value, after

        return [Handed(refs[0], cond), Handed(refs[1], body)]

    return build


def _while_stateful_build(carry_params: bool) -> Build:
    # JAX's cond_fun cannot return state, so evaluate the predicate at the end of each
    # body instead, carrying it: cond, body, cond, body, ... exactly as Python would.
    def build(thread: Threaded, refs: Sequence[Getter]) -> list[Handed]:
        cond_ref = refs[0]

        def body(body_fun: Callable[..., Any], carry: Any) -> Any:
            value, state, _ = carry
            with thread.frame(0, state):
                value = body_fun(value)
                pred = jnp.asarray(cond_ref()(value), dtype=bool)
                after = loop_state(carry_params)
            after = _check(thread.where, state, after)
            return value, after, pred

        return [Handed(refs[1], body)]

    return build


def _carried_predicate(carry: Any) -> Any:
    return carry[2]


def _threaded_while(
    lower: Callable[..., Any],
    cond_fun: Callable[..., Any],
    body_fun: Callable[..., Any],
    init_val: Any,
) -> Any:
    where = "jaxoverride.lax.while_loop"
    carry_params = not creating_site()
    functions = [cond_fun, body_fun]
    read_only = _wrappers(where, functions, _while_read_only_build(carry_params))
    if read_only.variant is None:
        try:
            value, state = lower(*read_only.functions, (init_val, loop_state(carry_params)))
        except _CondChangesStateError:
            read_only.variant = "stateful"  # reused: the next call goes straight there
        else:
            _finish(read_only.thread, state)
            return value
    first = jnp.asarray(cond_fun(init_val), dtype=bool)
    wrappers = _wrappers(where, functions, _while_stateful_build(carry_params), count=1)
    value, state, _ = lower(
        _carried_predicate, wrappers.functions[0], (init_val, loop_state(carry_params), first)
    )
    _finish(wrappers.thread, state)
    return value


def while_loop(cond_fun: Callable[..., Any], body_fun: Callable[..., Any], init_val: Any) -> Any:
    lower = jo.next_impl("lax.while_loop")
    if not state_usable() or not (callable(cond_fun) and callable(body_fun)):
        return lower(cond_fun, body_fun, init_val)
    threaded = functools.partial(_threaded_while, lower)
    return init_once(
        lambda: threaded(cond_fun, body_fun, init_val),
        lambda: plain.init_safe_while_loop(
            cond_fun, body_fun, init_val, default_while_loop=threaded, **_HOOKS
        ),
    )


# -- fori_loop -------------------------------------------------------------------------


def _fori_build(carry_params: bool) -> Build:
    def build(thread: Threaded, refs: Sequence[Getter]) -> list[Handed]:
        def run(body_fun: Callable[..., Any], i: Any, carry: Any) -> Any:
            value, state = carry
            with thread.frame(0, state):
                value = body_fun(i, value)
                after = loop_state(carry_params)
            after = _check(thread.where, state, after)
            return value, after

        return [Handed(refs[0], run)]

    return build


def _threaded_fori(
    lower: Callable[..., Any],
    lower_bound: Any,
    upper_bound: Any,
    body_fun: Callable[..., Any],
    init_val: Any,
    *,
    unroll: Any = None,
) -> Any:
    carry_params = not creating_site()
    wrappers = _wrappers("jaxoverride.lax.fori_loop", [body_fun], _fori_build(carry_params))
    value, state = lower(
        lower_bound,
        upper_bound,
        wrappers.functions[0],
        (init_val, loop_state(carry_params)),
        unroll=unroll,
    )
    _finish(wrappers.thread, state)
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
    if not state_usable() or not callable(body_fun):
        return lower(lower_bound, upper_bound, body_fun, init_val, unroll=unroll)
    threaded = functools.partial(_threaded_fori, lower)
    return init_once(
        lambda: threaded(lower_bound, upper_bound, body_fun, init_val, unroll=unroll),
        lambda: plain.init_safe_fori_loop(
            lower_bound,
            upper_bound,
            body_fun,
            init_val,
            unroll=unroll,
            default_fori_loop=threaded,
            **_HOOKS,
        ),
    )


# -- cond and switch -------------------------------------------------------------------


def _branches_build(carry_params: bool) -> Build:
    def build(thread: Threaded, refs: Sequence[Getter]) -> list[Handed]:
        def branch(index: int) -> Handed:
            def run(fun: Callable[..., Any], packed: Any) -> Any:
                state, operands = packed
                with thread.frame(index, state):
                    out = fun(*operands)
                    after = loop_state(carry_params)
                after = _check(thread.where, state, after)
                return out, after

            return Handed(refs[index], run)

        return [branch(index) for index in range(len(refs))]

    return build


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
    carry_params = not creating_site()
    wrappers = _wrappers(where, distinct, _branches_build(carry_params))
    by_id = {id(fun): handed for fun, handed in zip(distinct, wrappers.functions, strict=True)}
    wrapped = [by_id[id(fun)] for fun in branches]
    out, state = call(lower, selector, wrapped, (loop_state(carry_params), operands))
    _finish(wrappers.thread, state)
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
    threaded = functools.partial(_threaded_cond, lower)
    return init_once(
        lambda: threaded(pred, true_fun, false_fun, *operands, **keywords),
        lambda: plain.init_safe_cond(
            pred, true_fun, false_fun, *operands, **keywords, default_cond=threaded, **_HOOKS
        ),
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
    threaded = functools.partial(_threaded_switch, lower)
    return init_once(
        lambda: threaded(index, branches, *operands, **keywords),
        lambda: plain.init_safe_switch(
            index, branches, *operands, **keywords, default_switch=threaded, **_HOOKS
        ),
    )


# -- map -------------------------------------------------------------------------------


_map_steps: weakref.WeakKeyDictionary[Any, dict[bool, Callable[..., Any]]] = (
    weakref.WeakKeyDictionary()
)


def _map_step(f: Callable[..., Any], batched: bool) -> Callable[..., Any]:
    """The scan body of ``map(f)``, one per function (held weakly), so scan can reuse it."""

    def step_of(get: Callable[[], Any]) -> Callable[..., Any]:
        def step(_: Any, x: Any) -> Any:
            function = get()
            return (), (jo.vmap(function) if batched else function)(x)

        return step

    try:
        steps = _map_steps.setdefault(f, {})
        ref = weakref.ref(f)
    except TypeError:
        return step_of(lambda: f)
    step = steps.get(batched)
    if step is None:
        step = steps[batched] = step_of(ref)
    return step


def lax_map(f: Callable[..., Any], xs: Any, *, batch_size: int | None = None) -> Any:
    """``lax.map`` as JAX writes it, in terms of the neutral ``scan`` and ``vmap``.

    JAX's map has no carry to thread state through; like ``hk.map``, this one is a scan
    (each element sees the state the previous one left), and with ``batch_size`` a scan
    of ``vmap``s (state is shared across a batch, as in ``jaxoverride.vmap``).
    """
    lower = jo.next_impl("lax.map")
    if not state_usable():
        return lower(f, xs, batch_size=batch_size)
    if batch_size is None:
        _, ys = jlax.scan(_map_step(f, batched=False), (), xs)
        return ys
    blocks = lambda xs: jlax.scan(_map_step(f, batched=True), (), xs)[1]
    return kit.batched_map(blocks, jo.vmap(f), xs, batch_size)
