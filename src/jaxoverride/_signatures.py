"""Static types of the neutral transforms: each keeps the signature of the function it takes.

Only type checkers read these (``jaxoverride.jit`` is a ``cast`` to ``JitTransform``
at runtime). ``jo.jit(f)`` is typed as taking ``f``'s parameters and returning ``f``'s
result, with JAX's jitted API (``lower``, ``trace``, ``eval_shape``, ``clear_cache``);
``jo.vmap(f)`` and ``jo.checkpoint(f)`` keep ``f``'s type, as JAX's ``vmap`` does;
``jo.grad(f)`` and the Jacobians keep ``f``'s parameters. Options stay ``Any``, as
JAX's own annotations leave most of them loose.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ParamSpec, Protocol, TypeVar, overload

P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


class Jitted(Protocol[P, R_co]):
    """What ``jaxoverride.jit(f)`` returns: ``f``'s signature, and JAX's jitted API."""

    @property
    def __wrapped__(self) -> Callable[P, R_co]: ...

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R_co: ...

    def lower(self, *args: P.args, **kwargs: P.kwargs) -> Any: ...

    def trace(self, *args: P.args, **kwargs: P.kwargs) -> Any: ...

    def eval_shape(self, *args: P.args, **kwargs: P.kwargs) -> Any: ...

    def clear_cache(self) -> None: ...


class JitTransform(Protocol):
    """``jaxoverride.jit``: ``jit(f, **options)``, or ``jit(**options)`` as a decorator."""

    @overload
    def __call__(self, fun: Callable[P, R], /, **options: Any) -> Jitted[P, R]: ...

    @overload
    def __call__(self, /, **options: Any) -> Callable[[Callable[P, R]], Jitted[P, R]]: ...

    def __call__(self, *args: Any, **options: Any) -> Any: ...


class SameTypeTransform(Protocol):
    """``vmap``, ``checkpoint``, ``remat``: the result is called as ``fun`` is."""

    def __call__(self, fun: Callable[P, R], /, *args: Any, **kwargs: Any) -> Callable[P, R]: ...


class SameParametersTransform(Protocol):
    """``grad``, ``jacfwd``, ``jacrev``, ``hessian``, ``pmap``, ``make_jaxpr``: the result
    takes ``fun``'s arguments and returns something else (a gradient, a jaxpr ...)."""

    def __call__(self, fun: Callable[P, Any], /, *args: Any, **kwargs: Any) -> Callable[P, Any]: ...


class ValueAndGradTransform(Protocol):
    """``value_and_grad``: ``fun``'s arguments, a ``(value, gradient)`` pair."""

    def __call__(
        self, fun: Callable[P, Any], /, *args: Any, **kwargs: Any
    ) -> Callable[P, tuple[Any, Any]]: ...


class EvalShape(Protocol):
    """``eval_shape``: ``fun`` and the arguments it takes."""

    def __call__(self, fun: Callable[P, Any], /, *args: P.args, **kwargs: P.kwargs) -> Any: ...
