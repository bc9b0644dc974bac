"""The common part of an adapter's ``custom_vjp``/``custom_jvp``: JAX's rule, and the user's.

An adapter that threads its state through a custom rule builds, per call, a JAX rule over
a lifted function whose first argument is the state. What it needs from the user's
decorated function is always the same: JAX's own rule object built below (for calls
where the adapter has nothing to do, for JAX's checks of the rule functions, and for the
attributes users read), and the rule functions the user defined, to lift at call time.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jaxoverride as jo
from jaxoverride._compat import rule_jvp
from jaxoverride.adapter_kit._argnums import shift_argnums
from jaxoverride.adapter_kit._rule_args import nondiff_positions


class LiftedRule:
    """Base class of an override of ``custom_vjp``/``custom_jvp`` that lifts its state.

    The constructor takes JAX's constructor arguments and builds the rule below
    (``_plain``); ``defvjp``, ``defjvp`` and ``defjvps`` define the rule there too (so
    JAX checks the functions as it does) and record them in ``_rule``:
    ``(fwd, bwd, symbolic_zeros, optimize_remat)`` or ``(jvp, symbolic_zeros)``. Any
    other public attribute is read from the rule below. A subclass defines ``__call__``:
    ``self._plain(*args, **kwargs)`` where it has nothing to do, else its lifted rule.

    Attributes:
      _name: ``"custom_vjp"`` or ``"custom_jvp"``.
      _where: ``"jaxoverride.custom_vjp"``, for messages.
      _below: the implementation below (``jaxoverride.next_impl(name)`` at build time).
      _plain: the rule below, built on the user's function.
      _fun: the user's function.
      _nondiff: the positions of its non-differentiable arguments, names resolved.
      _rule: the user's rule functions, or ``None`` before one is defined.

    Example:
      >>> import jax, jaxoverride as jo
      >>> from jaxoverride import adapter_kit as kit
      >>> class Counted(kit.LiftedRule):
      ...     calls = 0
      ...     def __call__(self, *args, **kwargs):
      ...         Counted.calls += 1
      ...         return self._plain(*args, **kwargs)
      >>> override = {"custom_vjp": lambda fun, *a, **k: Counted("custom_vjp", fun, *a, **k)}
      >>> with jo.override_context(override):
      ...     f = jo.custom_vjp(lambda x: x * 2.0)
      ...     f.defvjp(lambda x: (f(x), None), lambda _, g: (g * 2.0,))
      ...     slope = jax.grad(f)(1.0)
      >>> float(slope), Counted.calls > 0
      (2.0, True)
    """

    def __init__(
        self,
        name: str,
        fun: Callable[..., Any],
        nondiff_argnums: Sequence[int] = (),
        nondiff_argnames: Sequence[str] = (),
    ):
        self._name = name
        self._where = f"jaxoverride.{name}"
        self._below = jo.next_impl(name)
        self._plain = self._below(
            fun, nondiff_argnums=nondiff_argnums, nondiff_argnames=nondiff_argnames
        )
        self._fun = fun
        self._nondiff = _resolved_nondiff(self._plain, fun, nondiff_argnums, nondiff_argnames)
        self._rule: tuple[Any, ...] | None = None

    def defvjp(
        self,
        fwd: Callable[..., Any],
        bwd: Callable[..., Any],
        symbolic_zeros: bool = False,
        optimize_remat: bool = False,
    ) -> None:
        """JAX's ``custom_vjp.defvjp``: defines the rule below and records it."""
        self._plain.defvjp(fwd, bwd, symbolic_zeros=symbolic_zeros, optimize_remat=optimize_remat)
        self._rule = (fwd, bwd, symbolic_zeros, optimize_remat)

    def defjvp(self, jvp: Callable[..., Any], symbolic_zeros: bool = False) -> Callable[..., Any]:
        """JAX's ``custom_jvp.defjvp``: defines the rule below and records it."""
        self._plain.defjvp(jvp, symbolic_zeros=symbolic_zeros)
        self._rule = (jvp, symbolic_zeros)
        return jvp

    def defjvps(self, *jvps: Callable[..., Any] | None) -> None:
        """JAX's ``custom_jvp.defjvps``: JAX combines them into one rule, recorded."""
        self._plain.defjvps(*jvps)
        self._rule = (rule_jvp(self._plain), False)

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("_"):
            raise AttributeError(attribute)
        return getattr(self._plain, attribute)

    @functools.cached_property
    def _lifted_nondiff(self) -> tuple[int, ...]:
        """``_nondiff`` for the lifted function, whose first argument is the state.

        A negative position counts from the end, as before (JAX then treats the argument
        as it does for the user's function).
        """
        return shift_argnums(self._nondiff)

    def _in_order(self, count: int, static: Sequence[Any], primals: Sequence[Any]) -> list[Any]:
        """The user's ``count`` arguments from a lifted JVP rule's nondiff ones (``static``)
        and primal ones, in call order."""
        lifted = count + 1  # the state comes first
        positions = [n % lifted - 1 for n in self._lifted_nondiff]
        ordered: list[Any] = [None] * count
        for position, value in zip(positions, static, strict=True):
            ordered[position] = value
        rest = iter(primals)
        return [ordered[i] if i in positions else next(rest) for i in range(count)]

    @classmethod
    def overrides(cls) -> dict[str, Callable[..., Any]]:
        """The overrides of ``custom_vjp`` and ``custom_jvp`` that build this class.

        Returns:
          ``{"custom_vjp": ..., "custom_jvp": ...}``, each taking JAX's constructor
          arguments and named after the class's module.

        Example:
          >>> from jaxoverride import adapter_kit as kit
          >>> sorted(kit.LiftedRule.overrides())
          ['custom_jvp', 'custom_vjp']
        """

        def builder(name: str) -> Callable[..., Any]:
            def build(
                fun: Callable[..., Any],
                nondiff_argnums: Sequence[int] = (),
                nondiff_argnames: Sequence[str] = (),
            ) -> Any:
                return cls(name, fun, nondiff_argnums, nondiff_argnames)

            build.__name__ = build.__qualname__ = name
            build.__module__ = cls.__module__
            build.__doc__ = (
                f"The override of ``{name}``: JAX's constructor arguments, a ``{cls.__name__}``."
            )
            return build

        return {name: builder(name) for name in ("custom_vjp", "custom_jvp")}


def _resolved_nondiff(
    plain: Any, fun: Callable[..., Any], argnums: Sequence[int], argnames: Sequence[str]
) -> tuple[int, ...]:
    """The non-differentiable positions as the rule below resolved them.

    JAX ignores a name that is no parameter; its next ``custom_vjp`` keeps the positions
    as ``static_argnums``. A rule below that keeps neither gets the same resolution here.
    """
    for attribute in ("nondiff_argnums", "static_argnums"):
        resolved = getattr(plain, attribute, None)
        if resolved is not None:
            return tuple(sorted(resolved))
    try:
        names = set(inspect.signature(fun).parameters)
    except (TypeError, ValueError):
        names = set()
    return nondiff_positions(fun, argnums, [name for name in argnames if name in names])
