"""What the adapter needs from Haiku's internals: where its state is usable, frames for
code that JAX traces, and the module-naming state that must survive retracing.

Haiku keeps params, state, rng and the naming counters in a thread-local *frame* that no
JAX transform sees: overrides pass the JAX values in and out explicitly, and each traced
function starts from a recorded naming state, so a retrace names modules as the first
trace did; the caller's counters advance once, after the JAX call.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar, NamedTuple

from haiku._src import base, stateful

from jaxoverride.adapter_kit import Participant, get_opaque_trace_state, is_applying, participant
from jaxoverride_haiku._rng import reserve_full_block, temporary_state

InternalState = stateful.InternalState


def _trace_level_matches(expected: Any) -> bool:
    # JAX's accessor directly: Haiku's own ``JaxTraceLevel.current()`` costs about 3x more.
    return expected.opaque == get_opaque_trace_state(convention="haiku")


def in_transform() -> bool:
    """Whether code runs inside ``hk.transform`` (at any JAX trace level).

    Returns:
      True between the entry and exit of a Haiku transformed function.

    Example:
      >>> import haiku as hk, jaxoverride_haiku as joh
      >>> joh.in_transform()
      False
      >>> hk.transform(lambda: joh.in_transform()).apply({}, None)
      True
    """
    return bool(base.frame_stack)


def state_usable() -> bool:
    """Whether Haiku state can be passed through a JAX transform started here.

    True inside ``hk.transform`` at the trace level of the innermost Haiku frame (where
    Haiku allows ``hk.get_parameter`` with ``check_jax_usage=True``); false inside a raw
    ``jax.jit``/``jax.vmap`` there, where the neutral functions are JAX's own.

    Returns:
      Whether the Haiku overrides take effect at this point.

    Example:
      >>> import jax, haiku as hk, jaxoverride_haiku as joh
      >>> seen = []
      >>> def f():
      ...     seen.append(joh.state_usable())
      ...     jax.jit(lambda: seen.append(joh.state_usable()))()
      >>> hk.transform(f).apply({}, None)
      >>> seen
      [True, False]
    """
    if not base.frame_stack:
        return False
    return _trace_level_matches(base.frame_stack.peek().jax_trace_stack.peek())


class _Haiku:
    """What ``kit.participant`` recognises a Haiku source by."""

    framework: ClassVar[str | None] = "haiku"


def solve_policy() -> Participant | None:
    """The ``jaxoverride.solve_state`` declaration's ``Participant`` for Haiku, or None."""
    return participant(_Haiku) if base.frame_stack else None


def policy_state(policy: Participant | None) -> InternalState:
    """The frame's state (params closed over), for a boundary: under a declaration with a
    full rng block reserved (slots matching the entry's) and frozen parts as at entry."""
    if policy is None:
        return stateful.internal_state()
    reserve_full_block()
    return policy.freeze(stateful.internal_state())


def policy_received(policy: Participant | None) -> InternalState | None:
    """What the evaluations before a boundary starting now left (``Participant.current``),
    for it to pass on where it runs none; None without a policy."""
    if policy is None:
        return None
    reserve_full_block()
    return policy.current(stateful.internal_state())


def policy_left(policy: Participant | None, frame: Any, before: InternalState) -> InternalState:
    """What changed in the current frame since ``before`` (``stateful.difference``), under
    a declaration what the traced function leaves (``Participant.left``)."""
    if policy is None:
        return stateful.difference(before, stateful.internal_state())
    reserve_full_block()
    after = policy.left(stateful.internal_state(), frame)
    return stateful.difference(before, after)


def current_frame() -> base.Frame:
    return base.frame_stack.peek()


def initializing() -> bool:
    """True while Haiku creates parameters and no init-safe apply pass is running."""
    return not current_frame().freeze_params and not is_applying()


class Names(NamedTuple):
    """A copy of a frame's module-naming state (counters and used names, every level)."""

    counters: list[collections.Counter[str]]
    used: list[set[str]]

    @classmethod
    def capture(cls, frame: base.Frame) -> Names:
        return cls(
            [collections.Counter(c) for c in frame.counter_stack._storage],
            [set(u) for u in frame.used_names_stack._storage],
        )

    def restore_into(self, frame: base.Frame) -> None:
        """Writes this naming state into ``frame``'s own counters and name sets, in place."""
        for target, saved in zip(frame.counter_stack._storage, self.counters, strict=False):
            if target != saved:
                target.clear()
                target.update(saved)
        for target, saved in zip(frame.used_names_stack._storage, self.used, strict=False):
            if target != saved:
                target.clear()
                target.update(saved)


def naming_signature(frame: base.Frame) -> tuple[Any, ...]:
    """A hashable summary of everything that decides the names of modules made here."""
    return (
        tuple(
            (getattr(entry.module, "module_name", None), entry.method_name)
            for entry in frame.module_stack._storage
        ),
        tuple(frozenset(c.items()) for c in frame.counter_stack._storage),
        tuple(frozenset(u) for u in frame.used_names_stack._storage),
    )


def submodule_sets(frame: base.Frame) -> list[set[str] | None]:
    """A copy of the submodule names each module on ``frame``'s stack has registered."""
    return [
        None if names is None else set(names)
        for names in (getattr(e.module, "_submodules", None) for e in frame.module_stack._storage)
    ]


def added_submodules(before: list[set[str] | None], frame: base.Frame) -> list[set[str]]:
    """Per level of ``frame``'s module stack, the submodule names registered since
    ``before`` (``submodule_sets``)."""
    return [
        set() if old is None or new is None else new - old
        for old, new in zip(before, submodule_sets(frame), strict=False)
    ]


def register_submodules(frame: base.Frame, added: Sequence[Iterable[str]]) -> None:
    """Registers ``added`` (per stack level) with the modules on ``frame``'s stack again: a
    reused trace (a cache hit, where nothing runs) must still list them in ``params_dict()``."""
    stack = frame.module_stack._storage
    for level, names in enumerate(added):
        if names and level < len(stack):
            getattr(stack[level].module, "_submodules", set()).update(names)


class Threaded:
    """Runs ``count`` functions, traced by one JAX call in order, with Haiku state threaded:
    function ``i`` (and its retrace) starts from the naming state where ``i - 1`` ended;
    ``finish()`` advances the caller's counters once."""

    __slots__ = ("_added", "_ends", "_starts", "check_params", "where")

    def __init__(self, count: int, where: str, *, check_params: bool = True):
        entry = Names.capture(current_frame())
        self._starts: list[Names | None] = [entry] + [None] * (count - 1)
        self._ends: list[Names | None] = [None] * count
        # Names of submodules that each function's last trace registered with the modules
        # on the stack: a reused trace (a cache hit, nothing runs) registers them again.
        self._added: list[list[set[str]]] = [[] for _ in range(count)]
        self.where = where
        self.check_params = check_params

    def _start(self, index: int) -> Names:
        start = self._starts[index]
        if start is None:
            earlier = (e for e in reversed(self._ends[:index]) if e is not None)
            start = self._starts[index] = next(earlier, self._starts[0])
        assert start is not None
        return start

    @contextlib.contextmanager
    def frame(self, index: int, state: InternalState) -> Iterator[base.Frame]:
        """A Haiku frame holding ``state`` for function ``index``, at the current trace level."""
        start = self._start(index)
        with temporary_state(state), base.push_jax_trace_level():
            inner = current_frame()
            start.restore_into(inner)
            before = base.param_names() if self.check_params else None
            submodules = submodule_sets(inner)
            yield inner
            if before is not None:
                created = base.param_names() - before
                if created:
                    raise new_parameters_error(self.where, created)
            self._ends[index] = Names.capture(inner)
            self._added[index] = added_submodules(submodules, inner)

    def finish(self) -> None:
        frame = current_frame()
        last = next((e for e in reversed(self._ends) if e is not None), None)
        if last is not None:
            last.restore_into(frame)
        for added in self._added:
            register_submodules(frame, added)


def _listed(created: Any) -> str:
    """``module/name`` pairs as a message lists them, sorted."""
    return ", ".join(f"{module}/{name}" for module, name in sorted(created))


def new_parameters_error(where: str, created: Any) -> ValueError:
    return ValueError(
        f"{where}: parameters {_listed(created)} were first created inside the traced body, where "
        "they would leak out of the JAX trace. At init, jaxoverride_haiku runs each body "
        "once outside the trace to create every parameter; a body that creates different "
        "parameters when it is traced (for example one that checks hk.running_init() or "
        "builds modules depending on a Python counter) defeats that. Create these "
        "parameters unconditionally, or before the loop. At apply, pass the params that "
        'init returned. Raw errors and their fixes: the "Troubleshooting" page of the '
        "jaxoverride documentation."
    )


def loop_state(params: bool = False) -> InternalState:
    """The state a loop carries: state and rng, and params if ``params`` (else closed over,
    as Haiku's loops do); a full rng block reserved first, so the carry keeps one
    structure (and draws the keys ``hk.scan`` draws)."""
    reserve_full_block()
    state = stateful.internal_state(params=params)
    if state.params is not None:  # at init a defaultdict, inside a temporary frame a dict
        state = state._replace(params={m: dict(b) for m, b in state.params.items() if b})
    return state


def state_names(state: Any) -> set[tuple[str, str]]:
    return {(module, name) for module, bundle in state.items() for name in bundle}


def check_same_state(where: str, before: InternalState, after: InternalState) -> None:
    """Raises a clear error if a traced body created state that its input did not have."""
    created = state_names(after.state) - state_names(before.state)
    if created:
        raise ValueError(
            f"{where}: Haiku state {_listed(created)} was first created inside the traced body, so "
            "the state the body returns does not match the state it received. At init "
            "jaxoverride_haiku creates state before tracing; at apply, pass the state that "
            "init returned (hk.transform_with_state), or create the state before the loop."
        )
