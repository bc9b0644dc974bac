"""``lax.scan``, ``while_loop``, ``fori_loop``, ``cond``, ``switch`` and ``map``.

The body sees fresh objects shared as the caller's were. Where *array* sharing differs
between a carry and the body's result, or between branches, the arrays are de-shared and
the call traced again; a difference in node sharing or static data is a ``SharingError``.
Bad input gets JAX's own error; the functions handed to JAX are cached (``_handoff``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

import jaxoverride as jo
from jaxoverride.adapter_kit import (
    NO_OPERAND as _NO_OPERAND,
    jax_arguments,
    scan_arguments,
)
from jaxoverride_dag._errors import SharingError, pattern_mismatch
from jaxoverride_dag._handoff import (
    MAX_PER_FUNCTION,
    MismatchError,
    RetryError,
    cached,
    call_user,
    from_user,
    raise_as_jax,
    raise_handoff_error,
)
from jaxoverride_dag._out import Packed, unforward, unforward_tree
from jaxoverride_dag._plan import Plan, encode
from jaxoverride_dag._reshare import meet, rebase, refines, same_form

_CARRY_FIX = (
    "Fix: return a carry whose nodes are shared exactly as in the initial value, for "
    "example by updating the shared node in place or by building it once and placing it at "
    "every position, with the same static (non-array) values; to change sharing, do it "
    "before or after the loop."
)
_BRANCH_FIX = (
    "Fix: make every branch return the same nodes shared at the same positions, with the "
    "same static (non-array) values."
)


def _markers(plan: Plan) -> Any:
    """A tree of ``plan``'s pattern, for error messages: one marker per distinct array."""
    return plan.decode([jax.ShapeDtypeStruct((), jnp.float32) for _ in range(plan.n_dyn)])


def _pack_carry(api: str, plan: Plan, new_carry: Any) -> tuple[Any, ...]:
    """The traced leaves of the carry a body returned, laid out as ``plan``."""
    out_plan, out_dyn = encode(new_carry, f"{api} carry")
    if out_plan == plan:
        return tuple(out_dyn)
    if same_form(out_plan, plan):
        if refines(plan, out_plan):  # the body shares more: pass the array once per slot
            return tuple(rebase(out_dyn, out_plan, plan))
        raise RetryError(meet(plan, out_plan))
    raise MismatchError(
        pattern_mismatch(
            api,
            "carry",
            _markers(plan),
            new_carry,
            before_name="the initial carry",
            after_name="the carry the body returns",
            fix=_CARRY_FIX,
            arrays=False,
        )
    )


def _drive(run: Callable[[Plan], Any], plan: Plan, raw: Callable[[], Any]) -> tuple[Any, Plan]:
    """``run(plan)``, again with fewer shared arrays while the body asks for it (each
    retry splits a group, so there are at most ``n_dyn``)."""
    while True:
        try:
            return run(plan), plan
        except RetryError as retry:
            if retry.plan == plan:  # pragma: no cover - meet always splits a group
                raise RuntimeError("jaxoverride_dag: carry layout did not converge") from None
            plan = retry.plan
        except (MismatchError, TypeError, ValueError) as error:
            raise_handoff_error(raw, error)


def _nothing_to_map(plan: Plan, dyn: Sequence[Any]) -> bool:
    """Whether ``xs`` holds only static data (``"abc"``, a generator): JAX's error then."""
    return not dyn and bool(plan.statics)


def dag_scan(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """The ``"lax.scan"`` override: ``jax.lax.scan``'s arguments (``scan_arguments``).

    The body sees the carry and each slice of ``xs`` as fresh objects, shared as the
    caller's were; ``ys`` come back with the sharing the body gave them.
    """
    f, init, xs, length, reverse, unroll, _split_transpose = scan_arguments(*args, **kwargs)
    below = jo.next_impl("lax.scan")
    if not callable(f):  # JAX's own error
        return below(f, init, xs, length, reverse, unroll, _split_transpose)
    init_plan, init_dyn = encode(init, "scan carry")
    xs_plan, xs_dyn = encode(xs, "scan xs")
    if _nothing_to_map(xs_plan, xs_dyn) and length is None:  # JAX's error about xs
        return below(f, init, xs, length, reverse, unroll, _split_transpose)

    def run(plan: Plan) -> Any:
        body = cached(f, ("lax.scan", plan, xs_plan), lambda get: _scan_body(get, plan, xs_plan))
        carry = tuple(rebase(init_dyn, init_plan, plan))
        return below(body, carry, tuple(xs_dyn), length, reverse, unroll, _split_transpose)

    def raw() -> Any:
        return below(f, init, xs, length, reverse, unroll, _split_transpose)

    (carry, ys), plan = _drive(run, init_plan, raw)
    inputs = [*init_dyn, *xs_dyn]
    return plan.decode(unforward(carry, inputs)), unforward_tree(ys, inputs).unpack()


def _scan_body(get: Callable[[], Any], plan: Plan, xs_plan: Plan) -> Callable[..., Any]:
    def body(carry: tuple[Any, ...], x: tuple[Any, ...]) -> tuple[tuple[Any, ...], Packed]:
        out = call_user(get(), plan.decode_inside(carry), xs_plan.decode_inside(x))
        if not isinstance(out, tuple) or len(out) != 2:
            raise MismatchError(  # raw JAX says "scan body output must be a pair"
                SharingError(
                    "jaxoverride_dag.lax.scan: the body must return a pair (carry, y), got "
                    f"{type(out).__name__}."
                )
            )
        new_carry, y = out
        y_plan, y_dyn = encode(y, "scan outputs")
        return _pack_carry("lax.scan", plan, new_carry), Packed(tuple(y_dyn), y_plan)

    return body


def dag_while_loop(
    cond_fun: Callable[[Any], Any], body_fun: Callable[[Any], Any], init_val: Any
) -> Any:
    """The ``"lax.while_loop"`` override: ``jax.lax.while_loop``'s signature."""
    below = jo.next_impl("lax.while_loop")
    if not (callable(cond_fun) and callable(body_fun)):  # JAX's own error
        return below(cond_fun, body_fun, init_val)
    init_plan, init_dyn = encode(init_val, "while_loop carry")

    def run(plan: Plan) -> Any:
        cond = cached(cond_fun, ("lax.while_loop cond", plan), lambda get: _while_cond(get, plan))
        body = cached(body_fun, ("lax.while_loop", plan), lambda get: _while_body(get, plan))
        return below(cond, body, tuple(rebase(init_dyn, init_plan, plan)))

    out, plan = _drive(run, init_plan, lambda: below(cond_fun, body_fun, init_val))
    return plan.decode(unforward(out, init_dyn))


def _while_cond(get: Callable[[], Any], plan: Plan) -> Callable[..., Any]:
    def cond(carry: tuple[Any, ...]) -> Any:
        return call_user(get(), plan.decode_inside(carry))

    return cond


def _while_body(get: Callable[[], Any], plan: Plan) -> Callable[..., Any]:
    def body(carry: tuple[Any, ...]) -> tuple[Any, ...]:
        return _pack_carry("lax.while_loop", plan, call_user(get(), plan.decode_inside(carry)))

    return body


def dag_fori_loop(*args: Any, **kwargs: Any) -> Any:
    """The ``"lax.fori_loop"`` override: ``jax.lax.fori_loop``'s arguments; the body sees
    the carry as fresh objects, shared as the caller's were."""
    lower, upper, body_fun, init_val, unroll = jax_arguments("lax.fori_loop", *args, **kwargs)
    below = jo.next_impl("lax.fori_loop")
    if not callable(body_fun):  # JAX's own error
        return below(*args, **kwargs)
    init_plan, init_dyn = encode(init_val, "fori_loop carry")

    def run(plan: Plan) -> Any:
        body = cached(body_fun, ("lax.fori_loop", plan), lambda get: _fori_body(get, plan))
        carry = tuple(rebase(init_dyn, init_plan, plan))
        return below(lower, upper, body, carry, unroll=unroll)

    def raw() -> Any:
        return below(lower, upper, body_fun, init_val, unroll=unroll)

    out, plan = _drive(run, init_plan, raw)
    return plan.decode(unforward(out, init_dyn))


def _fori_body(get: Callable[[], Any], plan: Plan) -> Callable[..., Any]:
    def body(i: Any, carry: tuple[Any, ...]) -> tuple[Any, ...]:
        return _pack_carry("lax.fori_loop", plan, call_user(get(), i, plan.decode_inside(carry)))

    return body


def _branch(
    get: Callable[[], Any], api: str, plan: Plan, target: Plan | None
) -> Callable[..., Packed]:
    """A branch that decodes the operands and packs its output (as ``target`` if given),
    recording its output plan per operand types for ``_common_plan``."""
    seen: dict[Any, Plan] = {}

    def branch(*operands: Any) -> Packed:
        out = call_user(get(), *plan.decode_inside(operands))
        out_plan, out_dyn = encode(out, f"{api} outputs")
        if len(seen) >= MAX_PER_FUNCTION:
            seen.clear()
        seen[_types(operands)] = out_plan
        if target is None or out_plan == target:
            return Packed(tuple(out_dyn), out_plan)
        if same_form(out_plan, target):
            if refines(target, out_plan):
                return Packed(tuple(rebase(out_dyn, out_plan, target)), target)
            raise RetryError(meet(target, out_plan))
        raise MismatchError(_branch_error(api, target, out_plan))

    branch.seen = seen  # type: ignore[attr-defined]
    return branch


def _types(values: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(jax.typeof(value) for value in values)


def _branch_error(api: str, one: Plan, other: Plan) -> SharingError:
    return pattern_mismatch(
        api,
        "output",
        _markers(one),
        _markers(other),
        before_name="one branch",
        after_name="another",
        fix=_BRANCH_FIX,
        arrays=False,
    )


def _run_branches(
    api: str,
    branches: Sequence[Callable[..., Any]],
    plan: Plan,
    dyn: Sequence[Any],
    call: Callable[[list[Callable[..., Packed]]], Any],
    raw: Callable[[], Any],
) -> Any:
    """``call(wrapped branches)``; if their outputs share arrays differently, again with
    every branch laid out as the plan they have in common."""
    target: Plan | None = None
    while True:
        wrapped = [
            cached(b, (api, plan, target), lambda get, t=target: _branch(get, api, plan, t))
            for b in branches
        ]
        try:
            return unforward_tree(call(wrapped), dyn).unpack()
        except RetryError as retry:
            target = retry.plan
        except (MismatchError, TypeError, ValueError) as error:
            if isinstance(error, MismatchError) or from_user(error):
                raise_handoff_error(raw, error)
            found = None if target is not None else _common_plan(api, wrapped, dyn)
            if not isinstance(found, Plan):
                raise_as_jax(raw, error if found is None else found)
                raise  # pragma: no cover - _raise_as_jax always raises
            target = found


def _common_plan(
    api: str, wrapped: Sequence[Callable[..., Packed]], dyn: Sequence[Any]
) -> Plan | SharingError | None:
    """The plan that every branch's output refines, if they differ only in array sharing;
    the error if they differ in more; ``None`` if that is not why JAX refused them."""
    try:
        key = _types(dyn)
    except Exception:
        return None
    found = [getattr(w, "seen", {}).get(key) for w in wrapped]
    plans: list[Plan] = [p for p in found if isinstance(p, Plan)]
    if not plans or len(plans) != len(found):
        return None
    common = plans[0]
    for other in plans[1:]:
        if not same_form(common, other):
            return _branch_error(api, common, other)
        common = meet(common, other)
    return None if all(p == common for p in plans) else common


def dag_cond(*args: Any, **kwargs: Any) -> Any:
    """The ``"lax.cond"`` override: ``jax.lax.cond``'s arguments (``jax_arguments``)."""
    pred, true_fun, false_fun, operands, operand = jax_arguments("lax.cond", *args, **kwargs)
    below = jo.next_impl("lax.cond")
    given = operands if operand is _NO_OPERAND else (*operands, operand)
    both = bool(operands) and operand is not _NO_OPERAND
    if not (callable(true_fun) and callable(false_fun)) or both:
        # Non-callable branches (or JAX's deprecated form), or both kinds of operands:
        # JAX's own behaviour and errors.
        return below(*args, **kwargs)
    plan, dyn = encode(given, "cond operands")
    return _run_branches(
        "lax.cond",
        (true_fun, false_fun),
        plan,
        dyn,
        lambda wrapped: below(pred, *wrapped, *dyn),
        lambda: below(pred, true_fun, false_fun, *given),
    )


def dag_switch(*args: Any, **kwargs: Any) -> Any:
    """The ``"lax.switch"`` override: ``jax.lax.switch``'s arguments (``jax_arguments``)."""
    index, branches, operands, operand = jax_arguments("lax.switch", *args, **kwargs)
    below = jo.next_impl("lax.switch")
    given = operands if operand is _NO_OPERAND else (*operands, operand)
    both = bool(operands) and operand is not _NO_OPERAND
    if (
        not isinstance(branches, Sequence)
        or not all(callable(branch) for branch in branches)
        or both
    ):  # JAX's own behaviour and errors
        return below(*args, **kwargs)
    plan, dyn = encode(given, "switch operands")
    return _run_branches(
        "lax.switch",
        branches,
        plan,
        dyn,
        lambda wrapped: below(index, wrapped, *dyn),
        lambda: below(index, branches, *given),
    )


def dag_map(f: Callable[[Any], Any], xs: Any, *, batch_size: int | None = None) -> Any:
    """The ``"lax.map"`` override: ``jax.lax.map``'s signature."""
    below = jo.next_impl("lax.map")
    if not callable(f):  # JAX's own error
        return below(f, xs, batch_size=batch_size)
    plan, dyn = encode(xs, "map xs")
    if _nothing_to_map(plan, dyn):  # JAX's error about xs
        return below(f, xs, batch_size=batch_size)
    body = cached(f, ("lax.map", plan), lambda get: _map_body(get, plan))
    try:
        out = below(body, tuple(dyn), batch_size=batch_size)
    except (TypeError, ValueError) as error:
        raise_handoff_error(lambda: below(f, xs, batch_size=batch_size), error)
    return unforward_tree(out, dyn).unpack()


def _map_body(get: Callable[[], Any], plan: Plan) -> Callable[..., Packed]:
    def body(x: tuple[Any, ...]) -> Packed:
        out_plan, out_dyn = encode(call_user(get(), plan.decode_inside(x)), "map outputs")
        return Packed(tuple(out_dyn), out_plan)

    return body


__all__ = [
    "SharingError",
    "dag_cond",
    "dag_fori_loop",
    "dag_map",
    "dag_scan",
    "dag_switch",
    "dag_while_loop",
]
