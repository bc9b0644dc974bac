"""Every JAX difference across the supported range (``jax>=0.8.1``), in one place.

The core, the adapters, the tests and the benchmarks import these names from here, so a
JAX release that moves one is handled by this file alone:

- ``get_opaque_trace_state``, ``jaxprs_in_params``: in ``jax.extend.core`` from JAX 0.9,
  before only in ``jax.core``. From JAX 0.11 a primitive's rules run with *no* current
  trace, where JAX's accessor fails an ``assert``: the token is then ``NO_TRACE``.
- ``set_user_context_global``: ``set_global`` of a ``jax.make_user_context`` context
  exists from JAX 0.9; in 0.8 only on the config object it wraps.
- ``rule_nondiff_argnums``: under ``jax_custom_vjp3`` (JAX 0.8.1 to 0.11) the object
  keeps the positions as a frozenset ``static_argnums``.
- ``rule_jvp``: a ``custom_jvp3`` object (``jax_custom_jvp3``, JAX 0.11.1 and 0.11.2)
  keeps its rule as ``jvp_fun``, not ``jvp``.
- ``jit_name``: JAX's name of an unnamed callable's program changed in JAX 0.10.
- ``resolve_argnums``: JAX 0.8 counts donated positions among the *dynamic* arguments,
  0.9 on among *all*; adapters need the latter.
- ``NEGATIVE_ARGNUMS_NAME_PARAMETERS``: from JAX 0.12 a negative static position also
  names the parameter it counts back to.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax._src import api_util, source_info_util, traceback_util
from jax._src.core import ShardingTypeError as ShardingTypeError
from jax._src.util import fun_name

# ``jax.extend.core`` is imported at the first call that needs it: any ``jax.extend``
# module imports all of them, Pallas included (20-40 ms, over ``import jaxoverride``'s budget).


def _from_extend_core(name: str, alias: str) -> Callable[..., Any]:
    """A stand-in for ``jax.extend.core.<name>`` that imports it at its first call and puts
    it in its place (the global ``alias``)."""

    def load(*args: Any, **kwargs: Any) -> Any:
        import jax.extend.core

        # JAX < 0.9: the same functions, only under jax.core.
        function = getattr(jax.extend.core, name, None)
        if function is None:
            function = getattr(importlib.import_module("jax.core"), name)
        globals()[alias] = function
        return function(*args, **kwargs)

    return load


_jax_opaque_trace_state = _from_extend_core("get_opaque_trace_state", "_jax_opaque_trace_state")
_find_top_trace = _from_extend_core("find_top_trace", "_find_top_trace")
# The jaxprs an equation's params hold: a name imported elsewhere keeps the stand-in.
jaxprs_in_params = _from_extend_core("jaxprs_in_params", "jaxprs_in_params")


class _NoTrace:
    """The trace token while JAX has no current trace (inside a primitive's rules, JAX 0.11+)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<no current JAX trace>"


NO_TRACE: Any = _NoTrace()  # equal only to itself: never to a trace's token


def get_opaque_trace_state(convention: str | None = None) -> Any:
    """JAX's opaque token of the current trace (equal while the trace is the same), or
    ``NO_TRACE`` where there is none; JAX ignores ``convention``."""
    try:
        return _jax_opaque_trace_state(convention)
    except (AssertionError, AttributeError):  # no current trace (asserted; None under -O)
        return NO_TRACE


def current_trace() -> Any:
    """The JAX trace running now (the eval trace outside every transform), or None where JAX
    has none: JAX's ``find_top_trace`` ignores its argument in every supported JAX."""
    return _find_top_trace(())


def release_trace(trace: Any) -> None:
    """Drops what a staging trace that an exception aborted holds (see
    ``PRIVATE_ATTRIBUTES["DynamicJaxprTrace.invalidate"]``); nothing for another trace."""
    if getattr(trace, "frame", None) is not None:
        trace.invalidate()


def staged_for(trace: Any) -> str | None:
    """What a staging trace traces for, or None for a trace that stages nothing (eval, JVP,
    batching): JAX's ``DebugInfo.traced_for`` of the jaxpr it builds, ``"jit"`` for
    ``jax.jit`` and what traces through its cache (``.lower``, ``jax.eval_shape``,
    ``jax.make_jaxpr``), the primitive's name for control flow (``"scan"``,
    ``"while_body"``), ``"checkpoint / remat"``, ``"shard_map"`` (``jax.pmap`` too).

    Example:
      >>> import jax
      >>> from jaxoverride._compat import current_trace, staged_for
      >>> seen = []
      >>> _ = jax.jit(lambda x: seen.append(staged_for(current_trace())) or x)(1.0)
      >>> seen, staged_for(current_trace())
      (['jit'], None)
    """
    frame = getattr(trace, "frame", None)
    return getattr(getattr(frame, "debug_info", None), "traced_for", None)


def set_user_context_global(context: Any, value: Any) -> None:
    """Sets the value a ``jax.make_user_context`` context has in every thread."""
    setter = getattr(context, "set_global", None)
    if setter is None:  # JAX 0.8: only the wrapped config object has the setter.
        setter = context._obj.set_global
    setter(value)


def rule_nondiff_argnums(rule: Any) -> tuple[int, ...]:
    """The sorted non-differentiable positions of a JAX ``custom_vjp``/``custom_jvp`` object."""
    argnums = getattr(rule, "nondiff_argnums", None)
    if argnums is None:  # custom_vjp3: a frozenset, under another name
        argnums = sorted(rule.static_argnums)
    return tuple(argnums)


def rule_jvp(rule: Any) -> Callable[..., Any] | None:
    """The JVP rule that a JAX ``custom_jvp`` object holds, or None before one is defined.

    After ``defjvps`` it is the single rule that JAX composed from the per-argument ones.

    Args:
      rule: what ``jax.custom_jvp(f, ...)`` returned (a ``custom_jvp3`` object under
        ``jax_custom_jvp3``), or an adapter's rule object that forwards to one.

    Returns:
      The rule, as JAX calls it: ``jvp(primals, tangents) -> (out, tangent_out)``.

    Example:
      >>> import jax
      >>> from jaxoverride.adapter_kit import rule_jvp
      >>> f = jax.custom_jvp(lambda x: 2.0 * x)
      >>> jvp = lambda primals, tangents: (f(*primals), 2.0 * tangents[0])
      >>> _ = f.defjvp(jvp)
      >>> rule_jvp(f) is jvp
      True
    """
    if isinstance(rule, jax.custom_jvp):
        return rule.jvp
    composed = getattr(rule, "jvp_fun", _MISSING)  # custom_jvp3, or a wrapper of one
    return getattr(rule, "jvp", None) if composed is _MISSING else composed  # type: ignore[return-value]


_MISSING = object()


@functools.cache
def _unnamed() -> str:
    class Nameless:
        def __call__(self, x: Any) -> Any:
            return x

    # What this JAX calls it, read off a trace (no compilation): the default moved. The
    # first caller may run under jax.disable_jit(), where jit would leave no equation.
    with jax.disable_jit(False):
        return jax.make_jaxpr(jax.jit(Nameless()))(0.0).eqns[0].params["name"]


def jit_name(fun: Callable[..., Any]) -> str:
    """The name ``jax.jit`` gives ``fun``'s program (a partial by its function).

    An adapter whose ``jit`` traces a wrapper of ``fun`` names the wrapper this, so that
    its lowering and jaxprs read as ``jax.jit(fun)``'s do.

    Args:
      fun: the function passed to ``jit``.

    Returns:
      Its ``__name__``, its partial's function's, or JAX's name for an unnamed callable.

    Example:
      >>> import functools
      >>> from jaxoverride.adapter_kit import jit_name
      >>> jit_name(functools.partial(max, 1))
      'max'
    """
    return fun_name(fun, _unnamed())


NEGATIVE_ARGNUMS_NAME_PARAMETERS: bool = jax.__version_info__ >= (0, 12, 0)
"""Whether ``jax.jit(f, static_argnums=-1)`` also makes ``f``'s last positional-or-keyword
parameter static by name (JAX 0.12 onwards)."""


def _probe(static: Any, donated: Any) -> None:
    """A two-argument function for telling the two conventions apart."""


@functools.cache
def _rebases_donations() -> bool:
    donated = api_util.resolve_argnums(
        _probe, api_util.fun_signature(_probe), (1,), None, (0,), None
    )[0]
    return tuple(donated) == (0,)


def _unrebase(donated: Sequence[int], static: Sequence[int]) -> tuple[int, ...]:
    # The inverse of JAX's rebase_donate_argnums: a dynamic index becomes the position of
    # that dynamic argument among all the arguments.
    fixed = sorted(i for i in static if i >= 0)
    out = []
    for index in donated:
        for position in fixed:
            if position <= index:
                index += 1
        out.append(index)
    return tuple(out)


def resolve_argnums(
    fun: Callable[..., Any],
    donate_argnums: Any,
    donate_argnames: Any,
    static_argnums: Any,
    static_argnames: Any,
) -> tuple[tuple[int, ...], tuple[str, ...], tuple[int, ...], tuple[str, ...]]:
    """``fun``'s donated and static arguments, by position (among all its arguments) and name.

    JAX's own resolution and checks (``jax.jit``'s errors and warnings for names and
    positions that do not fit ``fun``), as ``jax.jit(fun, ...)`` makes them.

    Args:
      fun: the function given to ``jit``.
      donate_argnums: ``jit``'s ``donate_argnums``, or None.
      donate_argnames: ``jit``'s ``donate_argnames``, or None.
      static_argnums: ``jit``'s ``static_argnums``, or None.
      static_argnames: ``jit``'s ``static_argnames``, or None.

    Returns:
      ``(donate_argnums, donate_argnames, static_argnums, static_argnames)``, each name
      resolved to its position and each position to its name where the signature allows.

    Example:
      >>> from jaxoverride.adapter_kit import resolve_argnums
      >>> def solve(f, x, steps): ...
      >>> resolve_argnums(solve, (1,), None, None, ("f", "steps"))
      ((1,), ('x',), (0, 2), ('f', 'steps'))
    """
    donated, donated_names, static, static_names = api_util.resolve_argnums(
        fun,
        api_util.fun_signature(fun),
        donate_argnums,
        donate_argnames,
        static_argnums,
        static_argnames,
    )
    if _rebases_donations():
        donated = _unrebase(donated, static)
    return tuple(donated), tuple(donated_names), tuple(static), tuple(static_names)


def hide_frames_under(directory: str) -> None:
    """Makes JAX treat the frames of files under ``directory`` as its own, not the user's.

    JAX names the innermost frame outside its own files as the source of an equation and
    of an error, and drops its own frames from tracebacks. A neutral function stands in
    for JAX, so its frames must count as JAX's for both, as Equinox and Flax do for theirs.
    """
    directory = os.path.join(os.path.abspath(directory), "")  # not its longer siblings
    if directory in _hidden:
        return
    _hidden.add(directory)
    source_info_util.register_exclusion(directory)
    traceback_util.register_exclusion(directory)


_hidden: set[str] = set()


JIT_WRAPPER_TYPE: type = type(jax.jit(lambda x: x))
"""The type of what ``jax.jit`` returns (``PjitFunction``, from jaxlib's C++): found from the
object itself, since its module path moves between jaxlib releases."""

PRIVATE_SYMBOLS: dict[str, str] = {
    "jax._src.core.ShardingTypeError": (
        "the error of indexing an array sharded over an Explicit mesh axis; not exported"
    ),
    "jax._src.util.fun_name": (
        "the name jax.jit gives a callable's program (jit_name); JAX has no public helper"
    ),
    "jax._src.api_util.fun_signature": "jit's own reading of a signature (resolve_argnums)",
    "jax._src.traceback_util.register_exclusion": (
        "hides jaxoverride's frames from the tracebacks JAX filters, as Equinox and Flax do "
        "(hide_frames_under)"
    ),
    "jax._src.api_util.resolve_argnums": "jit's own resolution of static and donated arguments",
    "jax._src.source_info_util.register_exclusion": (
        "jaxoverride's frames never named as an equation's source (hide_frames_under); the "
        "same function as the public jax.extend.source_info_util.register_exclusion, whose "
        "import runs jax.extend's __init__, which imports Pallas: 20-40 ms at import, more "
        "than import jaxoverride's whole budget"
    ),
    "jax._src.lax.control_flow.loops._batch_and_remainder": (
        "lax.map's batch_size split, exactly as each JAX version makes it (adapter_kit.batched_map)"
    ),
}
"""Every private upstream name the core uses, with why no public name serves.

Each was read, with the same signature, in JAX 0.8.1, 0.10.2 and 0.11.2 (tested), 0.11.0,
main at 0.11.1.dev (read on 2026-08-08) and 0.12.0 (its wheel, 2026-11-26);
``ci/private_symbols.py`` re-checks them against JAX,
Haiku and Flax git checkouts. See "Private symbols and supported versions" on the
"Design" page. ``tests/test_private_symbols.py`` fails when the
core uses a private name not listed here, or one that has a public name.
"""


PRIVATE_ATTRIBUTES: dict[str, str] = {
    "Trace.parent_trace": (
        "the trace a trace runs inside (escaped_tracers: the live chain); JAX has no accessor"
    ),
    "Tracer._trace": (
        "the trace a tracer belongs to (escaped_tracers: is it still live); JAX has no accessor"
    ),
    "DynamicJaxprTrace.frame": (
        "the jaxpr a staging trace builds, for its debug info (staged_for: is this a jax.jit "
        "trace, whose traced function JAX caches with the constants it closed over)"
    ),
    "DynamicJaxprTrace.invalidate": (
        "drops what a staging trace holds (its equations and constants); JAX calls it when "
        "a trace ends normally but not when an exception aborts it, and a constant's "
        "weakref.finalize callback then keeps the aborted trace, and the tracers of the "
        "enclosing trace it holds as constants, alive for good (release_trace)"
    ),
    "JaxprStackFrame.debug_info": (
        "the public DebugInfo (jax.extend.core) of that jaxpr, whose traced_for names the "
        "transform (staged_for); JAX has no accessor from a trace"
    ),
}
"""Private attributes read off public JAX objects, with why no public name serves.

Each is read with ``getattr`` and a default (``adapter_kit.escaped_tracers``,
``adapter_kit.jit_traces`` through ``staged_for``), so a JAX that moves one makes the
check it serves say nothing rather than fail. No public route (JAX 0.8.1 to 0.12.0)
answers "is this tracer's trace the current one or one it runs inside" (``Trace.is_valid()``
cannot tell an ended jit trace; ``jax.checking_leaks()`` is a global mode), nor which
transform a trace stages for (``DebugInfo`` is reached only from a finished jaxpr).
"""
