"""The creation pass: run a body once, outside JAX control flow, to create its parameters.

``jaxoverride_plain``'s combinators call ``create(thunk)`` at init before the apply pass.
For Haiku the pass must leave no trace but the parameters and state entries it created:

* state values and the module-naming counters are restored, so that the apply pass
  (the traced loop) sees the state the loop receives and names its modules as the
  creation pass did;
* rng draws of the body itself come from a throw-away copy of the sequence, so that the
  apply pass draws the same keys that apply will draw;
* initializers draw from a key salted with the parameter's full name: every parameter
  created in a creation pass gets its own key, and none of them repeats a key that the
  untouched sequence hands out later.
"""

from __future__ import annotations

import collections
import zlib
from collections.abc import Callable
from typing import Any

import haiku as hk
import jax
from haiku._src import base

from jaxoverride.adapter_kit import init_safe_call as kit_init_safe_call
from jaxoverride_haiku._frames import Names, current_frame, initializing
from jaxoverride_haiku._rng import CheckedSequence


class _SaltedSequence(hk.PRNGSequence):
    """A ``PRNGSequence`` whose key, ``fold_in(next(parent), salt)``, is made on first use.

    Initializers that draw no key (``jnp.zeros``, constants) then cost nothing.
    """

    __slots__ = ("_parent", "_salt")

    def __init__(self, parent: hk.PRNGSequence, salt: int):
        self._parent: hk.PRNGSequence | None = parent
        self._salt = salt
        self._key = None
        self._subkeys = collections.deque()

    def _materialize(self) -> None:
        parent = self._parent
        if parent is not None:
            self._parent = None
            self._key = jax.random.fold_in(next(parent), self._salt)

    def reserve(self, num: int) -> None:
        self._materialize()
        super().reserve(num)

    def reserve_up_to_full(self) -> None:
        self._materialize()
        super().reserve_up_to_full()

    @property
    def internal_state(self) -> Any:
        self._materialize()
        return self._key, tuple(self._subkeys)

    def replace_internal_state(self, state: Any) -> None:
        self._parent = None
        super().replace_internal_state(state)

    def __next__(self) -> jax.Array:
        self._materialize()
        return super().__next__()

    next = __next__

    def take(self, num: int) -> tuple[jax.Array, ...]:
        self._materialize()
        return super().take(num)


def _salt(full_name: str) -> int:
    return zlib.crc32(full_name.encode()) & 0x7FFFFFFF


def _salted_creator(
    next_creator: Callable[..., Any], shape: Any, dtype: Any, init: Any, context: Any
) -> Any:
    frame = current_frame()
    sequence = frame.rng_stack.peek()
    if sequence is None:
        return next_creator(shape, dtype, init)
    with frame.rng_stack(_SaltedSequence(sequence, _salt(context.full_name))):
        return next_creator(shape, dtype, init)


def _copy_bundles(collection: Any) -> dict[str, dict[str, Any]]:
    return {module: dict(bundle) for module, bundle in collection.items()}


def _restore_state(frame: base.Frame, before: dict[str, dict[str, Any]], keep_new: bool) -> None:
    state: Any = frame.state  # a defaultdict of {name: StatePair} inside a transform
    for module in list(state):
        bundle = state[module]
        saved = before.get(module, {})
        for name in list(bundle):
            if name in saved:
                bundle[name] = saved[name]
            elif keep_new:
                # Created by the pass: keep the entry, as if only its initial value was set.
                initial = bundle[name].initial
                bundle[name] = base.StatePair(initial, initial)
            else:
                del bundle[name]
        if not bundle and module not in before:
            del state[module]


def _restore_params(frame: base.Frame, before: dict[str, dict[str, Any]]) -> None:
    for module in list(frame.params):
        saved = before.get(module)
        if saved is None:
            del frame.params[module]
            continue
        bundle = frame.params[module]
        for name in list(bundle):
            if name not in saved:
                del bundle[name]


def create(thunk: Callable[[], Any]) -> None:
    """The ``create`` hook of ``jaxoverride_plain``'s combinators, for Haiku.

    Runs ``thunk`` in the current frame; keeps the parameters and state entries it
    created; restores state values, rng and module-naming counters. On an exception it
    also removes what it created, so that nothing of the failed pass remains.
    """
    frame = current_frame()
    names = Names.capture(frame)
    state_before = _copy_bundles(frame.state)
    params_before = _copy_bundles(frame.params)
    sequence = frame.rng_stack.peek()
    sandbox = None if sequence is None else CheckedSequence(sequence.internal_state)
    try:
        with (
            frame.rng_stack(sandbox),
            base.custom_creator_unsafe(_salted_creator, params=True, state=True),
        ):
            thunk()
    except BaseException:
        _restore_params(frame, params_before)
        _restore_state(frame, state_before, keep_new=False)
        names.restore_into(frame)
        raise
    _restore_state(frame, state_before, keep_new=True)
    names.restore_into(frame)


def init_safe_call(creation: Callable[[], Any], apply: Callable[[], Any]) -> Any:
    """``jaxoverride.adapter_kit.init_safe_call`` with Haiku's hooks (for ``eval_shape``)."""
    return kit_init_safe_call(creation, apply, initializing=initializing, create=create)
