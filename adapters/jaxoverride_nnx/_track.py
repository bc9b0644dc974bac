"""``track(*modules)``: the context manager that makes closure-captured modules work."""

from __future__ import annotations

from typing import Any

from flax.nnx import tracers

from jaxoverride import adapter_kit
from jaxoverride_nnx import _context, _framework as _framework  # registers "nnx" first
from jaxoverride_nnx._graph import is_graph_object
from jaxoverride_nnx._tracked import ACTIVE, ENTRY_TRACE, Scope, Tracked


class Track:
    """An entered or enterable ``track`` scope; returned by ``track``.

    Entering walks the modules' object graphs once, publishes the tracked set for the
    neutral functions of this thread or asyncio task and, unless the NNX overrides are
    already in effect, enters ``jaxoverride_nnx.context()``. Leaving undoes all three.
    The object may be entered again later and nested; it keeps its modules by weak
    reference, so a module that is deleted inside the scope can still be collected.

    Example:
      >>> import jaxoverride_nnx
      >>> from flax import nnx
      >>> layer = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
      >>> scope = jaxoverride_nnx.track(layer)
      >>> scope
      <jaxoverride_nnx.track(Linear)>
      >>> with scope:
      ...     len(jaxoverride_nnx.tracked_variables())
      2
      >>> scope.modules == (layer,)
      True
    """

    __slots__ = ("_entries", "_refs")

    def __init__(self, modules: tuple[Any, ...]):
        # A Scope builds the weak references; keep just enough to rebuild it.
        self._refs = Scope(modules).refs
        self._entries: list[tuple[Scope, tuple[Any, Any], Any, Tracked]] = []

    @property
    def modules(self) -> tuple[Any, ...]:
        """The tracked modules that are still alive."""
        return tuple(obj for ref in self._refs if (obj := ref()) is not None)

    def __enter__(self) -> Track:
        outer = ACTIVE.get()
        if outer is not None and outer.owner is None:
            raise RuntimeError(
                "jaxoverride_nnx.track was entered inside traced code (a function that a "
                "neutral transform is running). Enter it around the neutral call instead."
            )
        roots = list(outer.owner.roots() if outer is not None and outer.owner else ())
        for module in self.modules:
            if not any(module is root for root in roots):
                roots.append(module)
        scope = Scope(roots)
        try:
            tracked = scope.build()
            token = ACTIVE.set(tracked)
            entry = ENTRY_TRACE.set(tracers.current_jax_trace())
            try:
                activation = None if _context.layer_active() else _context.activation()
                if activation is not None:
                    activation.__enter__()
            except BaseException:
                ENTRY_TRACE.reset(entry)
                ACTIVE.reset(token)
                raise
        except BaseException:
            scope.close()
            raise
        self._entries.append((scope, (token, entry), activation, tracked))
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not self._entries:
            raise RuntimeError(f"jaxoverride_nnx: exiting {self!r}, which is not entered.")
        innermost = ACTIVE.get()
        if innermost is not self._entries[-1][3]:
            # Resetting the contextvar out of order would bring back a stale tracked set
            # (a later track() would also track this scope's modules): refuse, as
            # jaxoverride.override_context does.
            raise RuntimeError(
                f"jaxoverride_nnx: exiting {self!r}, but the innermost track scope in this "
                f"thread or task is {_describe_active(innermost)}. track scopes must exit in "
                "the reverse order of entry, in the thread or task that entered them; "
                "nothing was changed."
            )
        scope, (token, entry), activation, _ = self._entries.pop()
        try:
            if activation is not None:
                activation.__exit__(*exc_info)
        finally:
            ENTRY_TRACE.reset(entry)
            ACTIVE.reset(token)
            scope.close()

    def __repr__(self) -> str:
        names = ", ".join(type(m).__name__ for m in self.modules)
        return f"<jaxoverride_nnx.track({names})>"


def _describe_active(tracked: Tracked | None) -> str:
    if tracked is None:
        return "none"
    if tracked.owner is None:
        return "a traced call's (track was exited inside traced code)"
    names = ", ".join(type(root).__name__ for root in tracked.owner.roots())
    return f"track({names})"


def track(*modules: Any) -> Track:
    """Makes neutral functions work on code that reads and writes ``modules`` by closure.

    Within ``with track(model): ...`` every neutral transform and control-flow call
    (``jaxoverride.jit``, ``grad``, ``vmap``, ``lax.scan``, ``lax.while_loop``, ...) may
    run functions that use the modules: their Variables are threaded through the JAX
    transform as values, and afterwards the modules hold what eager Python execution
    would have left (counters, BatchNorm statistics, RNG streams advanced once per step),
    shared Variables and submodules still shared. ``jaxoverride.jit`` re-reads the weights
    on every call (never stale) and does not retrace on a cache hit. The graphs are walked
    here, once; setting an attribute of a tracked module (``model.eval()``) is noticed and
    the graph walked again on the next neutral call.

    Args:
      *modules: NNX graph nodes (Modules, ``nnx.Rngs``, ``nnx.List``, ...) or
        Variables. Track the top-level module: everything it holds is tracked with it.
        Variables created with ``ref=True`` or ``hijax=True`` work natively and are
        left alone.

    Returns:
      A ``Track`` context manager (re-enterable; nested scopes track the union).

    Raises:
      TypeError: an argument is not an NNX graph node or Variable.

    Example:
      >>> import jax.numpy as jnp, jaxoverride as jo, jaxoverride_nnx
      >>> from flax import nnx
      >>> class Counter(nnx.Module):
      ...     def __init__(self):
      ...         self.count = nnx.Variable(jnp.array(0))
      ...     def __call__(self, x):
      ...         self.count[...] += 1
      ...         return x + 1
      >>> model = Counter()
      >>> with jaxoverride_nnx.track(model):
      ...     x, _ = jo.lax.scan(lambda x, _: (model(x), None), 0, length=5)
      >>> int(x), int(model.count[...])
      (5, 5)
    """
    for index, module in enumerate(modules):
        if not is_graph_object(module):
            raise TypeError(
                f"jaxoverride_nnx.track expects NNX modules (graph nodes such as nnx.Module, "
                f"nnx.Rngs, nnx.List) or Variables, but argument {index} is "
                f"{type(module).__name__} {module!r:.60}. Pass the module object itself; "
                "plain arrays and pytrees need no tracking."
            )
    return Track(modules)


def tracked_variables() -> list[tuple[str, Any]]:
    """``(path, Variable)`` for every Variable that neutral calls thread here.

    Returns:
      An empty list outside ``track``.

    Example:
      >>> import jaxoverride_nnx
      >>> from flax import nnx
      >>> layer = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
      >>> with jaxoverride_nnx.track(layer):
      ...     [path for path, _ in jaxoverride_nnx.tracked_variables()]
      ['Linear.bias', 'Linear.kernel']
    """
    tracked: Tracked | None = ACTIVE.get()
    if tracked is None:
        return []
    return [(tracked.path(i), v) for i, v in enumerate(tracked.variables)]


def _is_tracked(obj: Any) -> bool:
    """Whether the active track scope threads ``obj`` (for the missing-adapter check)."""
    tracked: Tracked | None = ACTIVE.get()
    if tracked is None:
        return False
    # Tracked.contains, inline: the check asks this at every jitted call under track.
    key, graph = id(obj), tracked.graph
    return key in graph.node_ids or key in graph.var_ids or tracked.contains(obj)


adapter_kit.declare_handler("nnx", "jaxoverride_nnx", covers=_is_tracked)
