"""Haiku's frames and rng sequences, entered without checking the keys again.

Haiku checks a key each time a ``PRNGSequence`` is built or its state replaced, and for a
raw ``uint32`` key the check traces an ``eval_shape``: about as long as a small layer. The
adapter moves rng state between frames many times per call at init, always state Haiku
already checked (or a carry of its shape and dtype); checking again would make init trace
several times longer than apply.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import haiku as hk
import jax
import numpy as np
from haiku._src import base, config as haiku_config, stateful

InternalState = stateful.InternalState


# What refuses an rng draw here (it raises), inside a function that JAX makes pure (see
# ``_convert.pure_frame``); None elsewhere. Every sequence built from carried state in
# there (loop bodies, branches, nested jits and rules) refuses draws too.
REFUSAL: contextvars.ContextVar[Callable[[], NoReturn] | None] = contextvars.ContextVar(
    "jaxoverride_haiku_refused_draws", default=None
)


class CheckedSequence(hk.PRNGSequence):
    """A ``PRNGSequence`` over ``(key, subkeys)`` state that Haiku has already checked.

    Example:
      >>> import jax
      >>> from jaxoverride_haiku._rng import CheckedSequence
      >>> state = hk.PRNGSequence(0).internal_state
      >>> bool((CheckedSequence(state).internal_state[0] == state[0]).all())
      True
    """

    __slots__ = ()

    def __init__(self, state: Any):
        write_state(self, state)

    def replace_internal_state(self, state: Any) -> None:
        write_state(self, state)


class RefusingSequence(CheckedSequence):
    """An rng sequence that refuses every draw (``refuse`` raises; ``REFUSAL`` by default).

    Loops may still carry its state, and reserving keys, which hands none out, leaves it
    as it is, so a neutral loop, branch, jit or rule inside a pure function is no draw.
    """

    __slots__ = ("_refuse_draw",)

    def __init__(self, state: Any, refuse: Callable[[], NoReturn] | None = None):
        super().__init__(state)
        refuse = refuse or REFUSAL.get()
        assert refuse is not None
        self._refuse_draw = refuse

    def __next__(self) -> Any:
        self._refuse_draw()

    next = __next__

    def take(self, num: int) -> Any:
        del num
        self._refuse_draw()

    def reserve(self, num: int) -> None:
        del num

    def reserve_up_to_full(self) -> None:
        pass


def carried_sequence(state: Any) -> CheckedSequence:
    """The sequence of a frame built from carried rng state (a loop body, a branch, a
    nested jit or rule): a ``RefusingSequence`` where draws are refused (``REFUSAL``)."""
    return CheckedSequence(state) if REFUSAL.get() is None else RefusingSequence(state)


def placeholder_state(state: Any) -> Any:
    """``(key, ())`` where ``key`` is zeros shaped as ``state``'s: the state of a sequence
    that refuses every draw, concrete (a traced key carried into a nested jit there would
    be a constant of another trace), and never handed out."""
    key = state[0]
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        data = jax.random.key_data(key)
        zeros = jax.numpy.zeros(data.shape, data.dtype)
        return jax.random.wrap_key_data(zeros, impl=jax.random.key_impl(key)), ()
    return np.zeros(key.shape, key.dtype), ()


# Sequences whose ``__next__`` and ``reserve`` are Haiku's own: the adapter may compute their
# splits in one cached call (``split_keys``), with the very keys Haiku's steps make.
PLAIN_SEQUENCES: tuple[type, ...] = (hk.PRNGSequence, CheckedSequence)


def block_size() -> int:
    """The number of keys Haiku's ``PRNGSequence`` reserves at a time (``rng_reserve_size``,
    which ``hk.config`` sets but has no getter for)."""
    return haiku_config.get_config().rng_reserve_size


@functools.partial(jax.jit, static_argnums=1)
def split_keys(key: Any, count: int) -> tuple[Any, ...]:
    """``tuple(jax.random.split(key, count))``, as ``PRNGSequence.reserve`` computes it, in
    one cached call (traced at init: one equation, where Haiku binds a few per key)."""
    return tuple(jax.random.split(key, count))


def reserve_full_block() -> None:
    """``stateful.reserve_up_to_full_rng_block()``, its split computed by ``split_keys``."""
    sequence = base.current_frame().rng_stack.peek()
    if sequence is None:
        return
    missing = block_size() - len(sequence._subkeys)
    if missing <= 0 or type(sequence) not in PLAIN_SEQUENCES:
        sequence.reserve_up_to_full()  # Haiku's own (it also trims an overfull block)
        return
    keys = split_keys(sequence._key, missing + 1)
    sequence._key = keys[0]
    sequence._subkeys.extend(keys[1:])


def write_state(sequence: hk.PRNGSequence, state: Any) -> None:
    """``sequence.replace_internal_state(state)``, without checking the keys again."""
    key, subkeys = state
    sequence._key = key  # the slots that Haiku's own methods write
    sequence._subkeys = collections.deque(subkeys)


@contextlib.contextmanager
def temporary_state(state: InternalState) -> Iterator[None]:
    """``stateful.temporary_internal_state(state)``, its rng a ``CheckedSequence``."""
    with stateful.temporary_internal_state(state._replace(rng=None)):
        if state.rng is not None:
            stack = base.current_frame().rng_stack
            stack.pop()  # the ``None`` that the frame was given
            stack.push(carried_sequence(stateful.copy_structure(state.rng)))
        yield


def update_state(state: InternalState) -> None:
    """``stateful.update_internal_state(state)``, its rng written without a check."""
    stateful.update_internal_state(state._replace(rng=None))
    if state.rng is not None:
        sequence = base.current_frame().rng_stack.peek()
        assert sequence is not None  # the frame holds rng state, so it holds a sequence
        write_state(sequence, state.rng)
