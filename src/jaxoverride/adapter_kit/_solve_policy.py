"""``jaxoverride.solve_state`` applied to a framework's state, once, for every adapter.

A framework takes part by registering a *solve source* (``register_solve_source``): a
function that returns the ``StateSource`` of the code running now, or None. Its sources
declare ``framework`` (the key they registered under) and ``parts(state)``: per leaf of
``read()``'s state a ``StatePart`` (an rng stream or mutable state, its names, a slot
that identifies it across reads), or None for what no policy touches (parameters).

When a declaration is entered, each framework running now gives a source, read once:
the *entry snapshot*. The parts it freezes (rng ``"per_solve"``, state
``"at_solution"``) are handled at the kit's boundaries (``Threaded``, and adapters' own
through the same ``Participant``):

* **entering** a traced function (``freeze``): the frozen parts are the snapshot's;
* **writing** a JAX call's final state (``written``): the snapshot's again, so the next
  evaluation starts from the entry state; the state the call left is kept as the
  innermost boundary's *last*;
* **leaving** a traced function (``left``): if its frozen parts are still the ones it
  entered with, it leaves its inner call's *last*, which so flows out through the carry;
* **exit**: the state becomes what the last forward evaluation left. A backward pass's
  writes are dropped. On an exception the entry snapshot is written back.

A framework whose boundaries describe their states in more than one way (NNX) gets a
view per source (``seen_by``): slots, not layouts, tie the states together. A boundary
whose trace is cached (a ``jit``) rebases its frame (``push(entry)``), so that no
snapshot value is baked into the cached trace. A map marked ``jaxoverride.solver_map``
is a boundary at each call (``Participant.evaluation``); two direct calls with no
neutral call between them are one run of the stream, as in eager Python.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator
from typing import Any, ClassVar, Protocol

import jax

from jaxoverride import _frameworks, _solve_state
from jaxoverride._compat import current_trace
from jaxoverride._solve_state import AT_SOLUTION, PER_SOLVE, solve_state

KINDS = ("rng", "state")


@dataclasses.dataclass(frozen=True)
class StatePart:
    """What one leaf of a source's state is, for ``jaxoverride.solve_state``.

    Attributes:
      kind: ``"rng"`` (a stream's position: a key, a counter) or ``"state"`` (mutable
        state: a collection, a Variable, a module's state).
      names: the names a declaration may give it by (a stream, a collection, a Variable
        type and its bases, a module); empty where the framework has one stream.
      slot: identifies this piece of state across reads (e.g. its path); equal slots are
        the same piece.

    Example:
      >>> from jaxoverride.adapter_kit import StatePart
      >>> StatePart("rng", ("dropout",), ("rngs", "dropout")).kind
      'rng'
    """

    kind: str
    names: tuple[str, ...]
    slot: Hashable

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"StatePart.kind is {self.kind!r}; expected one of {list(KINDS)}.")


SolveSource = Callable[[], Any]

_lock = threading.Lock()
_sources: dict[str, SolveSource] = {}


def register_solve_source(framework: str, source: SolveSource) -> None:
    """Lets ``jaxoverride.solve_state`` apply to a framework's state.

    Args:
      framework: the framework's key (its sources' ``framework`` attribute).
      source: ``source()``, the ``StateSource`` of the code running now, or None where
        the framework is not running (or its adapter is not active).

    Returns:
      None. Registering a key again replaces its function.

    Example:
      >>> from jaxoverride import adapter_kit as kit
      >>> kit.register_solve_source("doc-example", lambda: None)
      >>> kit.unregister_solve_source("doc-example")
    """
    with _lock:
        _sources[framework] = source


def unregister_solve_source(framework: str) -> None:
    """Undoes ``register_solve_source`` (a no-op for a key never registered).

    Args:
      framework: the key.

    Returns:
      None.

    Example:
      >>> from jaxoverride import adapter_kit as kit
      >>> kit.unregister_solve_source("never-registered")
    """
    with _lock:
        _sources.pop(framework, None)


def _slots(source: Any, state: Any) -> tuple[list[Any], list[Any], Any]:
    """The leaves of ``state``, their parts (None where untouched), and its treedef."""
    leaves, treedef = jax.tree_util.tree_flatten(state)
    parts = source.parts(state)
    if parts is None:
        parts = [None] * len(leaves)
    elif len(parts) != len(leaves):
        raise ValueError(
            f"{type(source).__name__}.parts returned {len(parts)} parts for a state of "
            f"{len(leaves)} leaves; expected one StatePart (or None) per leaf of read()."
        )
    return leaves, list(parts), treedef


class _Frame:
    """One boundary being traced: the state its last inner call left (and the source that
    describes it), a rebased frame's own frozen parts, whether it runs backward (writes
    never kept), and the JAX trace it began in (``here``)."""

    __slots__ = ("backward", "frozen", "last", "last_source", "trace")

    def __init__(self, frozen: dict[Hashable, Any] | None = None, backward: bool = False):
        self.last: Any = None
        self.last_source: Any = None
        self.frozen = frozen
        self.backward = backward
        # weakly: a frame outlives its trace where a jaxpr's write-out holds the
        # participant (``write_out``), and must not keep the trace's values alive
        self.trace = weakref.ref(current_trace())


class Participant:
    """One framework's state under one declaration: the entry snapshot and the frames.

    Made when the declaration is entered; the kit's ``Threaded`` and an adapter's own
    boundaries call ``freeze``, ``push``/``pop``, ``written`` and ``left``.

    Args:
      declaration: the ``jaxoverride.solve_state`` entered.
      framework: the framework's key.
      source: its ``StateSource`` at entry (read once: the entry snapshot).

    Example:
      Each evaluation starts from the entry state; the last one's write is kept:

      >>> import jax.numpy as jnp, jaxoverride as jo
      >>> from jaxoverride import adapter_kit as kit
      >>> class Source(kit.DictStateSource):
      ...     framework = "doc"
      ...     def parts(self, state):
      ...         return [kit.StatePart("state", ("calls",), "calls")]
      >>> store = {"calls": jnp.int32(0)}
      >>> def count():
      ...     store["calls"] = store["calls"] + 1
      >>> policy = kit.Participant(jo.solve_state(), "doc", Source(store))
      >>> policy.evaluation(count), policy.evaluation(count)
      (None, None)
      >>> int(store["calls"]), int(policy.current(store)["calls"])  # live, last
      (0, 1)
    """

    __slots__ = (
        "_closed",
        "_frames",
        "declaration",
        "framework",
        "frozen",
        "snapshot",
        "source",
    )

    def __init__(self, declaration: solve_state, framework: str, source: Any):
        self.declaration = declaration
        self.framework = framework
        self.source = source
        self.snapshot = source.read()
        self.frozen: dict[Hashable, Any] = {}  # slot -> its leaf at entry, if frozen
        self._frames: list[_Frame] = [_Frame()]
        self._closed = [False]  # shared with the views: set at the declaration's exit
        self.learn(self.snapshot)

    def freezes(self, kind: str, names: tuple[str, ...]) -> bool:
        """Whether the declaration freezes the state of ``kind`` named ``names`` (rng per
        solve, state at the solution): a backward pass may then draw or write it."""
        return self.declaration.policy(kind, names) in (PER_SOLVE, AT_SOLUTION)

    def _freezes(self, part: StatePart) -> bool:
        return self.freezes(part.kind, part.names)

    def seen_by(self, source: Any) -> Participant:
        """This participant, the states it is given described by ``source``'s ``parts``
        (the snapshot, the frames and the frozen parts shared)."""
        if source is self.source or isinstance(source, type):
            return self  # a class names the framework only: the participant itself
        view = copy.copy(self)
        view.source = source
        view.snapshot = None  # the base's, for its exit only (a view may outlive it)
        return view

    def learn(self, state: Any) -> None:
        """Takes ``state``'s frozen parts not yet known (created inside the declaration, at
        init) as entry values, unless a boundary is being traced (its values are traced)."""
        if len(self._frames) != 1 or self._closed[0]:
            return
        leaves, parts, _ = _slots(self.source, state)
        for leaf, part in zip(leaves, parts, strict=True):
            if part is not None and part.slot not in self.frozen and self._freezes(part):
                self.frozen[part.slot] = leaf

    def _entry(self) -> dict[Hashable, Any]:
        """The frozen parts in effect: the innermost rebased frame's, else the snapshot's."""
        for frame in reversed(self._frames):
            if frame.frozen is not None:
                return frame.frozen
        return self.frozen

    def freeze(self, state: Any) -> Any:
        """``state`` with its frozen parts as at entry (of the innermost rebased frame)."""
        if not self.frozen:
            return state
        leaves, parts, treedef = _slots(self.source, state)
        frozen = self._entry()
        out = [
            frozen.get(part.slot, leaf) if part is not None else leaf
            for leaf, part in zip(leaves, parts, strict=True)
        ]
        return jax.tree_util.tree_unflatten(treedef, out)

    def push(self, entry: Any = None, received: Any = None, backward: bool = False) -> _Frame:
        """A new innermost boundary (a traced function starts). ``entry``: the state it
        receives, already frozen; the frame is rebased to its frozen parts. ``received``:
        the state before ``freeze``, its *last* until an inner call writes, so a function
        that runs no evaluation (a ``while_loop``'s test) passes it on. ``backward``: this
        boundary and every one inside it run in a backward pass."""
        frozen = None
        if entry is not None and self.frozen:
            # Only the entry's: a part the traced function was not handed is not frozen
            # to an outer value (a constant of its trace) but left as it is found.
            frozen = self._entries(entry)
        frame = _Frame(frozen, backward or self._frames[-1].backward)
        if received is not None:
            frame.last, frame.last_source = received, self.source
        self._frames.append(frame)
        return frame

    @contextlib.contextmanager
    def discarded(self) -> Iterator[None]:
        """A boundary whose state comes out nowhere (``eval_shape``): what is written
        inside is dropped with it, never kept as an outer boundary's (a leaked tracer)."""
        frame = self.push()
        try:
            yield
        finally:
            self.pop(frame)

    def pop(self, frame: _Frame) -> None:
        """The boundary ``push`` returned ends (with any inner one an exception left)."""
        for index in range(len(self._frames) - 1, 0, -1):
            if self._frames[index] is frame:
                del self._frames[index:]
                return

    def written(self, state: Any, backward: bool = False) -> Any:
        """What to write for a JAX call's final ``state``: its frozen parts as at entry.
        ``state`` is kept as the innermost boundary's last, unless ``backward``."""
        if not self.frozen:
            return state
        frame = self._frames[-1]
        # A call that hands back the entry's very values only carried them through: it
        # is no evaluation, and must not replace the last one. A call that ends in a trace
        # other than the boundary's (inside a shape evaluation or a rule's trace that no
        # boundary marks) left values of that trace: the boundary cannot keep them.
        keep = not (backward or frame.backward or self._closed[0])
        keep = keep and frame.trace() is current_trace()
        if keep and not self.untouched(state):
            frame.last, frame.last_source = state, self.source
        return self.freeze(state)

    def here(self) -> bool:
        """Whether a value made now belongs to the innermost boundary: the declaration is
        open, the boundary runs forward, and JAX is in the very trace it began in."""
        frame = self._frames[-1]
        return not (self._closed[0] or frame.backward) and frame.trace() is current_trace()

    def frozen_written(self, state: Any) -> dict[Hashable, Any]:
        """By slot, the frozen leaves of ``state`` that are not the entry's very values: what
        an evaluation that left ``state`` wrote there."""
        entry = self._entry()
        return {
            slot: leaf for slot, leaf in self._entries(state).items() if entry.get(slot) is not leaf
        }

    def written_parts(self, values: dict[Hashable, Any]) -> None:
        """Keeps ``values`` (frozen parts by slot, handed out by ``write_out``) as the
        innermost boundary's last, over what it had; a no-op unless ``here()``."""
        if not values or not self.here():
            return
        frame = self._frames[-1]
        kept = {} if frame.last is None else self._entries(frame.last, frame.last_source)
        kept.update(values)
        frame.last, frame.last_source = list(kept.values()), _BySlot(list(kept))

    def changed_per_evaluation(self, before: Any, after: Any) -> list[str]:
        """The names of the per-evaluation parts that ``after`` changed from ``before`` (in a
        function converted into a jaxpr, such a write could not come out)."""
        leaves, parts, _ = _slots(self.source, before)
        after_leaves, after_parts, _ = _slots(self.source, after)
        entry = {
            part.slot: leaf for leaf, part in zip(leaves, parts, strict=True) if part is not None
        }
        return sorted(
            {
                f"{part.kind} {'/'.join(part.names) or part.kind}"
                for leaf, part in zip(after_leaves, after_parts, strict=True)
                if part is not None
                and not self._freezes(part)  # by name: a part created inside counts too
                and entry.get(part.slot, leaf) is not leaf
            }
        )

    def untouched(self, state: Any) -> bool:
        """Whether ``state``'s frozen parts are the entry's very objects: what a traced
        function leaves when it evaluated nothing."""
        frozen = self._entry()
        leaves, parts, _ = _slots(self.source, state)
        return all(
            part is None or part.slot not in frozen or frozen[part.slot] is leaf
            for leaf, part in zip(leaves, parts, strict=True)
        )

    def left(self, state: Any, frame: _Frame) -> Any:
        """What a traced function leaves: ``state``, each frozen part still the entry's
        taken from what its last inner call left (see ``push``). The newest write of each
        part wins, so a map that writes a collection, then calls a rule, then draws
        leaves both."""
        if frame.last is None or not self.frozen:
            return state
        entry = frame.frozen if frame.frozen is not None else self._entry()
        leaves, parts, treedef = _slots(self.source, state)
        by_slot = self._entries(frame.last, frame.last_source)
        out = [
            by_slot.get(part.slot, leaf)
            if part is not None and (part.slot not in entry or entry[part.slot] is leaf)
            else leaf
            for leaf, part in zip(leaves, parts, strict=True)
        ]
        return jax.tree_util.tree_unflatten(treedef, out)

    @contextlib.contextmanager
    def rebased(self, state: Any) -> Iterator[None]:
        """Inside, the innermost frame's frozen parts are ``state``'s (a value of a trace
        of its own, such as a custom rule's argument), as ``push(entry=state)`` makes them."""
        frame = self._frames[-1]
        saved = frame.frozen
        frame.frozen = self._entries(state)
        try:
            yield
        finally:
            frame.frozen = saved

    def _entries(self, state: Any, source: Any = None) -> dict[Hashable, Any]:
        """``state``'s leaves in frozen parts, by slot (described by ``source``'s parts)."""
        leaves, parts, _ = _slots(self.source if source is None else source, state)
        return {
            part.slot: leaf
            for leaf, part in zip(leaves, parts, strict=True)
            if part is not None and part.slot in self.frozen
        }

    def current(self, state: Any) -> Any:
        """The state a JAX call starting now hands its functions (``state``: read from the
        framework): where the frozen parts are untouched, the innermost boundary's last,
        so a branch that runs no evaluation passes on what the last one left. Where they
        are touched, an evaluation ran directly since: ``state`` becomes the last (as in
        ``written``), since this call freezes those parts again."""
        if not self.frozen:
            return state
        frame = self._frames[-1]
        if self.here() and not self.untouched(state):
            frame.last, frame.last_source = state, self.source
        return self.left(state, frame)

    def finish(self, failed: bool) -> None:
        """At the declaration's exit: the state the last forward evaluation left (or, on
        failure, the entry snapshot) becomes the framework's. Then no state value is
        kept: a backward rule that captured the participant must hold no forward tracer."""
        try:
            if failed:
                self.source.write(self.snapshot)
            elif self.frozen:
                self.source.write(self.left(self.source.read(), self._frames[0]))
        finally:
            self._closed[0] = True
            self.snapshot = None
            self.frozen.update(dict.fromkeys(self.frozen))
            self._frames[:] = [_Frame()]

    def evaluation(self, call: Callable[[], Any]) -> Any:
        """Runs ``call()`` as one evaluation of a solver's map (``jaxoverride.solver_map``)
        on the framework's live state, a boundary as a traced function is: the frozen
        parts are the entry's while it runs, what it leaves is kept as the innermost
        boundary's last, and they are the entry's again after it. If ``call`` raises, the
        live state is put back as it was read.

        Args:
          call: the evaluation, no arguments.

        Returns:
          What ``call()`` returns.

        Example:
          >>> import jaxoverride as jo
          >>> from jaxoverride import adapter_kit as kit
          >>> kit.Participant(jo.solve_state(), "doc", kit.DictStateSource({})).evaluation(
          ...     lambda: 42)
          42
        """
        source = self.source
        before = source.read()
        self.learn(before)
        state = self.current(before)
        frame = self.push(received=state)
        try:
            source.write(self.freeze(state))
            out = call()
            after = source.read()
        except BaseException:
            self.pop(frame)
            source.write(before)
            raise
        self.pop(frame)
        source.write(self.written(self.left(after, frame)))
        return out

    def check_names(self) -> list[str]:
        """The names the declaration gives that none of this framework's parts has."""
        parts = _slots(self.source, self.snapshot)[1]
        known = {(part.kind, name) for part in parts if part is not None for name in part.names}
        return [
            f"{kind} {name!r}"
            for kind in KINDS
            for name in self.declaration.named(kind)
            if (kind, name) not in known
        ]


class _BySlot:
    """Describes a list of frozen parts' values by their slots (``written_parts``)."""

    __slots__ = ("slots",)

    def __init__(self, slots: list[Hashable]):
        self.slots = slots

    def parts(self, state: Any) -> list[StatePart]:
        del state
        return [StatePart("state", (), slot) for slot in self.slots]


declarations_entered: Callable[[], tuple[Any, ...]] = _solve_state._active.get
"""Whether a ``jaxoverride.solve_state`` declaration is entered now: a non-empty tuple
if one is, else ``()``. A bound C method, so asking costs no Python frame (for a
cache-hit path that serves only undeclared calls).

Example:
  >>> from jaxoverride import adapter_kit as kit
  >>> kit.declarations_entered()
  ()
"""


@contextlib.contextmanager
def resumed(entered: Participant | None) -> Iterator[None]:
    """Runs the block under ``entered``'s declaration (a ``Participant`` captured when a
    neutral call started), for a backward rule that JAX traces after the declaration
    exited: its boundaries then freeze as the forward's did, and its writes are dropped
    by the rule (``written(..., backward=True)``). None: the block runs as it is.

    Args:
      entered: the participant captured at the forward call, or None.

    Returns:
      A context manager.

    Example:
      >>> from jaxoverride import adapter_kit as kit
      >>> with kit.resumed(None):
      ...     pass
    """
    if entered is None:
        yield
        return
    with _solve_state.reentered(entered.declaration, {entered.framework: entered}):
        yield


class _NamesFramework(Protocol):
    """What ``participant`` reads of a source or a class of sources: ``framework``, its solve
    source's key (``StateSource.framework``), or None where no declaration applies."""

    framework: ClassVar[str | None]


def participant(source: _NamesFramework | type[_NamesFramework]) -> Participant | None:
    """The innermost declaration's ``Participant`` for ``source``'s framework.

    Args:
      source: a ``StateSource``, or anything with a ``framework`` class attribute (a class:
        it names the framework only, and the participant itself is returned).

    Returns:
      The ``Participant`` seen by ``source`` (``Participant.seen_by``), or None (no
      declaration, or the framework does not take part).

    Example:
      >>> from jaxoverride import adapter_kit as kit
      >>> kit.participant(kit.DictStateSource({})) is None
      True
    """
    entered = _solve_state.current_entered()
    if entered is None:
        return None
    framework = source.framework
    found = None if framework is None else entered.get(framework)
    return None if found is None else found.seen_by(source)


def _unsupported_running() -> list[str]:
    """The frameworks running now whose adapters registered no solve source: a
    declaration would silently not apply to them."""
    _frameworks.refresh()
    with _lock:
        known = set(_sources)
    return [r.title for r in _frameworks.scoped if r.key not in known and r.running()]


def _on_enter(declaration: solve_state) -> dict[str, Participant]:
    unsupported = _unsupported_running()
    if unsupported:
        raise NotImplementedError(
            f"jaxoverride.solve_state: {'; '.join(unsupported)}: its adapter does not apply "
            "solve_state declarations yet (it registers no solve source), so the declaration "
            "would be silently ignored. Draw the rng key before the solve and pass it through "
            "the map's arguments, and update mutable state once after the solve."
        )
    with _lock:
        sources = list(_sources.items())
    participants: dict[str, Participant] = {}
    for framework, make in sources:
        source = make()
        if source is not None:
            participants[framework] = Participant(declaration, framework, source)
    _check_names(declaration, participants)
    return participants


def _check_names(declaration: solve_state, participants: dict[str, Participant]) -> None:
    named = declaration.named("rng") + declaration.named("state")
    if not named or not participants:
        return
    if any(p.source.initializing() for p in participants.values()):
        return  # at init, collections are still being created
    unknown = [set(p.check_names()) for p in participants.values()]
    missing = set.intersection(*unknown) if unknown else set()
    if missing:
        known = sorted(
            {
                f"{part.kind} {name!r}"
                for p in participants.values()
                for part in _slots(p.source, p.snapshot)[1]
                if part is not None
                for name in part.names
            }
        )
        raise ValueError(
            f"jaxoverride.solve_state names {sorted(missing)}, which no running framework "
            f"has; the names here are {known}. Name an rng stream or a collection the "
            "model has (a Haiku model has one rng stream: pass rng= a str)."
        )


def _on_exit(declaration: solve_state, participants: dict[str, Participant], failed: bool) -> None:
    del declaration
    for entered in participants.values():
        entered.finish(failed)


def _on_map(
    entered: dict[str, Participant],
    fun: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """``jaxoverride.solver_map``'s call under a declaration: one evaluation for each
    framework that takes part and runs here (nested, in registration order)."""
    with _lock:
        makers = [(_sources.get(framework), found) for framework, found in entered.items()]
    policies = []
    for make, found in makers:
        source = None if make is None else make()
        if source is not None and found.frozen:
            policies.append(found.seen_by(source))

    def call(index: int) -> Any:
        if index == len(policies):
            return fun(*args, **kwargs)
        return policies[index].evaluation(lambda: call(index + 1))

    return call(0)


_solve_state.set_hooks(_on_enter, _on_exit, _on_map)
