"""Every JAX difference across the supported range (``jax>=0.8.1``), in one place.

The core, the adapters, the tests and the benchmarks import these names from here rather
than from JAX, so a JAX release that moves one is handled by this file alone:

- ``get_opaque_trace_state`` and ``jaxprs_in_params``: public in ``jax.extend.core``
  from JAX 0.9; before that only in ``jax.core`` (where JAX 0.9+ deprecates them).
  From JAX 0.11 a primitive's rules (abstract evaluation, ``impl``) run with *no* current
  trace (JAX commit "take_current_trace should leave no trace"), where JAX's accessor
  fails an ``assert``; before, they ran under the eval trace. There the token is
  ``NO_TRACE``, which equals no trace's token.
- ``set_user_context_global``: the context made by ``jax.make_user_context`` (new in JAX
  0.7.2, the oldest thing the core needs) has ``set_global`` only from JAX 0.9; in 0.8
  the same setter exists on the config object that the context wraps.
- ``rule_nondiff_argnums``: ``jax.custom_vjp(f)`` is a ``custom_vjp3`` object when the flag
  ``jax_custom_vjp3`` is on (JAX 0.8.1 to 0.11; its planned default), and that object keeps
  the positions as a frozenset ``static_argnums`` instead of the sorted tuple
  ``nondiff_argnums``. From JAX 0.12 it returns its usual ``custom_vjp`` object, which
  switches to ``custom_vjp3`` at the call.
- ``rule_jvp``: a ``custom_jvp`` object keeps its JVP rule (the one ``defjvps``
  composes, too) as ``jvp``; the ``custom_jvp3`` object that ``jax.custom_jvp(f)``
  returns under the flag ``jax_custom_jvp3`` (JAX 0.11.1 and 0.11.2) keeps it as
  ``jvp_fun``.
- ``jit_name``: ``jax.jit`` names the program of a callable without ``__name__``
  ``<unnamed wrapped function>`` before JAX 0.10 and ``<unnamed function>`` after.
- ``resolve_argnums``: JAX's private ``api_util.resolve_argnums`` returns the donated
  positions counted among the *dynamic* arguments in JAX 0.8 (it rebases them past the
  static ones), and counted among *all* arguments from JAX 0.9 on. Adapters need the
  latter, so the former is converted back here.
- ``NEGATIVE_ARGNUMS_NAME_PARAMETERS``: given only positions, ``jax.jit`` names the
  parameters at them (``static_argnums`` adds ``static_argnames``); from JAX 0.12 a
  negative position names the parameter it counts back to (``api_util
  .infer_argnums_and_argnames``: ``i - num_params in argnums``), before it names none.
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

# ``jax.extend.core`` is imported at the first call that needs it, not with jaxoverride:
# importing any ``jax.extend`` module runs ``jax.extend``'s ``__init__``, which imports
# all of them, Pallas included (20-40 ms, more than ``import jaxoverride``'s budget).


def _from_extend_core(name: str, alias: str) -> Callable[..., Any]:
    """A stand-in for ``jax.extend.core.<name>`` that, at its first call, imports it and
    puts it in its place (this module's global ``alias``): later calls cost nothing more."""

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
_jaxprs_in_params = _from_extend_core("jaxprs_in_params", "_jaxprs_in_params")


def jaxprs_in_params(params: Any) -> Any:
    """JAX's ``jaxprs_in_params`` (``jax.extend.core``): the jaxprs an equation's params hold.

    Args:
      params: an equation's ``params``.

    Returns:
      An iterator over the jaxprs found in them.

    Example:
      >>> import jax
      >>> from jaxoverride._compat import jaxprs_in_params
      >>> eqn = jax.make_jaxpr(jax.jit(lambda x: x + 1))(1.0).eqns[0]
      >>> len(list(jaxprs_in_params(eqn.params)))
      1
    """
    return _jaxprs_in_params(params)


class _NoTrace:
    """The trace token while JAX has no current trace (inside a primitive's rules, JAX 0.11+)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<no current JAX trace>"


NO_TRACE: Any = _NoTrace()
"""What ``get_opaque_trace_state`` returns where JAX has no current trace: equal only to
itself, so never to the token of a trace that some code was entered in."""


def get_opaque_trace_state(convention: str | None = None) -> Any:
    """JAX's opaque token of the current trace, or ``NO_TRACE`` where there is none.

    Args:
      convention: passed to JAX, which ignores it (Haiku passes ``"haiku"``).

    Returns:
      The token, equal to another while the trace is the same.

    Example:
      >>> from jaxoverride._compat import NO_TRACE, get_opaque_trace_state
      >>> get_opaque_trace_state() == get_opaque_trace_state() != NO_TRACE
      True
    """
    try:
        return _jax_opaque_trace_state(convention)
    except (AssertionError, AttributeError):  # no current trace (asserted; None under -O)
        return NO_TRACE


def current_trace() -> Any:
    """The JAX trace running now, or None where JAX has none (a primitive's rules, 0.11+).

    JAX's public ``find_top_trace`` (``jax.extend.core`` from JAX 0.9, ``jax.core`` before)
    ignores its argument in every supported JAX (the stackless core) and returns this.

    Returns:
      The trace object: the eval trace outside every transform.

    Example:
      >>> import jax
      >>> from jaxoverride._compat import current_trace
      >>> seen = [current_trace()]
      >>> _ = jax.make_jaxpr(lambda x: seen.append(current_trace()) or x)(1.0)
      >>> seen[1] is not seen[0], type(seen[1]).__name__
      (True, 'DynamicJaxprTrace')
    """
    return _find_top_trace(())


def release_trace(trace: Any) -> None:
    """Drops what a staging trace that an exception aborted holds (see
    ``PRIVATE_ATTRIBUTES["DynamicJaxprTrace.invalidate"]``); nothing for another trace.

    Args:
      trace: a JAX trace that will never be used again.

    Example:
      >>> import jax
      >>> from jaxoverride._compat import current_trace, release_trace
      >>> seen = []
      >>> _ = jax.make_jaxpr(lambda x: seen.append(current_trace()) or x)(1.0)
      >>> release_trace(seen[0])  # already released by JAX: harmless
    """
    if getattr(trace, "frame", None) is not None:
        trace.invalidate()


def staged_for(trace: Any) -> str | None:
    """What a staging trace traces for (``"jit"``, ``"scan"``, ...), or None for another trace.

    JAX names it in the debug info of the jaxpr that a ``DynamicJaxprTrace`` builds
    (``DebugInfo.traced_for``): ``"jit"`` for ``jax.jit`` and for what traces through
    jit's own cache (``.lower``, ``.trace``, ``jax.eval_shape``, ``jax.make_jaxpr``),
    the primitive's name for control flow (``"scan"``, ``"while_body"``, ``"cond"``),
    ``"checkpoint / remat"``, ``"shard_map"`` (``jax.pmap`` too). Read in JAX 0.8.1 and
    0.10.2 (tested), 0.11.0 and main at 0.11.1.dev.

    Args:
      trace: a JAX trace, such as ``current_trace()``.

    Returns:
      The name, or None for a trace that stages nothing (eval, JVP, batching).

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
    """Sets the value that a ``jax.make_user_context`` context has in every thread.

    Args:
      context: what ``jax.make_user_context`` returned.
      value: the new process-wide value (part of ``jax.jit``'s cache key).

    Returns:
      None.

    Example:
      >>> import jax
      >>> from jaxoverride._compat import set_user_context_global
      >>> key = jax.make_user_context(0)
      >>> set_user_context_global(key, 1)
      >>> key.value
      1
    """
    setter = getattr(context, "set_global", None)
    if setter is None:  # JAX 0.8: only the wrapped config object has the setter.
        setter = context._obj.set_global
    setter(value)


def rule_nondiff_argnums(rule: Any) -> tuple[int, ...]:
    """The non-differentiable positions of a JAX ``custom_vjp``/``custom_jvp`` object.

    Args:
      rule: what ``jax.custom_vjp(f, ...)`` or ``jax.custom_jvp(f, ...)`` returned; a
        ``custom_vjp3`` object under ``jax_custom_vjp3``.

    Returns:
      The positions from ``nondiff_argnums`` and ``nondiff_argnames``, sorted.

    Example:
      >>> import jax
      >>> from jaxoverride._compat import rule_nondiff_argnums
      >>> rule_nondiff_argnums(jax.custom_vjp(lambda f, x: f(x), nondiff_argnums=(0,)))
      (0,)
    """
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

    JAX names the innermost frame outside its own files as the source of an equation
    and of an error ("This error occurs at source: ...", from JAX 0.11), and drops its own
    frames from the tracebacks of errors that pass through it. A neutral function is
    JAX's stand-in, so its frames must count as JAX's for both, as Equinox and Flax do
    for theirs: ``jax._src.source_info_util.register_exclusion`` (public as
    ``jax.extend.source_info_util``'s, whose import costs more than all of jaxoverride's)
    for the first, and the private ``jax._src.traceback_util.register_exclusion`` for
    the second.

    Args:
      directory: a package's directory.

    Returns:
      None.

    Example:
      >>> import os, jaxoverride
      >>> from jaxoverride._compat import hide_frames_under
      >>> hide_frames_under(os.path.dirname(jaxoverride.__file__))  # done at import
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

``adapter_kit.escaped_tracers`` reads the first two: the Haiku adapter's check, at the end of
``hk.transform``, for state that a raw transform (one it never saw) left as tracers of an
ended trace, and the Linen adapter's test for a module whose values are out of reach of the
trace running now (a primitive's rule). It returns nothing where they are missing
(``_leaks._live_traces``). The check that catches a never-interposed library at its call
(``_first_call``) needs none of them: it compares the framework state before and after the
call, by identity.

No public route answers "is this tracer's trace the current one or one it runs inside"
(JAX 0.8.1 to 0.12.0, read for issue 20): ``jax.core.Tracer`` has no accessor for its
trace; ``jax.extend.core.find_top_trace(xs)`` ignores ``xs`` since the stackless core and
returns the current trace, which is how ``current_trace`` gets the start of the chain
(the opaque token's private ``_trace_ref`` is no longer read); a trace's parent is kept
only by the trace types that have one, with no accessor (JAX's own
``unsafe_get_trace_stack`` is private and reads ``parent_trace`` too); the public
``Trace.is_valid()`` cannot say a jit trace has ended (``DynamicJaxprTrace.invalidate``
leaves it valid in 0.10.2, a TODO there), nor that a live trace is out of reach, which is
what Linen needs; ``jax.checking_leaks()`` is a global mode that searches the garbage
collector's referrers when a trace ends, for any tracer, and raises JAX's own error.

``adapter_kit.jit_traces`` reads ``parent_trace`` and the last two (through
``staged_for``), each with ``getattr`` and a default, so a JAX that moves them makes it
find no trace (the check it serves then says nothing) rather than fail. They exist, with
``traced_for == "jit"`` for ``jax.jit``, ``jax.eval_shape`` and ``jax.make_jaxpr``, in JAX
0.8.1 and 0.10.2 (tested), 0.11.0 and main at 0.11.1.dev (read for issue 20). No public
route says which transform a trace stages for: ``jax.core.Tracer`` and ``Trace`` have no
such accessor, and ``jax.extend.core.DebugInfo`` is reached only from a jaxpr, not from the
trace that is building it.
"""


__all__ = [
    "JIT_WRAPPER_TYPE",
    "PRIVATE_ATTRIBUTES",
    "NEGATIVE_ARGNUMS_NAME_PARAMETERS",
    "NO_TRACE",
    "ShardingTypeError",
    "get_opaque_trace_state",
    "hide_frames_under",
    "jaxprs_in_params",
    "PRIVATE_SYMBOLS",
    "current_trace",
    "jit_name",
    "resolve_argnums",
    "rule_jvp",
    "rule_nondiff_argnums",
    "set_user_context_global",
    "release_trace",
    "staged_for",
]
