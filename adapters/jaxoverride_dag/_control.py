"""``lax.scan``, ``while_loop``, ``fori_loop``, ``cond``, ``switch`` and ``map``.

Carries, operands and per-iteration inputs are encoded, and the body sees fresh objects
with the same sharing. A carry's sharing pattern (and its static data) must be the same
after the body as before it, and every branch must return the same pattern: otherwise a
``SharingError`` names the first position that differs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax

import jaxoverride as jo
from jaxoverride_dag._errors import SharingError, pattern_mismatch
from jaxoverride_dag._out import Packed, unforward, unforward_tree
from jaxoverride_dag._plan import Plan, encode

_NO_OPERAND: Any = inspect.signature(jax.lax.cond).parameters["operand"].default

_CARRY_FIX = (
    "Fix: return a carry whose objects are shared exactly as in the initial value, for "
    "example by updating the shared node in place or by building it once and placing it at "
    "every position; to change sharing, do it before or after the loop."
)
_BRANCH_FIX = (
    "Fix: make every branch return the same objects shared at the same positions, with the "
    "same static (non-array) values."
)


def _carry_out(api: str, plan: Plan, before: Any, after: Any) -> tuple[Any, ...]:
    after_plan, after_dyn = encode(after, f"{api} carry")
    if after_plan != plan:
        raise pattern_mismatch(
            api,
            "carry",
            before,
            after,
            before_name="the initial carry",
            after_name="the carry the body returns",
            fix=_CARRY_FIX,
        )
    return tuple(after_dyn)


def dag_scan(
    f: Callable[[Any, Any], tuple[Any, Any]],
    init: Any,
    xs: Any = None,
    length: int | None = None,
    reverse: bool = False,
    unroll: int | bool = 1,
    _split_transpose: bool = False,
) -> tuple[Any, Any]:
    """The ``"lax.scan"`` override: ``jax.lax.scan``'s signature."""
    lower = jo.next_impl("lax.scan")
    carry_plan, carry_dyn = encode(init, "scan carry")
    xs_plan, xs_dyn = encode(xs, "scan xs")

    def body(carry: tuple[Any, ...], x: tuple[Any, ...]) -> tuple[tuple[Any, ...], Packed]:
        out = f(carry_plan.decode_inside(carry), xs_plan.decode_inside(x))
        if not isinstance(out, tuple) or len(out) != 2:
            raise TypeError(
                "jaxoverride_dag.lax.scan: the body must return a pair (carry, y), got "
                f"{type(out).__name__}."
            )
        new_carry, y = out
        y_plan, y_dyn = encode(y, "scan outputs")
        return _carry_out("lax.scan", carry_plan, init, new_carry), Packed(tuple(y_dyn), y_plan)

    carry, ys = lower(
        body, tuple(carry_dyn), tuple(xs_dyn), length, reverse, unroll, _split_transpose
    )
    inputs = [*carry_dyn, *xs_dyn]
    return carry_plan.decode(unforward(carry, inputs)), unforward_tree(ys, inputs).unpack()


def dag_while_loop(
    cond_fun: Callable[[Any], Any], body_fun: Callable[[Any], Any], init_val: Any
) -> Any:
    """The ``"lax.while_loop"`` override: ``jax.lax.while_loop``'s signature."""
    lower = jo.next_impl("lax.while_loop")
    plan, dyn = encode(init_val, "while_loop carry")

    def cond(carry: tuple[Any, ...]) -> Any:
        return cond_fun(plan.decode_inside(carry))

    def body(carry: tuple[Any, ...]) -> tuple[Any, ...]:
        return _carry_out("lax.while_loop", plan, init_val, body_fun(plan.decode_inside(carry)))

    return plan.decode(unforward(lower(cond, body, tuple(dyn)), dyn))


def dag_fori_loop(
    lower: Any,
    upper: Any,
    body_fun: Callable[[Any, Any], Any],
    init_val: Any,
    *,
    unroll: int | bool | None = None,
) -> Any:
    """The ``"lax.fori_loop"`` override: ``jax.lax.fori_loop``'s signature."""
    below = jo.next_impl("lax.fori_loop")
    plan, dyn = encode(init_val, "fori_loop carry")

    def body(i: Any, carry: tuple[Any, ...]) -> tuple[Any, ...]:
        return _carry_out("lax.fori_loop", plan, init_val, body_fun(i, plan.decode_inside(carry)))

    return plan.decode(unforward(below(lower, upper, body, tuple(dyn), unroll=unroll), dyn))


class _Branches:
    """Wraps branches so that each decodes the operands and all return one pattern."""

    __slots__ = ("api", "first", "plan")

    def __init__(self, api: str, plan: Plan):
        self.api = api
        self.plan = plan
        self.first: tuple[Plan, Any] | None = None

    def wrap(self, branch: Callable[..., Any]) -> Callable[..., Packed]:
        def wrapped(*operands: Any) -> Packed:
            out = branch(*self.plan.decode_inside(operands))
            out_plan, out_dyn = encode(out, f"{self.api} outputs")
            if self.first is None:
                self.first = (out_plan, out)
            elif out_plan != self.first[0]:
                raise pattern_mismatch(
                    self.api,
                    "output",
                    self.first[1],
                    out,
                    before_name="one branch",
                    after_name="another",
                    fix=_BRANCH_FIX,
                )
            return Packed(tuple(out_dyn), out_plan)

        return wrapped


def _operands(api: str, operands: tuple[Any, ...], operand: Any) -> tuple[Any, ...]:
    if operand is _NO_OPERAND:
        return operands
    if operands:
        raise TypeError(
            f"jaxoverride_dag.{api}: pass operands positionally or with the "
            "operand= keyword, not both."
        )
    return (operand,)


def dag_cond(
    pred: Any,
    true_fun: Callable[..., Any],
    false_fun: Callable[..., Any],
    *operands: Any,
    operand: Any = _NO_OPERAND,
) -> Any:
    """The ``"lax.cond"`` override: ``jax.lax.cond``'s signature."""
    lower = jo.next_impl("lax.cond")
    plan, dyn = encode(_operands("lax.cond", operands, operand), "cond operands")
    branches = _Branches("lax.cond", plan)
    out = lower(pred, branches.wrap(true_fun), branches.wrap(false_fun), *dyn)
    return unforward_tree(out, dyn).unpack()


def dag_switch(
    index: Any, branches: Sequence[Callable[..., Any]], *operands: Any, operand: Any = _NO_OPERAND
) -> Any:
    """The ``"lax.switch"`` override: ``jax.lax.switch``'s signature."""
    lower = jo.next_impl("lax.switch")
    plan, dyn = encode(_operands("lax.switch", operands, operand), "switch operands")
    wrapper = _Branches("lax.switch", plan)
    out = lower(index, [wrapper.wrap(branch) for branch in branches], *dyn)
    return unforward_tree(out, dyn).unpack()


def dag_map(f: Callable[[Any], Any], xs: Any, *, batch_size: int | None = None) -> Any:
    """The ``"lax.map"`` override: ``jax.lax.map``'s signature."""
    lower = jo.next_impl("lax.map")
    plan, dyn = encode(xs, "map xs")

    def body(x: tuple[Any, ...]) -> Packed:
        out_plan, out_dyn = encode(f(plan.decode_inside(x)), "map outputs")
        return Packed(tuple(out_dyn), out_plan)

    return unforward_tree(lower(body, tuple(dyn), batch_size=batch_size), dyn).unpack()


__all__ = [
    "SharingError",
    "dag_cond",
    "dag_fori_loop",
    "dag_map",
    "dag_scan",
    "dag_switch",
    "dag_while_loop",
]
