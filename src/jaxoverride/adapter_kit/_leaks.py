"""Finding framework state that a raw JAX transform left behind as dead tracers."""

from __future__ import annotations

from typing import Any

import jax
from jax.core import Tracer

from jaxoverride import _detect, _raw
from jaxoverride._compat import current_trace
from jaxoverride.errors import MissingAdapterError


def _live_traces() -> set[int]:
    """Ids of the current JAX trace and the traces it runs inside."""
    trace = current_trace()
    if trace is None:
        # Inside a primitive's rules (JAX 0.11+) no trace is current, so none is live: a
        # tracer there belongs to a trace that JAX's rule cannot reach (a Linen module's
        # rng key under the jit that runs the abstract evaluation), as after its end.
        return set()
    live: set[int] = set()
    while trace is not None and id(trace) not in live:
        live.add(id(trace))
        trace = getattr(trace, "parent_trace", None)
    return live


def escaped_tracers(tree: Any) -> list[Tracer]:
    """The tracers in ``tree`` whose JAX trace has ended: neither the current trace nor
    one it runs inside.

    Framework state (Haiku parameters and state) that a framework scope holds when the
    scope ends was made in that scope's trace or an outer one; a tracer of an ended trace
    was written from inside a JAX transform that the adapter never saw, and leaks out.

    Args:
      tree: a pytree, such as ``(frame.params, frame.state)``.

    Returns:
      Those tracers; empty when there are none, or when this JAX does not say. Inside a
      primitive's rules, where JAX 0.11 has no current trace, that is every tracer.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxoverride import adapter_kit
      >>> adapter_kit.escaped_tracers({"w": jnp.ones(2)})
      []
    """
    tracers = [leaf for leaf in jax.tree_util.tree_leaves(tree) if isinstance(leaf, Tracer)]
    if not tracers:
        return []
    live = _live_traces()
    return [t for t in tracers if id(getattr(t, "_trace", None)) not in live]


def raw_transform_error(framework: str, where: str, count: int) -> MissingAdapterError:
    """The error for state that a raw transform captured while an adapter was active.

    Names the imported libraries that still hold raw import-time transforms (the solver
    libraries, and any other imported package holding one, such as a library of the
    program's own with a module-level ``jax.jit``) and the ``interpose_on_import`` call
    that reaches them.

    Args:
      framework: the framework's name, such as ``"Haiku"``.
      where: the scope that ended, such as ``"hk.transform (init)"``.
      count: how many values escaped.

    Returns:
      A ``jaxoverride.errors.MissingAdapterError`` to raise.

    Example:
      >>> from jaxoverride import adapter_kit
      >>> error = adapter_kit.raw_transform_error("Haiku", "hk.transform", 2)
      >>> "interpose_on_import" in str(error)
      True
    """
    held = {**_raw.held_by_imported(), **_raw.held_by_other_imported()}
    if held:
        counts = ", ".join(f"{package!r} ({len(names)})" for package, names in held.items())
        builders = _raw.builders([name for names in held.values() for name in names])
        culprits = (
            f"These imported libraries hold transforms built with raw JAX while they were "
            f"imported: {counts}. Fix: call {_raw.fix_for([*held, *builders])}."
        )
    else:
        culprits = (
            "Fix: make the library that ran it call the neutral API: "
            "jaxoverride.interpose_on_import('package') before its first import, or "
            "jaxoverride.interpose(module) for one that calls jax.jit at call time."
        )
    return MissingAdapterError(
        f"{where} ended with {count} {framework} parameter or state value(s) that are "
        "tracers of a JAX trace that has ended: a transform built with raw JAX (not a "
        f"neutral one) ran {framework} code, so the adapter could not thread its state. "
        f"{culprits}{_detect._HATCH}"
    )


def adapter_check_on() -> bool:
    """Whether the missing-adapter check runs (``jaxoverride.set_adapter_check``).

    An adapter's own backstop (Haiku's check at the end of ``hk.transform``, Linen's at the
    end of a bound module's outermost call) asks this first, so that the one escape hatch
    turns every such check off.

    Returns:
      True unless the program turned the check off.

    Example:
      >>> import jaxoverride as jo
      >>> from jaxoverride import adapter_kit
      >>> previous = jo.set_adapter_check(False)
      >>> adapter_kit.adapter_check_on()
      False
      >>> _ = jo.set_adapter_check(previous)
    """
    return _detect.enabled
