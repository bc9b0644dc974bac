"""Haiku's frame as a kit ``StateSource``: the control flow's state, threaded by the kit.

The kit carries what ``read()`` returns: the frame's state and rng (as ``hk.scan`` does),
and the params where the functions handed to JAX are reused across calls (a closed-over
value would be baked into JAX's cached trace); params are not written back. Optional
parts of the kit's contract: ``reuse_key()``, ``init_call`` (``_site.init_once``) and
``abort_changed_predicate``.

``leave`` copies a traced function's naming counters back, with the submodules each trace
registered: ``restore_names`` registers them again, since ``params_dict()`` must list them
on a cache hit, where nothing is traced.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Hashable
from typing import Any, ClassVar, NamedTuple

import jax
from haiku._src import base

from jaxoverride import adapter_kit as kit
from jaxoverride_haiku._creation import create
from jaxoverride_haiku._frames import (
    InternalState,
    Names,
    added_submodules,
    check_same_state,
    current_frame,
    initializing,
    loop_state,
    naming_signature,
    new_parameters_error,
    register_submodules,
    state_names,
    submodule_sets,
)
from jaxoverride_haiku._jit import customisations
from jaxoverride_haiku._rng import temporary_state, update_state
from jaxoverride_haiku._site import current_site, init_once

Added = tuple[frozenset[str], ...]
"""Per level of the module stack, the submodule names that traces registered there."""


class Naming(NamedTuple):
    """What ``HaikuSource.names()`` records: the frame's naming state and the submodules
    registered by the traces so far."""

    names: Names
    added: Added


def _union(a: Added, b: Added) -> Added:
    longer, shorter = (a, b) if len(a) >= len(b) else (b, a)
    return tuple(n | shorter[i] if i < len(shorter) else n for i, n in enumerate(longer))


def _check(where: str, before: InternalState, after: InternalState) -> InternalState:
    """``after``, checked to hold the state entries of ``before``. At init, state created
    inside the body is left out instead (the trace completes: an aborted one keeps tracers
    alive), and the site records it, for the outermost call to start again."""
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


class _Entered(NamedTuple):
    exits: contextlib.ExitStack
    outer: base.Frame
    inner: base.Frame
    state: InternalState
    params_before: Any
    submodules: list[set[str] | None]


class HaikuSource(kit.EnterLeaveSource):
    """The kit's ``StateSource`` over the current Haiku frame, for one neutral call.

    Args:
      where: the neutral name, for error messages.
    """

    abort_changed_predicate = True
    framework: ClassVar[str | None] = "haiku"  # the key ``jaxoverride.solve_state`` knows it by
    __slots__ = ("_added", "_restored", "where")

    def __init__(self, where: str):
        self.where = where
        self._restored: Naming | None = None  # the naming the last traced function began from
        self._added: Added = ()  # what the traced function that just left registered

    @staticmethod
    def _carry_params() -> bool:
        # Inside a site (init) functions are traced once and params are closed over, as
        # Haiku's own loops do; elsewhere they are reused, and params ride in the carry.
        return current_site() is None

    def read(self) -> InternalState:
        return loop_state(self._carry_params())

    def parts(self, state: InternalState) -> list[kit.StatePart | None]:
        return state_parts(state)

    def enter(self, state: InternalState) -> _Entered:
        outer = current_frame()
        exits = contextlib.ExitStack()
        exits.enter_context(temporary_state(state))
        exits.enter_context(base.push_jax_trace_level())
        inner = current_frame()
        params_before = base.param_names() if self._carry_params() else None
        submodules = submodule_sets(inner)
        return _Entered(exits, outer, inner, state, params_before, submodules)

    def leave(self, token: _Entered) -> InternalState:
        with token.exits:
            after = loop_state(self._carry_params())
            if token.params_before is not None:
                created = base.param_names() - token.params_before
                if created:
                    raise new_parameters_error(self.where, created)
            Names.capture(token.inner).restore_into(token.outer)
            added = added_submodules(token.submodules, token.inner)
            self._added = tuple(map(frozenset, added))
        return _check(self.where, token.state, after)

    def abandon(self, token: _Entered) -> None:
        token.exits.close()

    def write(self, state: InternalState) -> None:
        update_state(state._replace(params=None))

    def names(self) -> Naming:
        earlier = () if self._restored is None else self._restored.added
        added, self._added = self._added, ()
        return Naming(Names.capture(current_frame()), _union(earlier, added))

    def restore_names(self, names: Naming) -> None:
        frame = current_frame()
        names.names.restore_into(frame)
        register_submodules(frame, names.added)
        self._restored = names

    def initializing(self) -> bool:
        return initializing()

    def create(self, thunk: Callable[[], Any]) -> None:
        create(thunk)

    def init_call(self, call: Callable[[], Any], two_pass: Callable[[], Any]) -> Any:
        return init_once(call, two_pass)

    def reuse_key(self) -> Hashable:
        if current_site() is not None:  # init: traced once, parameters made at the site
            return None
        frame = current_frame()
        return (frame.freeze_params, naming_signature(frame), customisations())


def _key_name(entry: Any) -> Any:
    for attribute in ("key", "name", "idx"):
        if hasattr(entry, attribute):
            return getattr(entry, attribute)
    return str(entry)


def state_parts(state: InternalState) -> list[kit.StatePart | None]:
    """What each leaf of ``state`` is, for ``jaxoverride.solve_state``.

    The rng sequence is Haiku's one stream; each state entry (both halves of its
    ``StatePair``) is state named by its module; params are untouched. A slot is the
    leaf's path.

    Args:
      state: an ``InternalState`` (params may be None, the rng a full block or None).

    Returns:
      One ``StatePart`` (or None, for params) per leaf, in ``tree_flatten`` order.

    Example:
      >>> import jax.numpy as jnp
      >>> from haiku._src import base
      >>> pair = base.StatePair(jnp.zeros(()), jnp.zeros(()))
      >>> parts = state_parts(InternalState(None, {"bn": {"mean": pair}}, None))
      >>> [(p.kind, p.names) for p in parts]
      [('state', ('bn', 'bn/mean')), ('state', ('bn', 'bn/mean'))]
    """
    parts: list[kit.StatePart | None] = []
    for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]:
        keys = tuple(_key_name(entry) for entry in path)
        if keys[0] == "rng":
            parts.append(kit.StatePart("rng", (), keys))
        elif keys[0] == "state":
            parts.append(kit.StatePart("state", (keys[1], f"{keys[1]}/{keys[2]}"), keys))
        else:
            parts.append(None)
    return parts
