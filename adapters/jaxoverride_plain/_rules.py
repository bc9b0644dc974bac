"""Init-safe implicit differentiation: custom rules, closure conversion, custom solves.

Each runs the user's primal function once outside any trace before JAX sees it, so
``closure_convert`` hoists existing parameters and a rule's ``fwd``/``bwd`` only read them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jaxoverride as jo
from jaxoverride import adapter_kit as kit
from jaxoverride.adapter_kit import init_safe_call


class InitSafeRule:
    """A JAX ``custom_vjp``/``custom_jvp`` object whose call at init creates parameters first.

    ``defvjp``, ``defjvp``, ``defjvps`` and the rules' attributes are the JAX object's.
    """

    __slots__ = ("_built", "_fun")

    def __init__(self, built: Any, fun: Callable[..., Any]):
        self._built = built
        self._fun = fun

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return init_safe_call(
            lambda: self._fun(*args, **kwargs), lambda: self._built(*args, **kwargs)
        )

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._built, attribute)


def rule(name: str) -> Callable[..., InitSafeRule]:
    """The override of ``custom_vjp`` or ``custom_jvp``."""

    def build(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> InitSafeRule:
        return InitSafeRule(jo.next_impl(name)(fun, *args, **kwargs), fun)

    build.__qualname__ = f"init_safe_{name}"
    return build


CONVERSIONS: dict[str, Callable[..., Any]] = kit.conversion_overrides(
    lambda: True,
    lambda where, fun, trace, creation: kit.init_safe_call(creation, lambda: trace(fun)),
    module=__name__,
)
"""Neutral name -> init-safe override, for the names that convert a function."""
