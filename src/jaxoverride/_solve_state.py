"""The declaration around a solver call: what each evaluation of its map sees of the state.

The core only keeps the declarations (see ``solve_state`` and ``solver_map``); the
adapter kit applies them to the frameworks that register a state source with it
(``adapter_kit.register_solve_source``), telling the map's evaluations apart at its
boundaries (loop bodies, branches, transformed functions). With no such framework
running, a declaration changes nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar, cast

F = TypeVar("F", bound=Callable[..., Any])

PER_SOLVE = "per_solve"
AT_SOLUTION = "at_solution"
PER_EVALUATION = "per_evaluation"
RNG_POLICIES = (PER_SOLVE, PER_EVALUATION)
STATE_POLICIES = (AT_SOLUTION, PER_EVALUATION)

Policy = str | Mapping[Any, str]

# The declarations entered and not left, innermost last, each with what the kit's
# ``on_enter`` made of it.
_active: contextvars.ContextVar[tuple[tuple[solve_state, Any], ...]] = contextvars.ContextVar(
    "jaxoverride_solve_state", default=()
)

# Set by the adapter kit when it is imported (unset: nothing to apply). ``on_enter(
# declaration)`` returns what ``on_exit(declaration, entered, failed)`` receives;
# ``on_map(entered, fun, args, kwargs)`` runs ``fun(*args, **kwargs)`` as one evaluation
# of a solver's map under the innermost declaration (``entered``: what ``on_enter`` made).
_on_enter: Callable[[solve_state], Any] | None = None
_on_exit: Callable[[solve_state, Any, bool], None] | None = None
_on_map: Callable[[Any, Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any] | None = None


def set_hooks(
    on_enter: Callable[[solve_state], Any],
    on_exit: Callable[[solve_state, Any, bool], None],
    on_map: Callable[[Any, Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any],
) -> None:
    """Installs the kit's hooks (called once, by ``jaxoverride.adapter_kit``)."""
    global _on_enter, _on_exit, _on_map
    _on_enter, _on_exit, _on_map = on_enter, on_exit, on_map


def current() -> solve_state | None:
    """The innermost declaration entered and not left, or None."""
    active = _active.get()
    return active[-1][0] if active else None


def current_entered() -> Any:
    """What the kit's ``on_enter`` returned for the innermost declaration, or None."""
    active = _active.get()
    return active[-1][1] if active else None


@contextlib.contextmanager
def reentered(declaration: solve_state, entered: Any) -> Iterator[None]:
    """Makes ``declaration`` (with what the kit's ``on_enter`` made of it) the innermost
    again for the block, without entering or exiting it: for a backward rule, which JAX
    traces after the declaration of its forward call exited."""
    token = _active.set((*_active.get(), (declaration, entered)))
    try:
        yield
    finally:
        _active.reset(token)


def _checked(what: str, policy: Any, allowed: tuple[str, ...]) -> Policy:
    def check(value: Any, where: str) -> None:
        if value not in allowed:
            raise ValueError(
                f"jaxoverride.solve_state: {where} is {value!r}; expected one of "
                f"{list(allowed)}. Example: solve_state({what}={allowed[0]!r})."
            )

    if isinstance(policy, Mapping):
        for name, value in policy.items():
            if not isinstance(name, str | type):
                raise TypeError(
                    f"jaxoverride.solve_state: {what}= names {name!r}, a "
                    f"{type(name).__name__}; expected the name of a stream or collection "
                    "(a str), or a framework's state type (a class)."
                )
            check(value, f"{what}[{name!r}]")
        return dict(policy)
    check(policy, f"{what}=")
    return cast(str, policy)


def _name_of(key: Any) -> str:
    return key.__name__ if isinstance(key, type) else key


class solve_state:  # noqa: N801  (used as a context manager and a decorator, like a function)
    """Declares how a framework's rng and state behave across a solver's evaluations.

    Use it around a solver call, as a context manager or a decorator: every evaluation
    of the map inside (iterations, Jacobians, convergence checks, the implicit
    backward's) follows the declared policy, for every framework whose adapter is active.
    Outside every framework it changes nothing.

    Args:
      rng: ``"per_solve"`` (default: one key per solve; each evaluation draws the same
        keys, and the stream advances once) or ``"per_evaluation"`` (each evaluation
        draws new keys). Or a mapping from stream names (Linen, NNX) to those values;
        streams it does not name are per evaluation.
      state: ``"at_solution"`` (default: each evaluation starts from the state at entry,
        and the solve keeps what its last forward evaluation wrote) or
        ``"per_evaluation"``. Or a mapping from collection names (Linen), Variable types
        or their names (NNX) to those values; the others are per evaluation.

    Example:
      >>> import jax.numpy as jnp
      >>> import jaxoverride as jo
      >>> with jo.solve_state(rng="per_solve", state="at_solution"):
      ...     out = jo.lax.fori_loop(0, 3, lambda i, x: x + 1, jnp.float32(0))
      >>> float(out)  # no framework running: nothing changes
      3.0
    """

    __slots__ = ("_entered", "rng", "state")

    def __init__(self, rng: Policy = PER_SOLVE, state: Policy = AT_SOLUTION):
        self.rng: Policy = _checked("rng", rng, RNG_POLICIES)
        self.state: Policy = _checked("state", state, STATE_POLICIES)
        self._entered: list[tuple[contextvars.Token[Any], Any]] = []

    def policy(self, kind: str, names: tuple[str, ...]) -> str:
        """The policy of a piece of state: ``kind`` is ``"rng"`` or ``"state"``, ``names``
        the names it answers to (a stream, a collection, a Variable type and its bases)."""
        declared = self.rng if kind == "rng" else self.state
        if isinstance(declared, str):
            return declared
        for key, value in declared.items():
            if _name_of(key) in names:
                return value
        return PER_EVALUATION

    def named(self, kind: str) -> list[str]:
        """The names the declaration gives for ``kind`` (empty for the short form)."""
        declared = self.rng if kind == "rng" else self.state
        return [] if isinstance(declared, str) else [_name_of(k) for k in declared]

    def __enter__(self) -> solve_state:
        entered = None if _on_enter is None else _on_enter(self)
        token = _active.set((*_active.get(), (self, entered)))
        self._entered.append((token, entered))
        return self

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        token, entered = self._entered.pop()
        try:
            if _on_exit is not None and entered is not None:
                _on_exit(self, entered, kind is not None)
        finally:
            _active.reset(token)

    def __call__(self, fun: F) -> F:
        @functools.wraps(fun)
        def declared(*args: Any, **kwargs: Any) -> Any:
            with solve_state(self.rng, self.state):
                return fun(*args, **kwargs)

        return cast(F, declared)

    def __repr__(self) -> str:
        return f"solve_state(rng={self.rng!r}, state={self.state!r})"


class _SolverMap:
    """A function marked by ``solver_map``; equal to another marking of the same function
    (a solver that takes its map as a static argument of ``jit`` compiles once)."""

    def __init__(self, fun: Callable[..., Any]):
        self.__wrapped__ = fun
        with contextlib.suppress(AttributeError, TypeError):
            functools.update_wrapper(self, fun)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fun = self.__wrapped__
        entered = current_entered()
        if not entered or _on_map is None:
            return fun(*args, **kwargs)
        return _on_map(entered, fun, args, kwargs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _SolverMap) and other.__wrapped__ == self.__wrapped__

    def __hash__(self) -> int:
        return hash((_SolverMap, self.__wrapped__))

    def __repr__(self) -> str:
        return f"solver_map({self.__wrapped__!r})"


def solver_map(fun: F) -> F:
    """Marks ``fun`` as a solver's map: each call of the result is one evaluation of it.

    Under a ``solve_state`` declaration, adapters tell evaluations apart only at JAX's
    boundaries (a loop body, a branch), so Newton's ``g(z)`` then ``g(z_new)`` in one body
    would be one evaluation; each call of the marked function is one, starting from the
    state at the declaration's entry. Mark the map given to a solver
    (``fixed_point(jo.solver_map(f), z0)``), or, in a solver library, the map it is given;
    marking twice is marking once. With no declaration or framework taking part, a call
    is ``fun``'s call (the same jaxpr).

    Args:
      fun: the map, any callable.

    Returns:
      A callable with ``fun``'s signature and result, equal to (and hashing as) any
      other marking of ``fun``.

    Example:
      >>> import jax.numpy as jnp
      >>> import jaxoverride as jo
      >>> def g(z):
      ...     return 0.5 * jnp.cos(z)
      >>> f = jo.solver_map(g)
      >>> with jo.solve_state():  # no framework running: f is g
      ...     z = f(f(jnp.float32(0)))
      >>> round(float(z), 4), f == jo.solver_map(g)
      (0.4388, True)
    """
    return cast(F, fun if isinstance(fun, _SolverMap) else _SolverMap(fun))
