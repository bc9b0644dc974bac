"""``jaxoverride.solve_state`` for NNX: what each tracked Variable is, and the adapter's
own boundaries' use of the kit's ``Participant``.

A Variable's parts (``parts_of``): an ``nnx.RngState`` is an rng position named by its
stream (``"dropout"``); an ``nnx.Param`` is untouched; any other Variable is state named
by the Variable types in its MRO (``"BatchStat"``, ``"Variable"``). A slot is the
Variable's identity and the leaf's position, whichever Variables a state holds.

The kit's ``Threaded`` applies the declaration to the control-flow calls; the other
boundaries call ``run_lifted`` with ``policy`` and ``written`` on what they write.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import jax
from flax import nnx

from jaxoverride import adapter_kit as kit
from jaxoverride.adapter_kit import Participant, StatePart
from jaxoverride_nnx._graph import RAW
from jaxoverride_nnx._probes import is_probe
from jaxoverride_nnx._tracked import Tracked, current
from jaxoverride_nnx._write import write_back

FRAMEWORK = "nnx"


def _part(variable: Any, slot: Any) -> StatePart | None:
    if isinstance(variable, nnx.Param):
        return None
    if isinstance(variable, nnx.RngState):
        tag = variable.get_metadata().get("tag")
        return StatePart("rng", () if tag is None else (str(tag),), slot)
    names = tuple(k.__name__ for k in type(variable).__mro__ if issubclass(k, nnx.Variable))
    return StatePart("state", names, slot)


def parts_of(tracked: Tracked, values: Mapping[int, Any]) -> list[StatePart | None]:
    """The parts of ``values`` (``{index: value}`` of ``tracked``'s values, as JAX
    flattens a dict: by sorted index), one per leaf; array attributes are untouched."""
    variables = tracked.variables
    count = len(variables)
    parts: list[StatePart | None] = []
    for index in sorted(values):
        leaves = jax.tree_util.tree_leaves(values[index])
        if index >= count:
            parts += [None] * len(leaves)
            continue
        variable = variables[index]
        parts += [_part(variable, (id(variable), k)) for k in range(len(leaves))]
    return parts


def stateful(tracked: Tracked) -> list[int]:
    """The indices of ``tracked``'s Variables that are state or rng (not Params)."""
    return [i for i, v in enumerate(tracked.variables) if _part(v, None) is not None]


class Values:
    """A state source over ``{index: value}`` of a tracked set: every tracked Variable
    for the declaration's snapshot and exit, and ``parts`` for the adapter's boundaries.

    Args:
      tracked: the tracked set the indices refer to.
    """

    framework: ClassVar[str | None] = FRAMEWORK
    __slots__ = ("tracked",)

    def __init__(self, tracked: Tracked):
        self.tracked = tracked

    def read(self) -> dict[int, Any]:
        """Every tracked Variable's value, by index; inside a traced function, those it
        was given (a Variable it was not holds a probe: using it retraces with it given)."""
        values = enumerate(map(RAW.__get__, self.tracked.variables))
        return {i: v for i, v in values if not any(map(is_probe, jax.tree.leaves(v)))}

    def write(self, state: Mapping[int, Any]) -> None:
        """Stores the values of ``state`` that are not the Variables' values already."""
        variables = self.tracked.variables
        changed = {i: v for i, v in state.items() if RAW.__get__(variables[i]) is not v}
        write_back(self.tracked, changed, "jaxoverride.solve_state")

    def parts(self, state: Mapping[int, Any]) -> list[StatePart | None]:
        """See ``parts_of``."""
        return parts_of(self.tracked, state)

    def initializing(self) -> bool:
        """Never: NNX creates its Variables before a solve."""
        return False


def _running() -> Values | None:
    """The solve source of the code running now: the tracked set, if any."""
    tracked = current()
    return None if tracked is None else Values(tracked)


def policy_for(tracked: Tracked) -> Participant | None:
    """The declaration's participant for a call on ``tracked`` now, or None."""
    return kit.participant(Values(tracked))


def frozen_key(policy: Participant, tracked: Tracked) -> tuple[str, tuple[int, ...]]:
    """A cache key for a trace made under ``policy``: which tracked Variables it freezes
    (a trace never holds the frozen values themselves: see ``entering``'s ``rebase``)."""
    frozen = policy.frozen
    return "solve_state", tuple(i for i, v in enumerate(tracked.variables) if (id(v), 0) in frozen)


def frozen_values(
    policy: Participant, tracked: Tracked, order: Sequence[int], values: Sequence[Any]
) -> list[Any]:
    """``values`` (of the tracked values ``order``) with the frozen parts as at entry."""
    state = policy.freeze(dict(zip(order, values, strict=True)))
    return [state[i] for i in order]


def declared_values(
    policy: Participant, tracked: Tracked, order: Sequence[int], values: Sequence[Any]
) -> tuple[list[Any], list[Any] | None]:
    """What a cached trace (``jit``) is handed under a declaration: ``values`` (of the
    tracked values ``order``) frozen, and what the evaluations before the call left
    (``Participant.current``), both as arguments, so nothing of the caller is baked in.

    The latter is None where it is the frozen values themselves: the trace tells writes
    by identity with its inputs, and the same values handed twice would make a function
    that only carries them look like one that wrote the entry state (diffrax's adjoint).
    """
    state = dict(zip(order, values, strict=True))
    received = policy.current(state)
    frozen = frozen_values(policy, tracked, order, values)
    passed = [received[i] for i in order]
    if all(a is b for a, b in zip(passed, frozen, strict=True)):
        return frozen, None
    return frozen, passed


def entering(
    policy: Participant,
    tracked: Tracked,
    values: Mapping[int, Any],
    rebase: bool,
    received: Mapping[int, Any],
) -> tuple[dict[int, Any], Any]:
    """``values`` frozen, and the frame pushed for the traced function that receives them.

    ``rebase``: a cached trace (``jit``), whose inputs were frozen at the call's read and
    are the frozen parts inside it. ``received``: what the evaluations before the call
    left, which a function that evaluates nothing passes on.
    """
    if rebase:
        return dict(values), policy.push(values, received=dict(received))
    return policy.freeze(dict(values)), policy.push(received=dict(received))


def leaving(
    policy: Participant, frame: Any, after: Sequence[Any], indices: Sequence[int]
) -> list[Any]:
    """``after`` with the declaration's values for ``indices`` (those the function was
    handed: ``Participant.left``)."""
    policy.pop(frame)
    left = policy.left({i: after[i] for i in indices}, frame)
    out = list(after)
    for index, value in left.items():
        out[index] = value
    return out


def written(
    policy: Participant | None, tracked: Tracked, updates: dict[int, Any]
) -> dict[int, Any]:
    """What to write for a JAX call that left ``updates`` (``{index: value}``): the
    frozen parts as at entry again (the state kept as the boundary's last)."""
    if policy is None:
        return updates
    now = list(map(RAW.__get__, tracked.variables))
    state = policy.current(dict(enumerate(now)))
    state.update(updates)
    out = policy.written(state)
    return {i: v for i, v in out.items() if v is not now[i]}


def discarded(policy: Participant | None) -> contextlib.AbstractContextManager[None]:
    """A boundary of its own (``Participant.discarded``) under a declaration: what a
    boundary inside keeps as its last stays in it, never reaches the caller."""
    return contextlib.nullcontext() if policy is None else policy.discarded()


kit.register_solve_source(FRAMEWORK, _running)
