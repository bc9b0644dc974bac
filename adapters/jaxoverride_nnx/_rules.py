"""``custom_vjp`` under ``track``: the tracked Variables' values as an explicit argument.

JAX traces a custom rule's primal function at a level of its own and its ``fwd`` one
level up. A neutral loop inside the rule carries every tracked Variable, Params included,
so without lifting, the Variables' values at the caller's level would be closed over by
the rule, which JAX refuses ("differentiation of a custom_vjp function with respect to a
closed-over value"). Here the values go in as a leading argument, the primal and ``fwd``
run with the Variables pointing at them (``run_lifted``, so they may also be written),
and the values after the call come back as an extra output that is written back once.
The leading argument gets a zero cotangent: gradients reach the parameters through the
arguments of the rule, which ``jaxoverride.closure_convert`` provides.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax.errors import TraceContextError
from jax._src.custom_derivatives import CustomVJPPrimal, SymbolicZero

import jaxoverride as jo
from jaxoverride_nnx._compat import chain_on_get_value
from jaxoverride_nnx._errors import LevelError
from jaxoverride_nnx._lift import changed, run_lifted, write_back
from jaxoverride_nnx._scope import current

WHERE = "jaxoverride.custom_vjp"


def _positional(fun: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple:
    """The arguments as JAX binds them: every keyword resolved to its position."""
    if not kwargs:
        return args
    bound = inspect.signature(fun).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.args


def _written(before: Sequence[Any], after: Sequence[Any]) -> list[Any]:
    """The values after the call, ``None`` where a Variable was not written (static)."""
    updates = changed(before, after)
    return [updates.get(index) for index in range(len(after))]


def _is_primal(x: Any) -> bool:
    return isinstance(x, CustomVJPPrimal)


def _unwrap(tree: Any) -> Any:
    return jax.tree.map(lambda x: x.value if _is_primal(x) else x, tree, is_leaf=_is_primal)


def _is_zero(x: Any) -> bool:
    return isinstance(x, SymbolicZero)


def _instantiate(x: Any) -> Any:
    if not isinstance(x, SymbolicZero):
        return x
    aval: Any = x.aval  # the cotangent's type: float0 for integer outputs
    return jnp.zeros(aval.shape, aval.dtype)


class ClosedOverDifferentiationError(ValueError):
    """A custom rule reads a tracked Variable that is being differentiated.

    The rule gives gradients for its explicit arguments only, so the Variable would get a
    silently zero gradient; ``closure_convert`` makes what a function reads explicit.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import jaxoverride as jo, jaxoverride_nnx
      >>> w = nnx.Param(jnp.ones(()))
      >>> f = jo.custom_vjp(lambda x: x * w[...])
      >>> f.defvjp(lambda x: (x * w[...], None), lambda _, g: (g,))
      >>> with jaxoverride_nnx.track(w):
      ...     jo.grad(lambda p: f(1.0))(w)
      Traceback (most recent call last):
      ...
      jaxoverride_nnx._rules.ClosedOverDifferentiationError: jaxoverride.custom_vjp: ...
    """


@contextlib.contextmanager
def _refusing_reads(tracked: Any, perturbed: list[int]) -> Iterator[None]:
    """Refuses reads of the Variables being differentiated, at the read itself.

    A custom rule gives gradients for its explicit arguments only: a Variable that it
    reads directly would get a silently zero gradient (raw JAX refuses the same for a
    closed-over tracer). NNX calls ``on_get_value`` hooks on every user read
    (``variable[...]``, ``.value``); the adapter's own plumbing reads the raw value and
    is not seen.
    """
    if not perturbed:
        yield
        return

    def refuse(variable: Any, value: Any) -> Any:
        path = tracked.path(tracked.var_index(variable))
        raise ClosedOverDifferentiationError(
            f"{WHERE}: the rule reads the tracked Variable `{path}`, which is being "
            "differentiated, without having it as an argument. A custom rule gives gradients "
            "for its explicit arguments only, so it would get a silently zero gradient. Pass "
            "it in: jaxoverride.closure_convert(f, *example_args) hoists what f reads into "
            "explicit arguments (or pass the parameters to the library's solve/run call)."
        )

    saved = []
    for index in perturbed:
        metadata = tracked.variables[index]._var_metadata
        old = metadata.get("on_get_value")
        metadata["on_get_value"] = chain_on_get_value(refuse, old)
        saved.append((metadata, old))
    try:
        yield
    finally:
        for metadata, old in saved:
            if old is None:
                metadata.pop("on_get_value", None)
            else:
                metadata["on_get_value"] = old


def _argnums(fun: Callable[..., Any], argnums: Sequence[int], argnames: Sequence[str]) -> set[int]:
    found = set(argnums)
    if argnames:
        names = list(inspect.signature(fun).parameters)
        found |= {names.index(name) for name in argnames}
    return found


class LiftedVJP:
    """What the NNX override of ``custom_vjp`` builds: JAX's rule, Variables lifted."""

    def __init__(
        self, fun: Callable[..., Any], nondiff_argnums: Sequence[int] = (),
        nondiff_argnames: Sequence[str] = (),
    ):  # fmt: skip
        below = jo.next_impl("custom_vjp")
        self._plain = below(fun, nondiff_argnums=nondiff_argnums, nondiff_argnames=nondiff_argnames)
        self._below = below
        self._fun = fun
        self._nondiff = _argnums(fun, nondiff_argnums, nondiff_argnames)
        self._rules: tuple[Any, ...] | None = None

    def defvjp(
        self,
        fwd: Callable[..., Any],
        bwd: Callable[..., Any],
        symbolic_zeros: bool = False,
        optimize_remat: bool = False,
    ) -> None:
        self._plain.defvjp(fwd, bwd, symbolic_zeros=symbolic_zeros, optimize_remat=optimize_remat)
        self._rules = (fwd, bwd, symbolic_zeros, optimize_remat)

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("_"):
            raise AttributeError(attribute)
        return getattr(self._plain, attribute)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tracked = current()
        if tracked is None or self._rules is None:
            return self._plain(*args, **kwargs)
        args = _positional(self._fun, args, kwargs)
        fun, (fwd, bwd, symbolic_zeros, optimize_remat) = self._fun, self._rules
        nondiff = sorted(self._nondiff)

        def lifted(values: list[Any], *inner: Any) -> Any:
            out, after = run_lifted(tracked, values, fun, inner, {}, WHERE)
            return out, _written(values, after)

        def lifted_fwd(values: Any, *inner: Any) -> Any:
            perturbed = [
                index
                for index, value in enumerate(values)
                if any(leaf.perturbed for leaf in jax.tree.leaves(value, is_leaf=_is_primal))
            ]
            values = _unwrap(values)
            if not symbolic_zeros:
                inner = _unwrap(inner)
            with _refusing_reads(tracked, [i for i in perturbed if i < len(tracked.variables)]):
                (out, residuals), after = run_lifted(tracked, values, fwd, inner, {}, WHERE)
            return (out, _written(values, after)), residuals

        def lifted_bwd(*rest: Any) -> Any:
            *static, residuals, (out_cotangent, _) = rest
            if not symbolic_zeros:
                out_cotangent = jax.tree.map(_instantiate, out_cotangent, is_leaf=_is_zero)
            return (None, *bwd(*static, residuals, out_cotangent))

        rule = self._below(lifted, nondiff_argnums=tuple(n + 1 for n in nondiff))
        # Symbolic zeros tell which Variables are being differentiated (see
        # _refuse_differentiated_reads); the user's rules see them only if they asked.
        rule.defvjp(lifted_fwd, lifted_bwd, symbolic_zeros=True, optimize_remat=optimize_remat)
        out, written = rule(tracked.read(), *args)
        updates = {index: value for index, value in enumerate(written) if value is not None}
        write_back(tracked, updates, WHERE)
        return out


def custom_vjp(
    fun: Callable[..., Any], nondiff_argnums: Sequence[int] = (),
    nondiff_argnames: Sequence[str] = (),
) -> LiftedVJP:  # fmt: skip
    return LiftedVJP(fun, nondiff_argnums, nondiff_argnames)


class PureFunctionWriteError(RuntimeError):
    """A tracked Variable written inside a function that ``closure_convert`` makes pure.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import jaxoverride as jo, jaxoverride_nnx
      >>> counter = nnx.Variable(jnp.array(0))
      >>> def g(v):
      ...     counter[...] += 1
      ...     return v
      >>> with jaxoverride_nnx.track(counter):
      ...     jo.closure_convert(g, jnp.ones(2))
      Traceback (most recent call last):
      ...
      jaxoverride_nnx._rules.PureFunctionWriteError: jaxoverride.closure_convert: ...
    """


def closure_convert(fun: Callable[..., Any], *example_args: Any) -> Any:
    below = jo.next_impl("closure_convert")
    if current() is None:
        return below(fun, *example_args)
    # JAX caches a conversion by the function's identity and argument types, constants
    # included: a tracked module's weights, changed since, would come back stale (and,
    # under jo.grad, unperturbed: a silently zero gradient). A new function per call
    # never hits that cache.
    fresh = lambda *args: fun(*args)
    try:
        return below(fresh, *example_args)
    except (LevelError, TraceContextError) as error:
        raise PureFunctionWriteError(
            "jaxoverride.closure_convert: a tracked NNX Variable was written inside the "
            "function being converted. Closure conversion turns it into a pure jaxpr of its "
            "inputs, so the write could never come out. Move the write out of the converted "
            "function (before or after the solver call), or use the solver's non-implicit "
            "mode (fpsolve's implicit=False, jaxopt's implicit_diff=False). "
            f"NNX said: {error}"
        ) from error
