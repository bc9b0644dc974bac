"""Every Flax difference across the supported range (``flax>=0.12.1,<0.13``), in one place.

The adapter reads Flax NNX internals, which is why ``pyproject.toml`` bounds Flax above.
Within the range: ``flax.nnx.graphlib`` is ``flax.nnx.graph`` before Flax 0.12.5;
``graphlib.DataElem`` / ``StaticElem`` (0.12.5+) mark a node's items as data or static
(earlier releases wrap nothing, so here they stand for classes nothing is an instance
of); a Variable's ``on_get_value`` metadata may be a tuple of hooks from Flax 0.12.7, a
single callable before (``chain_on_get_value`` builds one callable every release takes).

One JAX difference needs no branch: from JAX 0.12 ``lax.custom_root`` traces its
functions through ``jax.jit``'s cache, so a tracked Variable read there is inside a jit
trace; the adapter hands JAX a fresh function per call, its trace marked as its own
(``_convert._pure``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

try:
    from flax.nnx import graphlib as graphlib
except ImportError:  # Flax < 0.12.5: the same module under its old name.
    from flax.nnx import graph as graphlib  # type: ignore[no-redef]


class _NeverWrapped:
    """Stands for an item wrapper that this Flax release does not have."""

    value: Any


DataElem: type = getattr(graphlib, "DataElem", _NeverWrapped)
StaticElem: type = getattr(graphlib, "StaticElem", _NeverWrapped)


def chain_on_get_value(first: Callable[[Any, Any], Any], old: Any) -> Callable[[Any, Any], Any]:
    """One ``on_get_value`` hook that runs ``first``, then the hooks that were there.

    Args:
      first: a hook ``(variable, value) -> value`` to run before the others.
      old: the Variable's previous ``on_get_value`` metadata: None, a hook, or a tuple
        of hooks.

    Returns:
      A single hook, which every supported Flax release accepts.

    Example:
      >>> from jaxoverride_nnx._compat import chain_on_get_value
      >>> hook = chain_on_get_value(lambda v, x: x + 1, (lambda v, x: x * 10,))
      >>> hook(None, 1)
      20
    """
    hooks = () if old is None else old if isinstance(old, tuple) else (old,)

    def chained(variable: Any, value: Any) -> Any:
        value = first(variable, value)
        for hook in hooks:
            value = hook(variable, value)
        return value

    return chained


_FLAX_GRAPH = (
    "the walk of a module graph as nnx.split does it, without its cost "
    "(module flax.nnx.graph before Flax 0.12.5)"
)

PRIVATE_SYMBOLS: dict[str, str] = {
    "flax.nnx.graphlib.GRAPH_REGISTRY": _FLAX_GRAPH,
    "flax.nnx.graphlib.GraphNodeImpl": _FLAX_GRAPH,
    "flax.nnx.graphlib.get_node_impl": _FLAX_GRAPH,
    "flax.nnx.graphlib.DataElem": _FLAX_GRAPH,
    "flax.nnx.graphlib.StaticElem": _FLAX_GRAPH,
    "flax.nnx.variablelib.HijaxVariable": "Variables of nnx.var_defaults(hijax=True)",
    "flax.nnx.variablelib.is_array_ref": "a Variable's value that is an array reference",
    "flax.nnx.pytreelib.PytreeState": "a module's trace state, re-pointed at the adapter's trace",
    "flax.nnx.tracers.TraceState": "the trace a Variable records, re-pointed likewise",
    "flax.nnx.tracers.current_jax_trace": "the trace that a Variable write compares against",
}
"""Every private upstream name the NNX adapter uses, with why no public name serves.

Read in Flax 0.12.0 (``graph``), 0.12.7, 0.12.8 and 0.12.10 (tested) and main at 0.12.8
(2026-07-02), and for the JAX names in JAX 0.8.1, 0.10.2 and 0.11.2 (tested), 0.11.0, main
at 0.11.1.dev (2026-08-08) and 0.12.0. ``ci/private_symbols.py`` re-checks them against
git checkouts; ``tests/test_private_symbols.py`` fails when the adapter uses a private
name not listed here, or one that has a public name.
"""


RAW_VALUE = "_raw_value"
"""The name of ``flax.nnx.Variable``'s slot that holds its value (see
``PRIVATE_ATTRIBUTES``)."""

PRIVATE_ATTRIBUTES: dict[str, str] = {
    "flax.nnx.Variable._raw_value": (
        "the value slot, read and written without NNX's per-access checks and hooks: the "
        "adapter threads the raw values (_graph.RAW), and a repeated jitted call reads every "
        "lifted Variable through it (``operator.attrgetter``: ``get_raw_value()`` is a Python "
        "call, and ``Variable.__getattr__`` keeps Python from specialising the read)"
    ),
    "flax.nnx.Variable._trace_state": "the trace a Variable's write is checked against",
    "flax.nnx.Variable._var_metadata": (
        "the dict that Variable.get_value reads its 'on_get_value' hooks from. A custom "
        "rule's reads of differentiated Variables (_rules) and, under track, reads inside a "
        "raw jax.jit trace (_stale_reads) are refused at the read itself; NNX's public "
        "route (nnx.Variable(..., on_get_value=...)) sets hooks only at construction, and "
        "warns there that hooks are deprecated. In Flax 0.12.1 to 0.12.8 and main, "
        "get_value runs the hooks on every user read (v[...], v.value, jnp.asarray(v), "
        "arithmetic), and get_raw_value and the _raw_value slot run none"
    ),
}
"""Private attributes of Flax objects the NNX adapter uses, with why no public one serves.

They are slots of ``Variable`` in every supported release (read in Flax 0.12.8 and in an
older and a newer upstream ``variablelib.py``; ``make test-oldest`` runs Flax 0.12.1).
``_graph`` takes their descriptors from ``Variable.__dict__``, so a release without them
fails at import; the jit's plan reads ``_raw_value`` by name only where that name is still
the slot (``_jit._reads_the_slot``).

Hooks are put on only while a ``track`` scope is entered and taken off at its exit. A copy
of a Variable made under ``track`` (``nnx.split``, ``nnx.state``) keeps the read check,
which does nothing outside ``track`` or for a Variable that is not tracked.
"""


__all__ = [
    "PRIVATE_ATTRIBUTES",
    "PRIVATE_SYMBOLS",
    "RAW_VALUE",
    "DataElem",
    "StaticElem",
    "chain_on_get_value",
    "graphlib",
]
