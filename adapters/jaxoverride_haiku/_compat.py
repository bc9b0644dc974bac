"""Every JAX difference across the supported range that the Haiku adapter meets, in one place.

(JAX differences shared with other packages are in the core's compat module; adapters
reach them through ``jaxoverride.adapter_kit``.)

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


__all__ = ["resolve_argnums"]
