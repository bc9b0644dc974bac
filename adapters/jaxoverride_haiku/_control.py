"""Overrides of the neutral control flow: Haiku state threaded through, and init-exact.

Each override hands JAX (or the next override below) the *threaded* loop: the Haiku
state and rng in the carry, exactly as ``hk.scan`` & co. carry them. Outside a
transform, or where Haiku state is unusable, each override is the implementation below
it, untouched.

At init the loop is traced once, as at apply, and a parameter that a body or branch
creates is made at the call's site (``_site``): outside the trace, under the name Haiku
gives it there, so that init returns what apply returns and a loop that runs zero times
has still created its parameters. Only where a body creates Haiku *state* (which would
change the carry) does init fall back to the kit's creation pass (``init_safe_*``) first.

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
from jaxoverride import adapter_kit as kit, lax as jlax
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


def _threaded_fori(lower: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    lower_bound, upper_bound, body_fun, init_val, unroll = kit.jax_arguments(
        "lax.fori_loop", *args, **kwargs
    )
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
    distinct = kit.distinct_functions(branches)
    carry_params = not creating_site()
    wrappers = _wrappers(where, distinct, _branches_build(carry_params))
    by_id = {id(fun): handed for fun, handed in zip(distinct, wrappers.functions, strict=True)}
    wrapped = [by_id[id(fun)] for fun in branches]
    out, state = call(lower, selector, wrapped, (loop_state(carry_params), operands))
    _finish(wrappers.thread, state)
    return out


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


def _lax_map(
    lower: Callable[..., Any], f: Callable[..., Any], xs: Any, *, batch_size: int | None
) -> Any:
    """``lax.map`` as JAX writes it, in terms of the neutral ``scan`` and ``vmap``.

    JAX's map has no carry to thread state through; like ``hk.map``, this one is a scan
    (each element sees the state the previous one left), and with ``batch_size`` a scan
    of ``vmap``s (state is shared across a batch, as in ``jaxoverride.vmap``).
    """
    del lower
    if batch_size is None:
        _, ys = jlax.scan(_map_step(f, batched=False), (), xs)
        return ys
    blocks = lambda xs: jlax.scan(_map_step(f, batched=True), (), xs)[1]
    return kit.batched_map(blocks, jo.vmap(f), xs, batch_size)


def _init_exact(
    threaded: Callable[..., Any], init_safe: Callable[..., Any], default: str
) -> Callable[..., Any]:
    """``threaded`` (given ``lower`` first) at apply and at init where the site creates the
    parameters; else the kit's ``init_safe`` combinator around it, with Haiku's hooks."""

    def run(lower: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        below = functools.partial(threaded, lower)
        return init_once(
            lambda: below(*args, **kwargs),
            lambda: init_safe(*args, **kwargs, **{default: below}, **_HOOKS),
        )

    return run


def _threaded_cond(
    lower: Callable[..., Any],
    pred: Any,
    true_fun: Callable[..., Any],
    false_fun: Callable[..., Any],
    *operands: Any,
) -> Any:
    return _threaded_branches(
        lower,
        "jaxoverride.lax.cond",
        pred,
        (true_fun, false_fun),
        operands,
        lambda lower, pred, fns, packed: lower(pred, fns[0], fns[1], packed),
    )


def _threaded_switch(
    lower: Callable[..., Any], index: Any, branches: Sequence[Callable[..., Any]], *operands: Any
) -> Any:
    return _threaded_branches(
        lower,
        "jaxoverride.lax.switch",
        index,
        tuple(branches),
        operands,
        lambda lower, index, fns, packed: lower(index, fns, packed),
    )


OVERRIDES: dict[str, Callable[..., Any]] = kit.control_flow_overrides(
    state_usable,
    scan=_init_exact(_threaded_scan, kit.init_safe_scan, "default_scan"),
    while_loop=_init_exact(_threaded_while, kit.init_safe_while_loop, "default_while_loop"),
    fori_loop=_init_exact(_threaded_fori, kit.init_safe_fori_loop, "default_fori_loop"),
    cond=_init_exact(_threaded_cond, kit.init_safe_cond, "default_cond"),
    switch=_init_exact(_threaded_switch, kit.init_safe_switch, "default_switch"),
    lax_map=_lax_map,
    module=__name__,
)
"""Neutral name -> Haiku override, for the control flow."""
