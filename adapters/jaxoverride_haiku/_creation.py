"""The creation pass: run a body once, outside JAX control flow, to create its parameters.

``jaxoverride_plain``'s combinators call ``create(thunk)`` at init before the apply pass,
which must then see the state and names the loop receives: state values and naming
counters are restored, the body's own draws come from a throw-away copy of the sequence,
and initializers draw from a key salted with the parameter's full name, which no later
key of the untouched sequence repeats.
"""

from __future__ import annotations

import collections
import functools
import zlib
from collections.abc import Callable
from typing import Any

import haiku as hk
import jax
import numpy as np
from haiku._src import base

from jaxoverride.adapter_kit import init_safe_call as kit_init_safe_call
from jaxoverride_haiku._frames import Names, current_frame, initializing
from jaxoverride_haiku._rng import PLAIN_SEQUENCES, CheckedSequence, block_size


@functools.partial(jax.jit, static_argnums=(2, 3))
def _salted_keys(parent: Any, salt: Any, parent_block: int, own_block: int) -> Any:
    """The keys of a salted sequence's first draw, bit for bit what ``PRNGSequence``
    computes step by step, in one cached call (at init some twenty equations become one).

    Returns ``(parent_keys, own_keys)``: the parent's split into ``parent_block + 1`` keys
    (empty without it), and the split of ``fold_in(drawn, salt)`` into ``own_block + 1``
    (the salted key alone without it).
    """
    parent_keys: tuple[Any, ...] = ()
    if parent_block:
        parent_keys = tuple(jax.random.split(parent, parent_block + 1))
        parent = parent_keys[1]
    salted = jax.random.fold_in(parent, salt)
    own_keys = tuple(jax.random.split(salted, own_block + 1)) if own_block else (salted,)
    return parent_keys, own_keys


class _SaltedSequence(hk.PRNGSequence):
    """A ``PRNGSequence`` whose key, ``fold_in(next(parent), salt)``, is made on first use
    (in one ``_salted_keys`` call): initializers that draw no key cost nothing."""

    __slots__ = ("_parent", "_salt")

    def __init__(self, parent: hk.PRNGSequence, salt: int):
        self._parent: hk.PRNGSequence | None = parent
        self._salt = salt
        self._key = None
        self._subkeys = collections.deque()

    def _materialize(self, own_block: int = 0) -> None:
        """Makes the salted key, and with ``own_block`` splits it as ``reserve`` would."""
        parent = self._parent
        if parent is None:
            return
        self._parent = None
        parent_block = 0
        if type(parent) not in PLAIN_SEQUENCES:  # its own __next__ (a refusing sequence)
            drawn = next(parent)
        elif parent._subkeys:
            drawn = parent._subkeys.popleft()
        else:  # what parent.__next__ would reserve
            drawn, parent_block = parent._key, block_size()
        parent_keys, own_keys = _salted_keys(drawn, np.uint32(self._salt), parent_block, own_block)
        if parent_keys:
            parent._key = parent_keys[0]
            parent._subkeys.extend(parent_keys[2:])
        self._key = own_keys[0]
        self._subkeys.extend(own_keys[1:])

    def reserve(self, num: int) -> None:
        if self._parent is not None and num > 0:
            self._materialize(own_block=num)
            return
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

    # ``__next__`` is Haiku's: with no subkeys yet it calls ``reserve`` (above) for a block.

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
    """The ``create`` hook of the kit's combinators, for Haiku: runs ``thunk`` in the
    current frame, keeping the parameters and state entries it created (none on an
    exception) and restoring state values, rng and naming counters."""
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
