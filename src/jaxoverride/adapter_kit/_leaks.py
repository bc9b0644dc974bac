"""Finding framework state that a raw JAX transform left behind as dead tracers."""

from __future__ import annotations

from typing import Any

import jax
from jax.core import Tracer

from jaxoverride import _detect, _raw
from jaxoverride._compat import current_trace, staged_for
from jaxoverride._words import counted
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


def _culprits() -> str:
    """The imported libraries holding raw import-time transforms, and the call that fixes
    them (a library of the program's own with a module-level ``jax.jit`` included)."""
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
    return culprits


def raw_transform_error(framework: str, where: str, count: int) -> MissingAdapterError:
    """The error for state that a raw transform captured while an adapter was active.

    Names the imported libraries that still hold raw import-time transforms and the
    ``interpose_on_import`` call that reaches them.

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
    culprits = _culprits()
    values = counted(
        count,
        f"{framework} parameter or state value that is a tracer",
        f"{framework} parameter or state values that are tracers",
    )
    return MissingAdapterError(
        f"{where} ended with {values} of a JAX trace that has ended: a transform built "
        f"with raw JAX (not a neutral one) ran {framework} code, so the adapter could not "
        "thread its state. "
        f"{culprits}{_detect._HATCH}"
    )


def adapter_check_on() -> bool:
    """Whether the missing-adapter check runs (``jaxoverride.set_adapter_check``).

    An adapter's own backstop (Haiku's at the end of ``hk.transform``) asks this first, so
    that the one escape hatch turns every such check off.

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


# Bounds the walk up a trace's parents: a chain is a few traces deep; a cycle would be a
# JAX bug, and must not hang a Variable read.
_MAX_DEPTH = 10_000


def jit_traces() -> list[Any]:
    """The traces that ``jax.jit`` started and the code running now runs inside, innermost
    first; empty outside every such trace.

    ``jax.jit`` caches what it traced with the constants it closed over: a framework value
    read there as a concrete array is baked in and silently reused later. The traces of
    ``jax.eval_shape`` and ``jax.make_jaxpr`` (which go through jit's cache) and of the
    jits a neutral ``jit`` runs are listed too; those of ``grad``, ``vmap`` and the other
    transforms that run at each call, and raw control-flow bodies, are not.

    Returns:
      The trace objects, to compare by identity (an adapter may remember the one that
      its own override started).

    Example:
      >>> import jax
      >>> from jaxoverride import adapter_kit
      >>> seen = []
      >>> def f(y):
      ...     seen.append(len(adapter_kit.jit_traces()))
      ...     return y
      >>> _ = jax.jit(jax.grad(f))(1.0), jax.grad(f)(1.0)
      >>> seen, adapter_kit.jit_traces()
      ([1, 0], [])
    """
    # Under ``jaxoverride_nnx.track`` this runs at every eager read of a tracked Variable:
    # outside every transform the current trace stages nothing and has no parent.
    trace = current_trace()
    parent = getattr(trace, "parent_trace", None)
    if parent is None and staged_for(trace) != "jit":
        return []
    found = []
    depth = 0
    while trace is not None and depth < _MAX_DEPTH:
        if staged_for(trace) == "jit":
            found.append(trace)
        trace = getattr(trace, "parent_trace", None)
        depth += 1
    return found


def raw_read_error(what: str, framework: str) -> MissingAdapterError:
    """The error for framework state read, as a concrete value, inside a raw ``jax.jit``.

    Names the imported libraries that still hold raw import-time transforms and the
    ``interpose_on_import`` call that reaches them, as ``raw_transform_error`` does.

    Args:
      what: what was read, such as ``"the tracked Variable `Linear.kernel`"``.
      framework: the framework's name, such as ``"Flax NNX"``.

    Returns:
      A ``jaxoverride.errors.MissingAdapterError`` to raise.

    Example:
      >>> from jaxoverride import adapter_kit
      >>> error = adapter_kit.raw_read_error("the tracked Variable `w`", "Flax NNX")
      >>> "interpose_on_import" in str(error)
      True
    """
    return MissingAdapterError(
        f"{what} was read inside a trace of jax.jit that no adapter started: a transform "
        "built with raw JAX (a library's module-level jax.jit, say, or jax.eval_shape or "
        f"jax.make_jaxpr). Raw JAX bakes the {framework} value it read into what it "
        "caches, as a constant, and a later call of the same function would silently "
        "reuse it after the value changes. In code of your own, use jaxoverride.jit "
        f"instead of jax.jit. {_culprits()}{_detect._HATCH}"
    )
