"""``grad``, ``value_and_grad``, ``jacfwd``, ``jacrev`` and ``hessian`` with tied leaves.

The differentiated arguments and the rest are encoded as two groups (identity holds within
each, so ``grad(lambda a, b: jnp.sum(a * b))(w, w)`` is JAX's answer). A shared array is one
input, so its gradient is summed over its uses and placed at each position; leaves that
cannot be differentiated get ``None``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

import jaxoverride as jo
from jaxoverride_dag._out import pack, unforward_tree
from jaxoverride_dag._plan import Plan, encode


def _argnums(api: str, argnums: int | Any, count: int) -> tuple[tuple[int, ...], bool]:
    single = isinstance(argnums, int)
    nums = (argnums,) if single else tuple(argnums)
    if not nums:
        raise ValueError(f"jaxoverride_dag.{api}: argnums must not be empty, got {argnums!r}.")
    out = []
    for i in nums:
        if not isinstance(i, int) or not -count <= i < count:
            raise TypeError(
                f"jaxoverride_dag.{api}: differentiating with respect to argnums={argnums!r} "
                f"requires at least {(i + 1) if isinstance(i, int) and i >= 0 else '?'} "
                f"positional arguments to be passed by the caller, but got only {count} "
                "positional arguments."
            )
        out.append(i % count)
    return tuple(out), single


def _differentiable(x: Any, allow_int: bool) -> bool:
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        if isinstance(x, bool):
            return allow_int
        return isinstance(x, float | complex) or (allow_int and isinstance(x, int))
    try:
        if np.issubdtype(dtype, np.inexact):
            return True
        return allow_int and (np.issubdtype(dtype, np.integer) or np.issubdtype(dtype, np.bool_))
    except TypeError:  # extended dtypes such as PRNG keys
        return False


class _Split:
    """One call split into the differentiated group and the rest, each with its plan."""

    __slots__ = (
        "argnums",
        "count",
        "diff_plan",
        "dpos",
        "dyn",
        "kwargs_plan",
        "rest_dyn",
        "single",
    )

    def __init__(
        self, api: str, argnums: Any, allow_int: bool, args: tuple[Any, ...], kwargs: dict[str, Any]
    ):
        self.argnums, self.single = _argnums(api, argnums, len(args))
        self.count = len(args)
        diff = tuple(args[i] for i in self.argnums)
        rest = tuple(a for i, a in enumerate(args) if i not in self.argnums)
        self.diff_plan, self.dyn = encode(diff, f"{api} differentiated arguments")
        self.kwargs_plan, self.rest_dyn = encode((rest, kwargs), f"{api} other arguments")
        self.dpos = tuple(i for i, x in enumerate(self.dyn) if _differentiable(x, allow_int))

    def primals(self) -> tuple[tuple[Any, ...], list[Any], list[Any]]:
        return tuple(self.dyn[i] for i in self.dpos), self.dyn, self.rest_dyn

    def call(
        self, fun: Callable[..., Any], dvals: tuple[Any, ...], dyn: list[Any], rest_dyn: list[Any]
    ) -> Any:
        full = list(dyn)
        for k, i in enumerate(self.dpos):
            full[i] = dvals[k]
        diff = self.diff_plan.decode_inside(full)
        rest, kwargs = self.kwargs_plan.decode_inside(rest_dyn)
        rest_iter = iter(rest)
        position = dict(zip(self.argnums, diff, strict=True))
        args = [position[i] if i in position else next(rest_iter) for i in range(self.count)]
        return fun(*args, **kwargs)

    def gradient(self, grads: tuple[Any, ...]) -> Any:
        """The gradient laid out like the differentiated arguments, sharing included."""
        plan: Plan = self.diff_plan
        leaves: list[Any] = [None] * plan.n_dyn
        for k, i in enumerate(self.dpos):
            leaves[i] = grads[k]
        tree = plan.decode(leaves, (None,) * len(plan.statics))
        return tree[0] if self.single else tree


def _is_pair(out: Any) -> bool:
    """What JAX accepts as ``(output, aux)`` from a function with ``has_aux=True``."""
    return isinstance(out, list | tuple) and len(out) == 2


# How an override lays out JAX's result: ``finish(split, result)``.
_Finish = Callable[[_Split, Any], Any]


def _lowered(
    api: str,
    fun: Callable[..., Any],
    argnums: Any,
    has_aux: bool,
    allow_int: bool,
    options: dict[str, Any],
    finish: _Finish,
    pack_outputs: bool,
) -> Callable[..., Any]:
    """JAX's ``api`` (``argnums=0``) over the encoded call; ``finish(split, result)``.

    With ``pack_outputs`` the outputs are encoded too (the Jacobians mirror their sharing).
    """
    below = jo.next_impl(api)

    def transformed(*args: Any, **kwargs: Any) -> Any:
        split = _Split(api, argnums, allow_int, args, kwargs)

        def inner(dvals: tuple[Any, ...], dyn: list[Any], rest_dyn: list[Any]) -> Any:
            out = split.call(fun, dvals, dyn, rest_dyn)
            if has_aux and not _is_pair(out):
                return out  # JAX's own error names what was returned
            aux: Any = None
            if has_aux:
                out, aux = out
            if pack_outputs:
                out = pack(out, f"{api} outputs")
            return (out, pack(aux, f"{api} aux")) if has_aux else out

        primals = split.primals()
        result = below(inner, argnums=0, has_aux=has_aux, **options)(*primals)
        return finish(split, unforward_tree(result, [*primals[1], *primals[2]]))

    transformed.__wrapped__ = fun  # type: ignore[attr-defined]
    return transformed


def _gradient_of(with_value: bool, has_aux: bool) -> _Finish:
    """How ``grad`` (``with_value=False``) or ``value_and_grad`` lays out JAX's result."""

    def finish(split: _Split, result: Any) -> Any:
        if with_value:
            (value, grads) = result
            if has_aux:
                value = (value[0], value[1].unpack())
            return value, split.gradient(grads)
        if has_aux:
            grads, aux = result
            return split.gradient(grads), aux.unpack()
        return split.gradient(result)

    return finish


def _jacobian_of(has_aux: bool) -> _Finish:
    """How the Jacobians lay out JAX's result: blocks decoded like the outputs."""

    def finish(split: _Split, result: Any) -> Any:
        jac = result[0] if has_aux else result
        out_plan: Plan = jac.plan
        blocks = [split.gradient(block) for block in jac.leaves]
        tree = out_plan.decode(blocks, (None,) * len(out_plan.statics))
        return (tree, result[1].unpack()) if has_aux else tree

    return finish


def _override(
    api: str, finish_of: Callable[[bool], _Finish], pack_outputs: bool, doc: str
) -> Callable[..., Callable[..., Any]]:
    """The override of ``api`` (JAX's signature, ``allow_int`` included)."""

    def override(
        fun: Callable[..., Any],
        argnums: int | Any = 0,
        has_aux: bool = False,
        holomorphic: bool = False,
        allow_int: bool = False,
        **options: Any,
    ) -> Callable[..., Any]:
        options = {"holomorphic": holomorphic, "allow_int": allow_int, **options}
        finish = finish_of(has_aux)
        return _lowered(api, fun, argnums, has_aux, allow_int, options, finish, pack_outputs)

    override.__name__ = override.__qualname__ = f"dag_{api}"
    override.__doc__ = doc
    return override


_SUMMED = "JAX's signature, tied leaves summed."
dag_value_and_grad = _override(
    "value_and_grad",
    functools.partial(_gradient_of, True),
    False,
    f"The ``'value_and_grad'`` override: {_SUMMED}",
)
dag_grad = _override(
    "grad", functools.partial(_gradient_of, False), False, f"The ``'grad'`` override: {_SUMMED}"
)
dag_jacrev = _override(
    "jacrev",
    _jacobian_of,
    True,
    "The ``'jacrev'`` override: JAX's signature; the Jacobian mirrors the sharing.",
)


def dag_jacfwd(
    fun: Callable[..., Any],
    argnums: int | Any = 0,
    has_aux: bool = False,
    holomorphic: bool = False,
    **options: Any,
) -> Callable[..., Any]:
    """The ``"jacfwd"`` override: JAX's signature; the Jacobian mirrors the sharing."""
    options = {"holomorphic": holomorphic, **options}
    return _lowered("jacfwd", fun, argnums, has_aux, False, options, _jacobian_of(has_aux), True)


def dag_hessian(
    fun: Callable[..., Any],
    argnums: Any = 0,
    has_aux: bool = False,
    holomorphic: bool = False,
) -> Callable[..., Any]:
    """The ``"hessian"`` override: this adapter's ``jacfwd(jacrev(fun))``."""
    inner = dag_jacrev(fun, argnums, has_aux=has_aux, holomorphic=holomorphic)
    return dag_jacfwd(inner, argnums, has_aux=has_aux, holomorphic=holomorphic)
