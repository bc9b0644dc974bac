"""Init-safe control flow: create every parameter first, then run the ordinary loop.

At init each combinator makes a *creation pass* (each body or branch once, outside JAX
control flow, so parameters are created by plain Python side effects), then the very
call apply would make, so init returns what apply returns and a zero-trip loop still
creates its parameters. Two hooks customise it: ``initializing`` (whether to make the
pass) and ``create`` (runs it). The combinators are the kit's ``threaded_*`` ones over
a ``StateSource`` whose state is empty: only its init part, these two hooks, acts.

A public submodule, so that an adapter can re-export exactly its ``__all__`` (as
``jaxoverride_plain`` does); everything here is also in ``jaxoverride.adapter_kit``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax

from jaxoverride.adapter_kit._operands import NO_OPERAND as _NO_OPERAND, first_slice
from jaxoverride.adapter_kit._phase import is_applying, is_initializing
from jaxoverride.adapter_kit._state_source import StateSource
from jaxoverride.adapter_kit._state_threading import (
    init_safe,
    threaded_cond,
    threaded_fori_loop,
    threaded_scan,
    threaded_switch,
    threaded_while_loop,
)

__all__ = [
    "create_by_calling",
    "init_safe_call",
    "init_safe_cond",
    "init_safe_fori_loop",
    "init_safe_map",
    "init_safe_scan",
    "init_safe_switch",
    "init_safe_while_loop",
]

T = TypeVar("T")
Thunk = Callable[[], Any]


def create_by_calling(thunk: Thunk) -> None:
    """The default ``create`` hook: run the creation pass and discard its result.

    Args:
      thunk: the creation pass.

    Example:
      >>> from jaxoverride.adapter_kit import create_by_calling
      >>> created = []
      >>> create_by_calling(lambda: created.append("w"))
      >>> created
      ['w']
    """
    thunk()


def init_safe_call(
    creation: Thunk,
    apply: Callable[[], T],
    *,
    initializing: Callable[[], bool] = is_initializing,
    create: Callable[[Thunk], Any] = create_by_calling,
) -> T:
    """The pattern behind every combinator: at init, a creation pass, then the apply pass.

    Args:
      creation: runs the bodies or branches once, outside any JAX transformation.
      apply: the ordinary call; its result is returned.
      initializing, create: the hooks of ``init_safe_scan``.

    Returns:
      What ``apply()`` returns; at init it runs under ``applying()``.

    Example:
      >>> from jaxoverride.adapter_kit import init_context, init_safe_call
      >>> log = []
      >>> with init_context():
      ...     out = init_safe_call(lambda: log.append("create"), lambda: log.append("apply"))
      >>> log
      ['create', 'apply']
    """
    return init_safe(_EmptySource(initializing, create), creation, apply)


class _EmptySource(StateSource):
    """A ``StateSource`` whose state is empty: the init part alone, the two hooks. Its
    wrappers read nothing but the functions they call, so they are reused (``reuse_key``)
    and an identical eager call hits JAX's caches as the raw JAX call does."""

    __slots__ = ("_create", "_initializing")

    def __init__(self, initializing: Callable[[], bool], create: Callable[[Thunk], Any]):
        self._initializing = initializing
        self._create = create

    def read(self) -> Any:
        return ()

    def run(self, state: Any, fun: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
        return fun(*args), ()

    def write(self, state: Any) -> None:
        pass

    def initializing(self) -> bool:
        return self._initializing()

    def create(self, thunk: Thunk) -> None:
        self._create(thunk)

    def reuse_key(self) -> Any:
        return ()


def _threaded(
    threaded: Callable[..., Any],
    below: Callable[..., Any],
    initializing: Callable[[], bool],
    create: Callable[[Thunk], Any],
    *args: Any,
    **keywords: Any,
) -> Any:
    """``threaded(source, below, ...)`` over an ``_EmptySource`` when initialising, else
    ``below(...)`` itself: what the threaded call would run, less its wrappers' cost."""
    if keywords.get("operand") is _NO_OPERAND:
        del keywords["operand"]  # not given (a cond's or switch's): passed on as not given
    if is_applying() or not initializing():
        return below(*args, **keywords)
    return threaded(_EmptySource(initializing, create), below, *args, **keywords)


def init_safe_scan(
    f: Callable[[Any, Any], tuple[Any, Any]],
    init: Any,
    xs: Any = None,
    length: int | None = None,
    reverse: bool = False,
    unroll: int | bool = 1,
    _split_transpose: bool = False,
    *,
    default_scan: Callable[..., Any] = jax.lax.scan,
    initializing: Callable[[], bool] = is_initializing,
    create: Callable[[Thunk], Any] = create_by_calling,
) -> tuple[Any, Any]:
    """``jax.lax.scan`` that creates the parameters its body uses when initialising.

    Args:
      f, init, xs, length, reverse, unroll: as for ``jax.lax.scan``.
      default_scan: the scan to run the loop with (``jax.lax.scan``, or the next
        implementation when called from an override).
      initializing: whether to make the creation pass; ``is_initializing`` by default.
        Not asked inside an apply pass (``is_applying()``): a combinator nested in one
        only applies, its parameters made by the outer creation pass.
      create: runs the creation pass, a thunk calling ``f`` once on ``init`` and the
        first slice of ``xs`` (zeros of its shape if ``xs`` is empty).

    Returns:
      ``(carry, ys)``, exactly what ``default_scan`` returns.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxoverride.adapter_kit import init_context, init_safe_scan, is_initializing
      >>> params = {}
      >>> def body(carry, x):
      ...     if is_initializing():
      ...         params.setdefault("w", jnp.float32(2.0))
      ...     return carry * params["w"] + x, carry
      >>> with init_context():
      ...     carry, ys = init_safe_scan(body, 1.0, jnp.zeros(0))
      >>> float(carry), ys.shape, sorted(params)
      (1.0, (0,), ['w'])
    """
    return _threaded(
        threaded_scan, default_scan, initializing, create,
        f, init, xs, length, reverse, unroll, _split_transpose,
    )  # fmt: skip


def init_safe_while_loop(
    cond_fun: Callable[[T], Any],
    body_fun: Callable[[T], T],
    init_val: T,
    *,
    default_while_loop: Callable[..., Any] = jax.lax.while_loop,
    initializing: Callable[[], bool] = is_initializing,
    create: Callable[[Thunk], Any] = create_by_calling,
) -> T:
    """``jax.lax.while_loop`` that creates its parameters when initialising.

    The creation pass calls ``cond_fun`` and ``body_fun`` once on ``init_val``, even when
    the loop would not run, so a zero-trip loop still creates its parameters and
    returns ``init_val``.

    Args:
      cond_fun, body_fun, init_val: as for ``jax.lax.while_loop``.
      default_while_loop, initializing, create: as for ``init_safe_scan``.

    Returns:
      The final loop value, from ``default_while_loop``.

    Example:
      >>> from jaxoverride.adapter_kit import init_context, init_safe_while_loop
      >>> with init_context():
      ...     out = init_safe_while_loop(lambda x: x < 0, lambda x: x + 1, 5)
      >>> int(out)
      5
    """
    return _threaded(
        threaded_while_loop, default_while_loop, initializing, create, cond_fun, body_fun, init_val
    )


def init_safe_fori_loop(
    lower: Any,
    upper: Any,
    body_fun: Callable[[Any, T], T],
    init_val: T,
    *,
    unroll: int | bool | None = None,
    default_fori_loop: Callable[..., Any] = jax.lax.fori_loop,
    initializing: Callable[[], bool] = is_initializing,
    create: Callable[[Thunk], Any] = create_by_calling,
) -> T:
    """``jax.lax.fori_loop`` that creates its parameters when initialising.

    The creation pass calls ``body_fun(lower, init_val)`` once, whatever the trip count.

    Args:
      lower, upper, body_fun, init_val, unroll: as for ``jax.lax.fori_loop``.
      default_fori_loop, initializing, create: as for ``init_safe_scan``.

    Returns:
      The loop value after ``body_fun`` ran for every ``i`` in ``[lower, upper)``.

    Example:
      >>> from jaxoverride.adapter_kit import init_context, init_safe_fori_loop
      >>> with init_context():
      ...     out = init_safe_fori_loop(0, 3, lambda i, x: x + i, 0)
      >>> int(out)
      3
    """
    return _threaded(
        threaded_fori_loop, default_fori_loop, initializing, create,
        lower, upper, body_fun, init_val, unroll=unroll,
    )  # fmt: skip


def init_safe_cond(
    pred: Any,
    true_fun: Callable[..., Any],
    false_fun: Callable[..., Any],
    *operands: Any,
    operand: Any = _NO_OPERAND,
    default_cond: Callable[..., Any] = jax.lax.cond,
    initializing: Callable[[], bool] = is_initializing,
    create: Callable[[Thunk], Any] = create_by_calling,
) -> Any:
    """``jax.lax.cond`` that creates the parameters of both branches when initialising.

    Args:
      pred, true_fun, false_fun, operands, operand: as for ``jax.lax.cond``.
      default_cond, initializing, create: as for ``init_safe_scan``.

    Returns:
      The output of ``true_fun`` if ``pred`` holds, else of ``false_fun``.

    Example:
      >>> from jaxoverride.adapter_kit import init_context, init_safe_cond
      >>> with init_context():
      ...     out = init_safe_cond(True, lambda x: x + 1, lambda x: x - 1, 1)
      >>> int(out)
      2
    """
    return _threaded(
        threaded_cond, default_cond, initializing, create,
        pred, true_fun, false_fun, *operands, operand=operand,
    )  # fmt: skip


def init_safe_switch(
    index: Any,
    branches: Sequence[Callable[..., Any]],
    *operands: Any,
    operand: Any = _NO_OPERAND,
    default_switch: Callable[..., Any] = jax.lax.switch,
    initializing: Callable[[], bool] = is_initializing,
    create: Callable[[Thunk], Any] = create_by_calling,
) -> Any:
    """``jax.lax.switch`` that creates the parameters of every branch when initialising.

    Args:
      index, branches, operands, operand: as for ``jax.lax.switch``.
      default_switch, initializing, create: as for ``init_safe_scan``.

    Returns:
      The output of ``branches[index]``, ``index`` clamped into range as JAX clamps it.

    Example:
      >>> from jaxoverride.adapter_kit import init_context, init_safe_switch
      >>> with init_context():
      ...     out = init_safe_switch(1, [lambda x: x, lambda x: x * 10], 2)
      >>> int(out)
      20
    """
    return _threaded(
        threaded_switch, default_switch, initializing, create,
        index, branches, *operands, operand=operand,
    )  # fmt: skip


def init_safe_map(
    f: Callable[[Any], Any],
    xs: Any,
    *,
    batch_size: int | None = None,
    default_map: Callable[..., Any] = jax.lax.map,
    initializing: Callable[[], bool] = is_initializing,
    create: Callable[[Thunk], Any] = create_by_calling,
) -> Any:
    """``jax.lax.map`` that creates the parameters of ``f`` when initialising.

    Args:
      f, xs, batch_size: as for ``jax.lax.map``.
      default_map, initializing, create: as for ``init_safe_scan``; the creation pass
        calls ``f`` on the first slice of ``xs`` (zeros of its shape if empty).

    Returns:
      ``f``'s outputs stacked along a new leading axis, from ``default_map``.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxoverride.adapter_kit import init_context, init_safe_map
      >>> with init_context():
      ...     out = init_safe_map(lambda x: x * 2, jnp.arange(3))
      >>> out.tolist()
      [0, 2, 4]
    """
    return init_safe_call(
        lambda: f(first_slice(xs, replay=lambda: jax.lax.map(lambda _: None, xs))),
        lambda: default_map(f, xs, batch_size=batch_size),
        initializing=initializing,
        create=create,
    )
