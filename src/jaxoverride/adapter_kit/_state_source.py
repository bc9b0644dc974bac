"""The state contract: how a framework describes its implicit state to the kit.

A source reads the state, runs a function with it, and writes it back (``read``,
``run``, ``write``: the three required methods); the rest is optional, declared on
``StateSource`` with the defaults of a framework that has no such need: an init part
(``initializing``, ``create``, ``undo_creation``, ``init_call``), a naming part
(``names``, ``restore_names``, ``join_names``), flags (class attributes) and hooks.
``EnterLeaveSource`` gives ``run`` from an ``enter``/``leave``/``abandon`` triple.

Stability: semi-public, as the rest of the kit.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from jaxoverride.adapter_kit._solve_policy import StatePart


class StateSource:
    """The state contract: how a framework lets the kit thread its implicit state.

    A source is made per neutral call and describes the framework's state as it is at
    that call. Subclass it and give ``read()`` (the state, a pytree of arrays),
    ``run(state, fun, *args)`` (``fun(*args)`` with ``state`` installed; returns
    ``(out, state_after)``) and ``write(state)``. A combinator (``threaded_*``, and the
    transforms of ``stateful_transforms``) uses a source in this order:

    1. At init (``initializing()``, not inside an apply pass), ``init_call(call,
       two_pass)``, by default ``two_pass()``: the creation pass ``create(thunk)``, which
       calls each body or branch once outside JAX control flow, then the call as at apply
       under ``applying()``, so init returns what apply returns. If the call raises,
       ``undo_creation()`` removes what ``create`` kept.
    2. ``read()``: the state to thread, put into the carry, the operands or a leading
       argument.
    3. Per traced function: ``restore_names(start)``, ``run(traced state, fun, *args)``,
       ``names()`` (where its naming ended), the caller's names restored. The state left
       must keep the structure of the state entered (else ``StateStructureError``).
    4. ``retrace()``, then ``check_unknown_trips`` (a loop whose trip count is traced),
       then ``write(state)``; the caller's names continue from where the last traced
       function ended (``join_names`` of the branches' ends, with ``alternative_branches``).

    The optional parts default to a framework that has no such need; the methods say
    what each does. The ones that need more words:

    * ``create(thunk)`` keeps what the pass created (parameters, new state entries) and
      undoes the rest (state values, rng draws, naming counters); ``init_call`` is the
      source's own way to make parameters (Haiku creates them inside the one trace).
    * ``names()``: a copy of the Python state that decides how the framework names what
      it creates (module counters), so every trace of a function starts from the same
      names; function ``i`` starts where function ``i - 1`` ended (Haiku's order).
    * ``alternative_branches``: the branches of a ``cond``/``switch`` are the arms of an
      ``if``, each from the caller's names (two that create the same submodule share it,
      as in Linen's ``nn.cond``).
    * ``carried_predicate``: a ``while_loop`` tests before the loop (the test's writes
      kept) and at the end of each step; otherwise JAX traces ``cond_fun`` and only one
      that changes the state is moved into the body (NNX carries; Haiku, Linen do not).
    * ``retrace()``: a traced function met state ``read()`` did not include (Linen's
      ``sow`` in a loop body): the JAX call is discarded and run again (at most three
      times).
    * ``check_unknown_trips(state)``: state that exists only if the loop ran cannot
      come out of a loop whose trip count is traced; the source raises there.
    * ``reuse_key()``: a hashable summary of what the functions handed to JAX read
      besides their arguments; calls with an equal key reuse them, so an identical eager
      call compiles once. A reused function is not traced again on a JAX cache hit: what
      a trace finds out must be kept with the function, not on the source.
    * ``framework`` and ``parts(state)`` let a ``jaxoverride.solve_state`` apply
      (``_solve_policy``).

    Example:
      A source over a dict of arrays (``DictStateSource`` is one); the state is
      threaded through ``jax.lax.scan``'s carry:

      >>> import jax, jax.numpy as jnp
      >>> from jaxoverride.adapter_kit import StateSource, threaded_scan
      >>> store = {"count": jnp.int32(0)}
      >>> class Source(StateSource):
      ...     def read(self):
      ...         return dict(store)
      ...     def run(self, state, fun, *args):
      ...         saved = dict(store)
      ...         store.update(state)
      ...         try:
      ...             return fun(*args), dict(store)
      ...         finally:
      ...             store.update(saved)
      ...     def write(self, state):
      ...         store.update(state)
      >>> def body(c, x):
      ...     store["count"] = store["count"] + 1
      ...     return c + x, None
      >>> out, _ = threaded_scan(Source(), jax.lax.scan, body, 0.0, jnp.ones(3))
      >>> float(out), int(store["count"])
      (3.0, 3)
    """

    __slots__ = ()

    alternative_branches: ClassVar[bool] = False
    """Branches named as the arms of an ``if``, joined by ``join_names`` (Linen)."""
    carried_predicate: ClassVar[bool] = False
    """Every ``while_loop`` tests before the loop and at the end of each step (NNX)."""
    abort_changed_predicate: ClassVar[bool] = False
    """A state-changing ``cond_fun`` is found while JAX traces it (Haiku)."""
    framework: ClassVar[str | None] = None
    """For ``jaxoverride.solve_state``: the framework key the source registered its solve
    source under (``register_solve_source``); None: the declaration does not apply."""

    def read(self) -> Any:
        """The state to thread now, as a pytree of arrays (or tracers)."""
        raise NotImplementedError(f"{type(self).__name__} must define read()")

    def run(self, state: Any, fun: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
        """``(fun(*args), state after)``, with ``state`` (traced values, of ``read()``'s
        structure) the framework's state during the call and the caller's after it,
        also when ``fun`` raises."""
        raise NotImplementedError(f"{type(self).__name__} must define run()")

    def write(self, state: Any) -> None:
        """Stores ``state`` (the JAX call's result) as the framework's current state."""
        raise NotImplementedError(f"{type(self).__name__} must define write()")

    def initializing(self) -> bool:
        """Whether the framework is initialising, so that a creation pass runs first."""
        return False

    def create(self, thunk: Callable[[], Any]) -> None:
        """Runs the creation pass ``thunk``, keeping what it created and nothing else."""
        thunk()

    def undo_creation(self) -> None:
        """Removes what ``create`` kept, when the call after it raised."""

    def init_call(self, call: Callable[[], Any], two_pass: Callable[[], Any]) -> Any:
        """At init: the call, parameters made the source's way; by default ``two_pass()``."""
        return two_pass()

    def names(self) -> Any:
        """A copy of the framework's naming state, or None: no naming state."""
        return None

    def restore_names(self, names: Any) -> None:
        """Puts a copy made by ``names()`` back."""

    def join_names(self, ends: list[Any]) -> Any:
        """The names after alternative branches that ended in ``ends``."""
        return ends[-1]

    def retrace(self) -> bool:
        """Whether the JAX call just made must be discarded and run again."""
        return False

    def check_unknown_trips(self, state: Any) -> None:
        """Refuses ``state`` after a loop whose trip count is traced, if it must."""

    def reuse_key(self) -> Hashable:
        """The situation under which the functions handed to JAX are reused, or None."""
        return None

    def fresh_axes(self, axis: int) -> Any:
        """``vmap``'s ``out_axes`` for state first written in the mapped function."""
        return None

    def parts(self, state: Any) -> Sequence[StatePart | None] | None:
        """For ``jaxoverride.solve_state``: per leaf of ``state`` (``read()``'s, in
        ``jax.tree_util.tree_flatten`` order), what it is (an rng position or mutable state,
        its names, its slot: a ``StatePart``), or None where no declaration touches it
        (parameters). None (the default): the source describes nothing."""
        return None


def require_source(source: Any, where: str) -> StateSource:
    """``source``, refused with a ``TypeError`` unless it is a ``StateSource``."""
    if isinstance(source, StateSource):
        return source
    raise TypeError(
        f"{where}: the state source {source!r} is not a jaxoverride.adapter_kit.StateSource, "
        "whose defaults the kit calls; subclass StateSource (giving read, run and write) "
        "or EnterLeaveSource (read, enter, leave, abandon and write)."
    )


class EnterLeaveSource(StateSource):
    """A ``StateSource`` whose ``run`` is ``enter``, the function, then ``leave``.

    For a framework whose state can be installed and read back in two steps (Haiku's
    frame, Linen's collections): ``enter(state)`` installs it and returns a token,
    ``leave(token)`` returns the state the function left and puts the caller's values
    back, and ``abandon(token)`` puts them back after the function raised.

    Example:
      >>> from jaxoverride.adapter_kit import DictStateSource, EnterLeaveSource
      >>> issubclass(DictStateSource, EnterLeaveSource)
      True
    """

    __slots__ = ()

    def enter(self, state: Any) -> Any:
        """Makes ``state`` the framework's current state; returns a token for ``leave``."""
        raise NotImplementedError(f"{type(self).__name__} must define enter()")

    def leave(self, token: Any) -> Any:
        """The state the function left; the caller's values put back."""
        raise NotImplementedError(f"{type(self).__name__} must define leave()")

    def abandon(self, token: Any) -> None:
        """Puts the caller's values back after the function raised."""
        raise NotImplementedError(f"{type(self).__name__} must define abandon()")

    def run(self, state: Any, fun: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
        """``enter(state)``, ``fun(*args)``, then ``leave`` (``abandon`` if it raised)."""
        token = self.enter(state)
        try:
            out = fun(*args)
        except BaseException:
            self.abandon(token)
            raise
        return out, self.leave(token)


class ScopedStateSource(StateSource):
    """A ``StateSource`` that keeps no situation of its own: its wrappers are reused.

    For a source whose ``run`` installs the state for the extent of one call (NNX's
    Variables) and whose functions handed to JAX read nothing else: ``reuse_key()`` is
    the source's class, so an identical eager call is neither traced nor compiled again.
    Since JAX then traces a body only once, what a trace finds out must be kept next to
    the function, not on the source (which lives for one call).

    Example:
      >>> from jaxoverride import adapter_kit as kit
      >>> class Source(kit.ScopedStateSource):
      ...     pass
      >>> Source().reuse_key() is Source
      True
    """

    __slots__ = ()

    def reuse_key(self) -> Hashable:
        """The source's class (a subclass returns None for wrappers made per call)."""
        return type(self)


class DictStateSource(EnterLeaveSource):
    """The simplest ``StateSource``: a flat dict of arrays, threaded as a whole.

    Useful in tests and as the model for a framework's source. It never initialises and
    has no naming state.

    Args:
      store: the dict whose values are threaded; it is updated in place.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxoverride.adapter_kit import DictStateSource, StateSource
      >>> isinstance(DictStateSource({"x": jnp.zeros(())}), StateSource)
      True
    """

    def __init__(self, store: dict[str, Any]):
        self.store = store

    def read(self) -> Any:
        return dict(self.store)

    def enter(self, state: Any) -> Any:
        saved = dict(self.store)
        self.store.update(state)
        return saved

    def leave(self, token: Any) -> Any:
        after = dict(self.store)
        self.abandon(token)
        return after

    def abandon(self, token: Any) -> None:
        self.store.clear()
        self.store.update(token)

    def write(self, state: Any) -> None:
        self.store.update(state)
