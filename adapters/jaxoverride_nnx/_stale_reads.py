"""Under ``track``: a tracked Variable read inside a raw ``jax.jit`` trace is refused.

A ``jax.jit`` that the adapter never sees (a library's module-level ``jax.jit(_solve)``)
would bake a closed-over module's weights in as constants and later serve the old ones.
A write raises Flax's ``TraceContextError``; a read leaves no trace, so it is checked
where it happens: while a ``track`` scope is entered, each tracked Variable carries an
``on_get_value`` hook. Neutral transforms swap tracers into the raw values before running
user code, so a concrete value read inside a jit trace (``adapter_kit.jit_traces``) that
the adapter did not start (``own_jit_trace``) is one raw JAX is baking in. The adapter
reads the raw slot, which runs no hook; what a neutral call inside a raw jit carries is
checked by ``check_lifted`` instead.

Let through on purpose: reads under raw ``jax.grad``, ``vmap`` and the other transforms
that cache nothing, and in raw ``lax.scan``/``while_loop``/``cond`` bodies outside any jit
(JAX keys those on the body object: a body built per call, the usual idiom, reads the
current weights, and its read looks the same as a stale one's).
"""

from __future__ import annotations

import contextvars
import functools
import threading
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

import jax
from jax.core import Tracer

from jaxoverride import adapter_kit
from jaxoverride_nnx._compat import chain_on_get_value
from jaxoverride_nnx._graph import RAW
from jaxoverride_nnx._probes import check_given

_GET = RAW.__get__
_KEY = "on_get_value"
_ABSENT = object()

# The jit traces that the adapter's own overrides started, in this thread or task.
_OWN: contextvars.ContextVar[tuple[Any, ...]] = contextvars.ContextVar(
    "jaxoverride_nnx_own_jit_traces", default=()
)

_lock = threading.Lock()
# id(Variable) -> [Variable, the metadata dict hooked, its previous hook or _ABSENT,
# the hook installed, holders]
_hooked: dict[int, list[Any]] = {}
# One chained hook per previous hook, so a Variable's metadata (part of its pytree
# structure and of nnx.split's graph definition) is the same at every entry of track:
# a raw jit or nnx.jit given the module retraces once under track, not at every entry.
_chained: dict[Any, Callable[[Any, Any], Any]] = {}
_CHAINED_LIMIT = 256


# The tracked set here (``_tracked.ACTIVE.get``): set by ``_tracked`` at its import, since
# ``_tracked`` hooks through this module and imports point one way.
tracked_now: Callable[[], Any] = lambda: None


def _refuse(variable: Any) -> None:
    """Raises if ``variable``, read here, is a tracked Variable baked in by a raw jit."""
    if not adapter_kit.adapter_check_on():
        return
    tracked = tracked_now()
    if tracked is None:
        return
    index = tracked.var_index(variable)
    if index is None:
        return
    if all(isinstance(leaf, Tracer) for leaf in jax.tree_util.tree_leaves(_GET(variable))):
        return
    raise adapter_kit.raw_read_error(
        f"jaxoverride_nnx.track: the tracked Variable `{tracked.path(index)}`", "Flax NNX"
    )


def _in_raw_jit(traces: Sequence[Any]) -> bool:
    """Whether one of the jit ``traces`` is not one of the adapter's own."""
    own = _OWN.get()
    return any(all(trace is not mine for mine in own) for trace in traces)


def check_read(variable: Any, value: Any) -> Any:
    """The ``on_get_value`` hook: ``value`` unchanged, unless a raw jit is baking it in.

    Args:
      variable: the Variable being read.
      value: what NNX read (after indexing).

    Returns:
      ``value``.

    Raises:
      jaxoverride.errors.MissingAdapterError: the read is inside a ``jax.jit`` trace
        that no adapter started, under the ``track`` scope of this thread or task.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxoverride_nnx._stale_reads import check_read
      >>> float(check_read(nnx.Param(jnp.ones(())), 2.0))
      2.0
    """
    # The raw slot, not ``value``: an indexed read (``v[0]``) inside a trace gives a
    # tracer of that trace even where the Variable holds a constant.
    raw = _GET(variable)
    if not isinstance(raw, Tracer):
        traces = adapter_kit.jit_traces()
        if traces:
            # A probe is the adapter's own placeholder, in a trace that it started (a
            # module the traced function reaches by a path its first guess missed, such
            # as an object's attribute): never baked in, but traced again with the
            # module given (``NeedsState``).
            check_given((raw,))
            if _in_raw_jit(traces):
                _refuse(variable)
    return value


def check_lifted(
    tracked: Any,
    indices: Iterable[int],
    values: Iterable[Any],
    reached: Callable[[], Collection[int]],
) -> None:
    """Raises if a neutral call inside a raw ``jax.jit`` trace is about to carry tracked
    Variables' concrete values into it, for a module that the call's functions reach.

    The adapter reads the values it threads from the raw slot, which runs no hook, so
    they are checked here as ``check_read`` checks a user read. Only the modules that
    the call's functions and arguments refer to count: a library's one ``jo.jit`` keeps
    one build per tracked set and may carry values that its function never reads.

    Args:
      tracked: the tracked set the call lifts from.
      indices: the positions in ``tracked`` of the values carried.
      values: those values, now.
      reached: returns the positions of the tracked values of the modules that the
        call's functions and arguments refer to (``_touched.referenced``).

    Raises:
      jaxoverride.errors.MissingAdapterError: one of them is a concrete Variable value
        of a module the call reaches, and the call runs inside a ``jax.jit`` trace that
        no adapter started.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxoverride_nnx._stale_reads import check_lifted
      >>> check_lifted(None, [0], [jnp.ones(())], frozenset)  # outside every jit: nothing
    """
    if not _in_raw_jit(adapter_kit.jit_traces()) or not adapter_kit.adapter_check_on():
        return
    count = len(tracked.variables)
    near: Collection[int] | None = None
    for index, value in zip(indices, values, strict=True):
        check_given((value,))  # a probe: the module is traced again, given (see check_read)
        leaves = jax.tree_util.tree_leaves(value)
        if index >= count or all(isinstance(leaf, Tracer) for leaf in leaves):
            continue
        if near is None:
            near = reached()
        if index in near:
            raise adapter_kit.raw_read_error(
                f"jaxoverride_nnx.track: the tracked Variable `{tracked.path(index)}` "
                "(carried by a neutral call made there)",
                "Flax NNX",
            )


def own_jit_trace(fun: Callable[..., Any]) -> Callable[..., Any]:
    """``fun``, run with the jit trace that runs it marked as the adapter's own.

    For a function that an override traces afresh at each call (``make_jaxpr`` under
    ``track``), where reading the current values as constants is right. A raw jit around
    it, or inside it, still counts.
    """

    @functools.wraps(fun)
    def marked(*args: Any, **kwargs: Any) -> Any:
        traces = adapter_kit.jit_traces()
        token = _OWN.set((*_OWN.get(), *traces[:1]))
        try:
            return fun(*args, **kwargs)
        finally:
            _OWN.reset(token)

    return marked


def _hook_for(previous: Any) -> Callable[[Any, Any], Any]:
    if previous is _ABSENT:
        return check_read
    try:
        hook = _chained.get(previous)
    except TypeError:  # an unhashable hook sequence: chain it afresh
        return chain_on_get_value(check_read, previous)
    if hook is None:
        if len(_chained) >= _CHAINED_LIMIT:  # bounded: hooks made per Variable would grow it
            _chained.clear()
        hook = _chained[previous] = chain_on_get_value(check_read, previous)
    return hook


def hook(variables: Sequence[Any]) -> list[int]:
    """Puts the read check on ``variables``; returns what ``unhook`` takes off.

    A Variable hooked by several entered scopes (nested ``track``) keeps one hook until
    the last of them exits.
    """
    taken: list[int] = []
    try:
        with _lock:
            for variable in variables:
                entry = _hooked.get(id(variable))
                if entry is None:
                    metadata = variable._var_metadata
                    previous = metadata.get(_KEY, _ABSENT)
                    installed = _hook_for(previous)
                    metadata[_KEY] = installed
                    _hooked[id(variable)] = entry = [variable, metadata, previous, installed, 0]
                entry[4] += 1
                taken.append(id(variable))
    except BaseException:
        unhook(taken)  # a failed entry leaves every Variable as it was
        raise
    return taken


def unhook(taken: Sequence[int]) -> None:
    """Takes off the hooks that ``hook`` put on, leaving each Variable's metadata as it was.

    A hook that the program replaced meanwhile (``nnx.update`` with another metadata) is
    left alone.
    """
    with _lock:
        for ident in reversed(taken):
            entry = _hooked[ident]
            entry[4] -= 1
            if entry[4]:
                continue
            del _hooked[ident]
            variable, metadata, previous, installed = entry[:4]
            # Flax may have replaced the metadata dict meanwhile (``update_from_state``
            # with a state taken under track, which carries the hook): restore both.
            current = variable._var_metadata
            for held in (metadata,) if current is metadata else (metadata, current):
                if held.get(_KEY, _ABSENT) is not installed:
                    continue
                if previous is _ABSENT:
                    del held[_KEY]
                else:
                    held[_KEY] = previous
