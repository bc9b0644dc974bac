"""Haiku's frames and rng sequences, entered without checking the keys again.

Haiku checks a key each time a ``PRNGSequence`` is built or its state replaced
(``assert_is_prng_key``), and for a raw ``uint32`` key the check traces an
``eval_shape`` of its own: about as long as tracing a small layer. The adapter moves rng
state between frames many times per call at init (each loop body, branch, jit and rule
gets a frame), always state that Haiku checked when ``hk.transform`` received the key, or
a carry of the same shape and dtype. Checking it again would make init trace several
times longer than apply, which has no rng.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import haiku as hk
import jax
from haiku._src import base, config as haiku_config, stateful

InternalState = stateful.InternalState


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


# Sequences whose ``__next__`` and ``reserve`` are Haiku's own: the adapter may compute their
# splits in one cached call (``split_keys``), with the very keys Haiku's steps make.
PLAIN_SEQUENCES = (hk.PRNGSequence, CheckedSequence)


def block_size() -> int:
    """The number of keys Haiku's ``PRNGSequence`` reserves at a time (``rng_reserve_size``,
    which ``hk.config`` sets but has no getter for)."""
    return haiku_config.get_config().rng_reserve_size


@functools.partial(jax.jit, static_argnums=1)
def split_keys(key: Any, count: int) -> tuple[Any, ...]:
    """``tuple(jax.random.split(key, count))``, as ``PRNGSequence.reserve`` computes it.

    One cached ``jax.jit`` call: traced at init, a single equation where Haiku's own
    reservation binds one per key (the split, then a slice and a squeeze per key), and the
    same keys bit for bit.
    """
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
            stack.push(CheckedSequence(stateful.copy_structure(state.rng)))
        yield


def update_state(state: InternalState) -> None:
    """``stateful.update_internal_state(state)``, its rng written without a check."""
    stateful.update_internal_state(state._replace(rng=None))
    if state.rng is not None:
        sequence = base.current_frame().rng_stack.peek()
        assert sequence is not None  # the frame holds rng state, so it holds a sequence
        write_state(sequence, state.rng)
