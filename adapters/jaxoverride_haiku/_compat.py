"""Every JAX difference across the supported range that the Haiku adapter meets, in one place.

(JAX differences shared with other packages are in ``jaxoverride._compat``.)

- ``resolve_argnums``: JAX's private ``api_util.resolve_argnums`` returns the donated
  positions counted among the *dynamic* arguments in JAX 0.8 (it rebases them past the
  static ones), and counted among *all* arguments from JAX 0.9 on. The adapter needs
  the latter, so the former is converted back here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jax._src import api_util


def _probe(static: Any, donated: Any) -> None:
    """A two-argument function for telling the two conventions apart."""


def _rebases_donations() -> bool:
    donated = api_util.resolve_argnums(
        _probe, api_util.fun_signature(_probe), (1,), None, (0,), None
    )[0]
    return tuple(donated) == (0,)


_REBASES = _rebases_donations()


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
      >>> from jaxoverride_haiku._compat import resolve_argnums
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
    if _REBASES:
        donated = _unrebase(donated, static)
    return tuple(donated), tuple(donated_names), tuple(static), tuple(static_names)


_STATE = "Haiku's state threading (what hk.transform does inside), which has no public API"
_STACK = "a stack that a jitted call must replay (hk.custom_creator/getter/setter push onto it)"

PRIVATE_SYMBOLS: dict[str, str] = {
    "haiku._src.base.Frame": "the type of the frame holding a transform's params, state, rng",
    "haiku._src.base.HaikuContext": "the object hk.transform enters; install() hooks its entry",
    "haiku._src.base.StatePair": "the (initial, current) record of a state entry, put back",
    "haiku._src.base.current_frame": "the frame of the innermost transform",
    "haiku._src.base.custom_creator_unsafe": "salts the rng of creators it must run again",
    "haiku._src.base.frame_stack": "whether a transform is active (cheaper than running_init)",
    "haiku._src.base.param_names": "the parameters a loop body created, to refuse new ones",
    "haiku._src.base.push_jax_trace_level": "lets Haiku modules run under the adapter's trace",
    "haiku._src.base.param_creator_stack": _STACK,
    "haiku._src.base.param_getter_stack": _STACK,
    "haiku._src.base.state_creator_stack": _STACK,
    "haiku._src.base.state_getter_stack": _STACK,
    "haiku._src.base.state_setter_stack": _STACK,
    "haiku._src.module.interceptor_stack": _STACK,
    "haiku._src.data_structures.Stack": "the type of those stacks, pushed onto in a rule",
    "haiku._src.stateful.InternalState": _STATE,
    "haiku._src.stateful.copy_structure": _STATE,
    "haiku._src.stateful.difference": _STATE,
    "haiku._src.stateful.internal_state": _STATE,
    "haiku._src.stateful.reserve_up_to_full_rng_block": _STATE,
    "haiku._src.stateful.temporary_internal_state": _STATE,
    "haiku._src.stateful.update_internal_state": _STATE,
    "jax._src.api_util.fun_signature": "jit's own reading of a signature (resolve_argnums)",
    "jax._src.api_util.resolve_argnums": "jit's own resolution of static and donated arguments",
    "jax._src.lax.control_flow.loops._batch_and_remainder": "lax.map's batch_size split, as JAX",
}
"""Every private upstream name the Haiku adapter uses, with why no public name serves.

Read, with the same signatures, in Haiku 0.0.13, 0.0.15, 0.0.16, 0.0.17 (tested) and main at
0.0.17.dev (2026-07-09), and for the JAX names in JAX 0.8.1 and 0.10.2 (tested), 0.11.0 and
main at 0.11.1.dev (2026-08-08). ``ci/private_symbols.py`` re-checks them against git
checkouts; ``tests/test_private_symbols.py`` fails when the adapter uses a private name not
listed here, or one that has a public name.
"""


__all__ = ["PRIVATE_SYMBOLS", "resolve_argnums"]
