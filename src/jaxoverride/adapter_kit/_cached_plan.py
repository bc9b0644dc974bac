"""One cached-plan path for a jitted call under an adapter."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, NamedTuple, TypeVar

P = TypeVar("P")


class Direct(NamedTuple):
    """The stack that a hot path is made for, called directly (``jaxoverride.jit_api``).

    It serves only while ``current() is stack``, else returns ``fallback(*args,
    **kwargs)``, testing that first; ``captured`` is ``checked_direct``'s, else ``None``.
    """

    current: Callable[[], object]
    stack: object
    fallback: Callable[..., Any]
    captured: Callable[[], Any] | None = None


class CachedPlan(Generic[P]):
    """The plan of a jitted call's last general call, and the hot paths that serve it.

    A plan is what a repeated call needs, flat: the jitted function and what a call must
    look like to be served by it. ``plan`` is replaced whole (``keep``, ``drop``), so a
    thread reads one plan or the other. The hot path is the adapter's closure
    ``make_hot(cached, direct)``: it reads ``cached.plan``, checks cheaply that the call
    matches it, calls the jitted function directly, and hands any other call to the
    adapter's general path, which keeps a new plan. The check is the adapter's code in
    that frame: a kit call per call would cost a frame, a measurable share of a cache hit.
    ``hot`` and ``direct`` make it for ``jaxoverride.jit_api``.

    Args:
      cold: the plan that serves no call (``plan`` at first and after ``drop``).
      make_hot: ``make_hot(cached, direct)``: the hot path, or with a ``Direct`` the one
        that a neutral wrapper built in ``direct.stack`` calls.

    Example:
      >>> import jax, jax.numpy as jnp, jaxoverride as jo
      >>> from jaxoverride.adapter_kit import CachedPlan
      >>> def make_hot(cached, direct):
      ...     def general(args):  # the adapter's general path: builds and keeps a plan
      ...         cached.keep(jax.jit(lambda x: 2 * x))
      ...         return cached.plan(*args)
      ...     def hot(*args):
      ...         plan = cached.plan
      ...         return general(args) if plan is None else plan(*args)
      ...     return hot
      >>> cached = CachedPlan(None, make_hot)
      >>> stage = lambda method, args, kwargs: None  # what ``.lower`` and the rest run
      >>> built = lambda: [] if cached.plan is None else [cached.plan]  # for .clear_cache
      >>> double = jo.jit_api(cached.hot(), lambda x: 2 * x, stage=stage, jitted=built)
      >>> double(jnp.ones(2)).tolist(), double(jnp.ones(2)).tolist()
      ([2.0, 2.0], [2.0, 2.0])
    """

    __slots__ = ("cold", "make_hot", "plan")

    def __init__(self, cold: P, make_hot: Callable[[CachedPlan[P], Direct | None], Any]):
        self.plan = self.cold = cold
        self.make_hot = make_hot

    def keep(self, plan: P) -> None:
        """Serves the calls that match ``plan`` from it from now on."""
        self.plan = plan

    def drop(self) -> None:
        """Serves no call from a plan until the general path keeps one again."""
        self.plan = self.cold

    def hot(self) -> Callable[..., Any]:
        """The hot path that an override of ``"jit"`` returns: ``make_hot(self, None)``."""
        return self.make_hot(self, None)

    def direct(
        self,
        current: Callable[[], object],
        stack: object,
        fallback: Callable[..., Any],
        captured: Callable[[], Any] | None = None,
    ) -> Callable[..., Any]:
        """``jaxoverride.jit_api``'s ``direct``, or with ``captured`` its ``checked_direct``
        (for an adapter that covers the state a function captures): the hot path for
        ``stack``."""
        return self.make_hot(self, Direct(current, stack, fallback, captured))
