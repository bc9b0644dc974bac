"""``jaxoverride.solve_state`` applied to a framework's state, once, for every adapter.

A framework takes part by registering a *solve source* (``register_solve_source``): a
function that returns the ``StateSource`` of the code running now, or None where the
framework is not running. Its sources declare ``framework`` (the key they registered
under) and ``parts(state)``: for each leaf of ``read()``'s state, a ``StatePart`` (an
rng stream or a piece of mutable state, with its names and a slot that identifies it
across reads), or None for what no policy touches (parameters).

When a declaration is entered, each registered framework running now gives a source;
its state is read once, the *entry snapshot*. The parts the declaration freezes (rng
``"per_solve"``, state ``"at_solution"``) are then handled at the kit's boundaries, in
``Threaded`` (every loop body, branch and transformed function an adapter runs through
it) and by the adapters' own boundaries through the same ``Participant``:

* **entering** a traced function (``freeze``): the frozen parts are the snapshot's, so
  every evaluation starts from the entry state whatever the carry holds;
* **writing** a JAX call's final state (``written``): the frozen parts written are the
  snapshot's again, so the next evaluation, even one called directly, starts from the
  entry state; the state the call left is kept as the innermost boundary's *last*;
* **leaving** a traced function (``left``): if the frozen parts are still the ones it
  entered with (nothing ran directly after its last inner call), it leaves its inner
  call's *last* instead, so the state an evaluation wrote flows out through the loop's
  carry;
* **exit**: the framework's state becomes what the last forward evaluation left (the
  scope's own *last*, or the live state if an evaluation ran directly after it): the
  stream advanced once, the statistics at the solution. A backward pass's writes
  (``written(..., backward=True)``) are dropped, never kept.

On an exception the entry snapshot is written back: a failed solve leaves the state as
it found it.

A framework whose boundaries describe their states in more than one way (NNX: a loop's
carry holds the Variables it touches, a ``jit`` the ones it is given) gets, from
``participant(source)``, a view whose ``parts`` are that source's (``seen_by``): the
slots, not the layouts, tie the states together. A boundary whose trace is cached (a
``jit``) rebases its frame (``push(entry)``): inside it, the frozen parts are the
traced function's own inputs (frozen at the call's read), never the snapshot's values,
which would be baked into the cached trace.

Evaluations are told apart by these boundaries: two direct calls of the map with no
neutral call between them are one run of the stream (the second continues where the
first ended), as they are in eager Python.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import threading
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import jax

from jaxoverride import _frameworks, _solve_state
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
    """One boundary being traced: the state the last call inside it left (and the
    source that describes it), for a rebased frame its own frozen parts, and whether it
    runs in a backward pass (whose writes are never kept)."""

    __slots__ = ("backward", "frozen", "last", "last_source")

    def __init__(self, frozen: dict[Hashable, Any] | None = None, backward: bool = False):
        self.last: Any = None
        self.last_source: Any = None
        self.frozen = frozen
        self.backward = backward


class Participant:
    """One framework's state under one declaration: the entry snapshot and the frames.

    Made when the declaration is entered; the kit's ``Threaded`` and an adapter's own
    boundaries call ``freeze``, ``push``/``pop``, ``written`` and ``left``.

    Args:
      declaration: the ``jaxoverride.solve_state`` entered.
      framework: the framework's key.
      source: its ``StateSource`` at entry (read once: the entry snapshot).

    Example:
      >>> import jax.numpy as jnp, jaxoverride as jo
      >>> from jaxoverride import adapter_kit as kit
      >>> class Source(kit.DictStateSource):
      ...     framework = "doc"
      ...     def parts(self, state):
      ...         return [kit.StatePart("state", ("mean",), "mean")]
      >>> store = {"mean": jnp.zeros(())}
      >>> policy = kit.Participant(jo.solve_state(), "doc", Source(store))
      >>> float(policy.freeze({"mean": jnp.ones(())})["mean"])
      0.0
    """

    __slots__ = (
        "_at_exit",
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
        state = source.read()
        leaves, parts, _ = _slots(source, state)
        self.snapshot = state
        # slot -> the leaf at entry, for the parts the declaration freezes
        self.frozen: dict[Hashable, Any] = {
            part.slot: leaf
            for leaf, part in zip(leaves, parts, strict=True)
            if part is not None and self._freezes(part)
        }
        self._frames: list[_Frame] = [_Frame()]
        self._closed = [False]  # shared with the views: set at the declaration's exit
        self._at_exit: dict[Hashable, Callable[[Any], Any]] = {}  # shared with the views

    def _freezes(self, part: StatePart) -> bool:
        return self.freezes(part.kind, part.names)

    def freezes(self, kind: str, names: tuple[str, ...]) -> bool:
        """Whether the declaration freezes the state of ``kind`` named ``names`` (rng per
        solve, state at the solution): every evaluation then sees the entry's, so a
        backward pass may draw or write it (its writes dropped) where it must otherwise
        refuse."""
        return self.declaration.policy(kind, names) in (PER_SOLVE, AT_SOLUTION)

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
        """Takes the frozen parts of ``state`` that did not exist at entry (created inside
        the declaration, e.g. at init) as their entry values, if no boundary is being
        traced (so that no traced value of an inner function is kept)."""
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
        """A new innermost boundary (a traced function starts). With ``entry`` (the
        state the traced function receives, its frozen parts already frozen), the frame
        is rebased: inside it, ``freeze`` gives ``entry``'s frozen parts. ``received``:
        the state it is handed before ``freeze`` (what the evaluations before it left),
        its *last* until an inner call writes: a function that runs no evaluation (a
        ``while_loop``'s test, a ``cond``'s no-op branch) passes it on. ``backward``: the
        boundary runs in a backward pass, and so does every boundary inside it."""
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
        """A boundary whose state comes out nowhere (``eval_shape``, a function converted
        into a jaxpr whose writes are dropped): what the JAX calls inside write is kept as
        its own last and dropped with it, never as an outer boundary's, which would then
        hand on a value of a trace that has ended (a leaked tracer)."""
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
        # is no evaluation, and must not replace the last one.
        keep = not (backward or frame.backward or self._closed[0])
        if keep and not self._untouched(state, self._entry()):
            frame.last, frame.last_source = state, self.source
        return self.freeze(state)

    def changed_per_evaluation(self, before: Any, after: Any) -> list[str]:
        """The names of the parts the declaration leaves per evaluation that ``after``
        changed from ``before``: in a function converted into a jaxpr such a write could
        not come out."""
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

    def _untouched(self, state: Any, frozen: dict[Hashable, Any]) -> bool:
        leaves, parts, _ = _slots(self.source, state)
        return all(
            part is None or part.slot not in frozen or frozen[part.slot] is leaf
            for leaf, part in zip(leaves, parts, strict=True)
        )

    def left(self, state: Any, frame: _Frame) -> Any:
        """What a traced function leaves: ``state``, or, where its frozen parts are still
        the entry's, what its last inner call left (merged part by part; with none, the
        state it was handed: see ``push``)."""
        last = frame.last
        entry = frame.frozen if frame.frozen is not None else self._entry()
        if last is None or not self.frozen or not self._untouched(state, entry):
            return state
        return self._merged(state, last, frame.last_source)

    def untouched(self, state: Any) -> bool:
        """Whether ``state``'s frozen parts are the entry's very objects (of the innermost
        rebased frame): what a traced function leaves when it evaluated nothing."""
        return self._untouched(state, self._entry())

    @contextlib.contextmanager
    def rebased(self, state: Any) -> Iterator[None]:
        """Inside, the innermost frame's frozen parts are ``state``'s (a value of a trace
        of its own, such as a custom rule's argument, which its caller froze), as
        ``push(entry=state)`` makes them."""
        frame = self._frames[-1]
        saved = frame.frozen
        frame.frozen = self._entries(state)
        try:
            yield
        finally:
            frame.frozen = saved

    def _entries(self, state: Any) -> dict[Hashable, Any]:
        leaves, parts, _ = _slots(self.source, state)
        return {
            part.slot: leaf
            for leaf, part in zip(leaves, parts, strict=True)
            if part is not None and part.slot in self.frozen
        }

    def current(self, state: Any) -> Any:
        """The state a JAX call starting now (``state``, read from the framework) hands
        its functions, or a boundary writes after its call: where the frozen parts are
        untouched, what the innermost boundary has as its last. So a ``cond`` in a loop
        body whose taken branch runs no evaluation passes on what the last evaluation
        left, not the entry state."""
        if not self.frozen:
            return state
        return self.left(state, self._frames[-1])

    def _merged(self, state: Any, last: Any, last_source: Any) -> Any:
        leaves, parts, treedef = _slots(self.source, state)
        last_leaves, last_parts, _ = _slots(last_source, last)
        by_slot = {
            part.slot: leaf
            for leaf, part in zip(last_leaves, last_parts, strict=True)
            if part is not None and part.slot in self.frozen
        }
        out = [
            by_slot.get(part.slot, leaf) if part is not None else leaf
            for leaf, part in zip(leaves, parts, strict=True)
        ]
        return jax.tree_util.tree_unflatten(treedef, out)

    def at_exit(self, key: Hashable, adjust: Callable[[Any], Any]) -> None:
        """Has the declaration's exit pass the state it writes through ``adjust`` (the
        last one given under ``key``): for what an evaluation did that no state can carry
        out, such as the draws of a map converted into a jaxpr, whose stream must still
        have advanced once at the exit. ``adjust`` runs at the exit, where ``freeze``
        gives the entry's frozen parts."""
        if not self._closed[0]:
            self._at_exit[key] = adjust

    def finish(self, failed: bool) -> None:
        """At the declaration's exit: the state the last forward evaluation left (or, on
        failure, the entry snapshot) becomes the framework's. Then the participant keeps
        no state value: a backward rule that captured it (and JAX's caches that hold the
        rule) must hold no tracer of the forward's trace; inside the rule the frozen
        parts are the rule's own inputs (``push(entry)``)."""
        try:
            if failed:
                self.source.write(self.snapshot)
            elif self.frozen:
                state = self.left(self.source.read(), self._frames[0])
                for adjust in self._at_exit.values():
                    state = adjust(state)
                self.source.write(state)
        finally:
            self._at_exit.clear()
            self._closed[0] = True
            self.snapshot = None
            self.frozen.update(dict.fromkeys(self.frozen))
            self._frames[:] = [_Frame()]

    def check_names(self) -> list[str]:
        """The names the declaration gives that none of this framework's parts has."""
        leaves, parts, _ = _slots(self.source, self.snapshot)
        del leaves
        known = {(part.kind, name) for part in parts if part is not None for name in part.names}
        return [
            f"{kind} {name!r}"
            for kind in KINDS
            for name in self.declaration.named(kind)
            if (kind, name) not in known
        ]


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


def participant(source: Any) -> Participant | None:
    """The innermost declaration's ``Participant`` for ``source``'s framework.

    Args:
      source: a ``StateSource`` (its ``framework`` attribute names the framework).

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
    framework = getattr(source, "framework", None)
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


_solve_state.set_hooks(_on_enter, _on_exit)
