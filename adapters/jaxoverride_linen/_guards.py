"""Read and write guards on Linen's scopes, for the implicit-differentiation rules.

Three hooks (on ``Scope`` while the adapter is in use; one thread-local read when idle):

* **lifted reads**: while a rule's function runs, ``Scope.get_variable`` returns the
  values the rule passed to JAX as an argument, not the caller's closed-over tracers;
* **refused reads**: reading a variable being differentiated inside a rule raises
  ``ClosedOverDifferentiationError``;
* **refused writes**: inside a function JAX makes pure, ``put_variable`` and ``make_rng``
  raise ``PureFunctionWriteError``; loops inside thread no key, and what they write back
  is put back afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

from flax.core import scope as core_scope

from jaxoverride import adapter_kit as kit
from jaxoverride_linen import _trees as trees
from jaxoverride_linen._errors import ClosedOverDifferentiationError, PureFunctionWriteError
from jaxoverride_linen._per_thread import local as _local

Scope = core_scope.Scope


class _Lifted(NamedTuple):
    """The values that reads of one root scope see while a rule's function runs."""

    params: Any
    refused: frozenset[tuple[str, ...]]
    where: str
    # The ``params`` paths the rule was not given (a staged ``custom_jvp``): reads refused.
    left_out: frozenset[tuple[str, ...]] = frozenset()


def guard_get_variable(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Scope.get_variable`` seeing a rule's lifted values, refusing differentiated ones."""

    def get_variable(self: Scope, col: str, name: str, default: Any = None) -> Any:
        frames = _local.lifted
        if not frames:
            return original(self, col, name, default)
        lifted = frames[-1].get(id(self.root._variables))
        if lifted is None:
            return original(self, col, name, default)
        path = (*self.path, name)
        full = (col, *path)
        if any(full == refused[: len(full)] for refused in lifted.refused):
            what = f"the Linen variable {'/'.join(full)!r}"
            raise ClosedOverDifferentiationError.reading(lifted.where, what)
        if col == "params":
            value = trees.get_path(lifted.params, path)
            if value is not trees.MISSING:
                return value
            if path in lifted.left_out:
                what = f"the Linen parameter {'/'.join(('params', *path))!r}"
                raise kit.StagedPrimal.unused_read_error(lifted.where, what)
        return original(self, col, name, default)

    return get_variable


@contextlib.contextmanager
def lifted_reads(
    roots: Sequence[Any],
    params: Sequence[Any],
    refused: Sequence[frozenset],
    where: str,
    left_out: Sequence[frozenset] | None = None,
) -> Iterator[None]:
    """Reads of ``roots`` see ``params``; reads of the ``refused`` paths raise.

    Args:
      roots: the root scopes' variable dicts (``_Root.variables``), one per root.
      params: each root's ``params`` tree, as the rule received it.
      refused: each root's paths ``(collection, *path)`` being differentiated.
      where: the neutral name, for the error.
      left_out: each root's ``params`` paths that the rule was not given (reads raise);
        none by default.
    """
    frames = _local.lifted
    frame = dict(frames[-1]) if frames else {}
    left_out = left_out or [frozenset()] * len(roots)
    for variables, tree, paths, unused in zip(roots, params, refused, left_out, strict=True):
        outer = frame.get(id(variables))
        # A rule inside a rule: what the outer one was not given or refuses stays so.
        unused = unused | (outer.left_out if outer is not None else frozenset())
        if outer is not None and outer.refused - paths:
            frame[id(variables)] = _Lifted(tree, paths | outer.refused, outer.where, unused)
        else:
            frame[id(variables)] = _Lifted(tree, paths, where, unused)
    frames.append(frame)
    try:
        yield
    finally:
        frames.pop()


def lifted_params(variables: Any) -> Any:
    """The ``params`` that reads of the root with these ``variables`` see now, or ``None``
    outside every rule (a nested rule lifts the values its caller sees, not the scope's)."""
    frames = _local.lifted
    lifted = frames[-1].get(id(variables)) if frames else None
    return None if lifted is None else lifted.params


# -- pure functions ----------------------------------------------------------------------


class _Pure(NamedTuple):
    roots: frozenset[int]
    where: str
    inside: str
    reason: str
    writes: bool  # whether writes are refused too, not only draws
    # ("rng", stream) and ("state", collection) that a ``jaxoverride.solve_state``
    # freezes: drawn from its entry key, written and dropped (``_declared``).
    allowed: frozenset[tuple[str, str]]

    def error(self, what: str) -> PureFunctionWriteError:
        return PureFunctionWriteError(
            f"{self.where}: {what} inside {self.inside}. " + self.reason.format(where=self.where)
        )


def _pure_guard(scope: Scope, writing: bool = False) -> _Pure | None:
    """The innermost guard over ``scope``'s root (that refuses writes, if ``writing``)."""
    guards = _local.pure
    if not guards:
        return None
    root = id(scope.root._variables)
    for guard in reversed(guards):
        if root in guard.roots and (guard.writes or not writing):
            return guard
    return None


def guard_put_variable(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Scope.put_variable`` refusing a write inside a function JAX makes pure."""

    def put_variable(self: Scope, col: str, name: str, value: Any) -> None:
        guard = _pure_guard(self, writing=True)
        allowed = guard is not None and ("state", col) in guard.allowed
        if guard is not None and not allowed and self.is_mutable_collection(col):
            where = "/".join((col, *self.path, name))
            raise guard.error(f"the Linen variable {where!r} was written")
        original(self, col, name, value)

    return put_variable


def guard_make_rng(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Scope.make_rng`` refusing a draw inside a function JAX makes pure."""

    def make_rng(self: Scope, name: str = "params") -> Any:
        guard = _pure_guard(self)
        if guard is not None and ("rng", stream(self, name)) not in guard.allowed:
            raise guard.error(f"an rng key was drawn (make_rng({name!r}))")
        return original(self, name)

    return make_rng


def stream(scope: Scope, name: str) -> str:
    """The stream ``make_rng(name)`` draws from (Linen falls back on ``params``)."""
    return name if name in scope.rngs or "params" not in scope.rngs else "params"


@contextlib.contextmanager
def hidden_rngs(roots: Sequence[Any]) -> Iterator[None]:
    """The roots' rng streams hidden: the state threading reads no key (draws none)."""
    saved = [(root, dict(root.rngs)) for root in roots]
    for root in roots:
        root.rngs.clear()
    try:
        yield
    finally:
        for root, rngs in saved:
            root.rngs.update(rngs)


@contextlib.contextmanager
def pure(
    roots: Sequence[Any],
    where: str,
    inside: str,
    reason: str,
    writes: bool = True,
    allowed: frozenset[tuple[str, str]] = frozenset(),
    keep_allowed: bool = False,
) -> Iterator[None]:
    """Refuses rng draws (and, if ``writes``, variable writes) through the roots ``roots``.

    Args:
      roots: the adapter's roots (each with ``variables`` and ``rngs``).
      where: the neutral name, for the error.
      inside: the function, for the error (``"the function being converted"``).
      reason: why nothing written there could come out, and the fix (``{where}`` filled in).
      writes: refuse writes too; what loops inside leave is then put back on exit.
      allowed: ``("rng", stream)`` and ``("state", collection)`` let through (what a
        ``jaxoverride.solve_state`` freezes); their writes are put back on exit too, unless
        ``keep_allowed`` (``kit.declared_closure_convert`` reads them).
    """
    saved = [
        (tree, path, value)
        for root in roots
        for col, tree in root.variables.items()
        if writes and col != "params" and isinstance(tree, dict)
        if not (keep_allowed and ("state", col) in allowed)
        for path, value in trees.paths(tree)
    ]
    guards = _local.pure
    ids = frozenset(id(root.variables) for root in roots)
    guards.append(_Pure(ids, where, inside, reason, writes, allowed))
    try:
        with hidden_rngs(roots):  # nothing to draw: loops inside thread no key
            yield
    finally:
        guards.pop()
        for tree, path, value in saved:
            trees.put_path(tree, path, value)
