"""A base for state sources that install their state as a scope around each call.

Some frameworks cannot split "install the traced state" and "read it back" into the
``enter`` / ``leave`` pair of ``StateSource``: NNX points its Variables at traced values
for exactly the extent of one call. Such a source gives ``run_scoped`` instead, and
``ScopedStateSource`` supplies the rest of the protocol for a framework with no naming
state and no creation pass, with the functions handed to JAX reused across calls
(``reuse_key``, the kit's one mechanism for that: ``_handed``).

Stability: semi-public, as the rest of the kit.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any


class ScopedStateSource:
    """A ``StateSource`` whose subclass gives ``read``, ``run_scoped`` and ``write``.

    The threading combinators call ``run_scoped(state, fun, *args)`` in place of
    ``enter``, ``fun(*args)`` and ``leave``; it returns ``(out, state_after)``. The source
    never initialises, has no naming state, and asks for reused wrappers (``reuse_key``):
    since JAX then traces a body only once, what a trace finds out must be kept next to
    the function, not on the source (which lives for one call).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxoverride import adapter_kit as kit
      >>> store = {"n": jnp.int32(0)}
      >>> class Source(kit.ScopedStateSource):
      ...     def read(self):
      ...         return dict(store)
      ...     def run_scoped(self, state, fun, *args):
      ...         saved = dict(store)
      ...         store.update(state)
      ...         try:
      ...             return fun(*args), dict(store)
      ...         finally:
      ...             store.update(saved)
      ...     def write(self, state):
      ...         store.update(state)
      >>> def body(i, x):
      ...     store["n"] = store["n"] + i
      ...     return x
      >>> _ = kit.threaded_fori_loop(Source(), jax.lax.fori_loop, 0, 4, body, 0)
      >>> int(store["n"])
      6
    """

    __slots__ = ()

    def read(self) -> Any:
        """The state to thread, as a pytree of arrays."""
        raise NotImplementedError

    def run_scoped(self, state: Any, fun: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
        """``(fun(*args), state after)`` with ``state`` installed for the call only."""
        raise NotImplementedError

    def write(self, state: Any) -> None:
        """Stores ``state`` (the result of the JAX call) as the current state."""
        raise NotImplementedError

    def enter(self, state: Any) -> Any:
        """Not used: the combinators call ``run_scoped``."""
        raise TypeError(f"{type(self).__name__} installs its state through run_scoped only.")

    def leave(self, token: Any) -> Any:
        """Not used: the combinators call ``run_scoped``."""
        return self.enter(token)

    def abandon(self, token: Any) -> None:
        """Not used: the combinators call ``run_scoped``."""
        self.enter(token)

    def names(self) -> None:
        """No naming state."""

    def restore_names(self, names: Any) -> None:
        """No naming state."""

    def initializing(self) -> bool:
        """Never: no creation pass."""
        return False

    def create(self, thunk: Callable[[], Any]) -> None:
        """Runs ``thunk`` (never called: the source does not initialise)."""
        thunk()

    def reuse_key(self) -> Hashable:
        """Wrappers reused per user function and per source class: the source keeps no
        situation of its own (a subclass returns None for wrappers made per call)."""
        return type(self)
