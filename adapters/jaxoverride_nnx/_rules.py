"""``custom_vjp`` and ``custom_jvp`` under ``track``: the tracked Variables' values as an
explicit argument.

JAX traces a custom rule's primal function at a level of its own and its ``fwd`` one
level up. A neutral loop inside the rule carries every tracked Variable, Params included,
so without lifting, the Variables' values at the caller's level would be closed over by
the rule, which JAX refuses ("differentiation of a custom_vjp function with respect to a
closed-over value"). Here the values go in as a leading argument, the primal and ``fwd``
run with the Variables pointing at them (``run_lifted``, so they may also be written),
and the values after the call come back as an extra output that is written back once.
The leading argument gets a zero cotangent: gradients reach the parameters through the
arguments of the rule, which ``jaxoverride.closure_convert`` provides. ``custom_jvp`` does
the same with its primal function and JVP rule (the written values get zero tangents).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax._src.custom_derivatives import _sum_tangents, _zeros_like_pytree
from jax.custom_derivatives import SymbolicZero

from jaxoverride import errors
from jaxoverride.adapter_kit import (
    LiftedRule,
    argument_types,
    bwd_cotangents,
    check_bwd_types,
    fwd_output_pair,
    instantiate_zeros,
    jvp_output_pair,
    perturbed_leaves,
    positional_arguments,
    rule_jvp,
    unwrap_primals,
)
from jaxoverride_nnx._compat import chain_on_get_value
from jaxoverride_nnx._lift import run_lifted, write_back
from jaxoverride_nnx._solve import frozen_values, policy_for, resumed, written as declared_writes
from jaxoverride_nnx._touched import NeedsState, Threads, given_values
from jaxoverride_nnx._tracked import Tracked, current

WHERE = "jaxoverride.custom_vjp"


def _written(order: Sequence[int], given: dict[int, Any], after: Sequence[Any]) -> list[Any]:
    """The given Variables' values after the call, in ``order``; ``None`` where a Variable
    was not written (static)."""
    return [None if after[i] is given[i] else after[i] for i in order]


class ClosedOverDifferentiationError(errors.ClosedOverDifferentiationError):
    """A custom rule reads a tracked Variable that is being differentiated.

    The NNX case of ``jaxoverride.errors.ClosedOverDifferentiationError``.

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
      jaxoverride_nnx.ClosedOverDifferentiationError: jaxoverride.custom_vjp: ...
    """


class PureFunctionWriteError(errors.PureFunctionWriteError):
    """A tracked Variable written where the write could never come out.

    The NNX case of ``jaxoverride.errors.PureFunctionWriteError``.

    Raised for a write inside a function that ``closure_convert``, ``lax.custom_root`` or
    ``lax.custom_linear_solve`` turn into a pure jaxpr of its inputs, and inside a custom
    rule's backward pass (``bwd``), which JAX traces while it transposes: its only outputs
    are cotangents.

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
      jaxoverride_nnx.PureFunctionWriteError: jaxoverride.closure_convert: ...
    """


def write_refused(
    tracked: Any, written: dict[int, Any], what: str, why: str, fix: str, where: str = WHERE
) -> Exception:
    paths = ", ".join(f"`{tracked.path(index)}`" for index in sorted(written))
    return PureFunctionWriteError(
        f"{where}: {what} wrote the tracked Variable(s) {paths}. {why}, so the write could "
        f"never come out. {fix} Every Variable was left as it was."
    )


@contextlib.contextmanager
def _refusing_reads(tracked: Any, perturbed: list[int], where: str = WHERE) -> Iterator[None]:
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
        raise ClosedOverDifferentiationError.reading(where, f"the tracked Variable `{path}`")

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


class _SameWrites:
    """Makes a rule's primal function and its forward rule return one structure.

    JAX needs the primal function and ``fwd`` (or the JVP rule) to return the same outputs,
    and the written Variables are outputs here. Each may be traced alone (under ``jo.grad``
    only the rule is), or both, in either order: whichever is traced second returns the
    Variables that the first wrote, an unchanged one as its value (a write of the same
    value). Writing a Variable that the first did not is refused, with the fix.
    """

    def __init__(self, tracked: Any, where: str, rule: str, order: Sequence[int]):
        self._tracked = tracked
        self._where = where
        self._rule = rule
        self._order = order  # the given Variables' indices, in the outputs' order
        self._first: tuple[str, frozenset[int]] | None = None
        self.primal_out: Any = None  # the primal function's output types, once traced

    def conform(self, role: str, given: dict[int, Any], after: Sequence[Any]) -> list[Any]:
        written = _written(self._order, given, after)
        pairs = zip(self._order, written, strict=True)
        mine = frozenset(i for i, value in pairs if value is not None)
        if self._first is None or self._first[0] == role:
            self._first = (role, mine)
            return written
        other_role, other = self._first
        if extra := mine - other:
            paths = ", ".join(f"`{self._tracked.path(index)}`" for index in sorted(extra))
            raise TypeError(
                f"{self._where}: the {role} wrote the tracked Variable(s) {paths}, which the "
                f"{other_role} does not write. JAX needs both to return the same outputs, the "
                f"written state included. Make the {self._rule} compute its primal output by "
                "calling the decorated function, or write the same state in both."
            )
        return [
            given[i] if i in other and w is None else w
            for i, w in zip(self._order, written, strict=True)
        ]


class _LiftedRule(LiftedRule):
    """What ``LiftedVJP`` and ``LiftedJVP`` share: the kit's ``LiftedRule`` (JAX's rule
    below for the untracked path, the user's rule functions recorded), and one call of a
    rule over the lifted function on the tracked path."""

    _kind = ""

    def __init__(
        self, fun: Callable[..., Any], nondiff_argnums: Sequence[int] = (),
        nondiff_argnames: Sequence[str] = (),
    ):  # fmt: skip
        super().__init__(self._kind, fun, nondiff_argnums, nondiff_argnames)
        self._threads = Threads()  # the modules that the rule's functions touch

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tracked = current()
        if tracked is None or self._rule is None:
            return self._plain(*args, **kwargs)
        if not self._resolvable(args, kwargs):  # JAX's own error, about the user's function
            return self._plain(*args, **kwargs)
        args = positional_arguments(self._fun, args, kwargs)
        count = len(tracked.variables)
        functions = (self._fun, *self._rule[:2])
        # Under jaxoverride.solve_state: the values are frozen at this read, and the rule's
        # functions, the backward rule too (traced after the declaration exited), run
        # under the declaration of this call.
        policy = policy_for(tracked)

        def attempt(given: frozenset[int], owner: object) -> Any:
            live = _Live(owner, policy)
            if not given:  # JAX's rule over the user's functions, run with probes
                try:
                    return self._probing_rule(tracked, live)(*args), {}
                finally:
                    live.done = True
            values = given_values(tracked, given, (*functions, args))
            if policy is not None:
                order_all = sorted(values)
                live.received = policy.current(dict(values))
                frozen = frozen_values(policy, tracked, order_all, [values[i] for i in order_all])
                values = dict(zip(order_all, frozen, strict=True))
            order = [i for i in sorted(given) if i < count]
            rule = self._lifted_rule(tracked, order, live, args)
            try:
                out, written = rule(values, *args)
            finally:
                live.done = True
                live.received = None  # values of the caller's trace: a later run keeps none
            pairs = zip(order, written, strict=True)
            return out, {i: value for i, value in pairs if value is not None}

        out, updates = self._threads.run(tracked, attempt, functions)
        write_back(tracked, declared_writes(policy, tracked, updates), self._where)
        return out

    def _resolvable(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether JAX resolves the call's arguments to positions (else it raises)."""
        try:
            signature = inspect.signature(self._fun)
        except (TypeError, ValueError):
            return True  # JAX decides
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return False
        return not bound.kwargs  # keyword-only arguments have no position

    def _lifted_rule(
        self, tracked: Tracked, order: list[int], live: _Live, args: tuple[Any, ...]
    ) -> Any:
        raise NotImplementedError

    def _probing_rule(self, tracked: Tracked, live: _Live) -> Any:
        """JAX's rule over the user's own functions, each run with every tracked value a
        probe: as long as they touch no tracked module, the rule is the user's (JAX's
        jaxprs, and JAX's errors about the user's functions); a touch retraces with it."""
        where = self._where

        def probing(fn: Callable[..., Any], role: str) -> Callable[..., Any]:
            def probed(*inner: Any) -> Any:
                return live.run(tracked, {}, fn, inner, where, role)[0]

            return _named_as(probed, fn)

        rule = self._below(
            probing(self._fun, "primal function"), nondiff_argnums=tuple(sorted(self._nondiff))
        )
        self._define(rule, probing)
        return rule

    def _define(self, rule: Any, probing: Callable[..., Any]) -> None:
        raise NotImplementedError

    def _primal(self, tracked: Tracked, same: _SameWrites, live: _Live) -> Callable[..., Any]:
        """The primal function over the tracked values, named as JAX names ``fun``."""
        fun, where = self._fun, self._where

        def lifted(values: dict[int, Any], *inner: Any) -> Any:
            out, after = live.run(tracked, values, fun, inner, where, "primal function")
            with contextlib.suppress(TypeError):  # not JAX types: JAX's own error follows
                same.primal_out = jax.tree.map(jax.typeof, out)
            return out, same.conform("primal function", values, after)

        return _named_as(lifted, fun)

    def _shifted_nondiff(self) -> tuple[int, ...]:
        return tuple(n + 1 for n in sorted(self._nondiff))


class _Live:
    """One call of a lifted rule: its probes' mark, and whether the call still runs.

    JAX may trace ``fwd`` or the JVP rule after the call returned (under
    ``jax.grad(jax.jit(f))``) and traces ``bwd`` while it transposes: a module touched
    there first can no longer be given to the call, and is refused with the fix.
    """

    __slots__ = ("done", "owner", "policy", "received")

    def __init__(self, owner: object, policy: Any = None):
        self.owner = owner
        self.done = False
        self.policy = policy  # the jaxoverride.solve_state participant of the call
        # What the evaluations before the call left (read at the call, the same for every
        # function of the rule traced during it); after the call, the values given.
        self.received: dict[int, Any] | None = None

    def run(
        self,
        tracked: Tracked,
        values: dict[int, Any],
        fn: Callable[..., Any],
        args: Sequence[Any],
        where: str,
        role: str,
    ) -> tuple[Any, list[Any]]:
        try:
            with resumed(self.policy):
                return run_lifted(
                    tracked,
                    values,
                    fn,
                    args,
                    {},
                    where,
                    owner=self.owner,
                    policy=self.policy,
                    rebase=True,
                    received=values if self.received is None else self.received,
                )
        except NeedsState as error:
            if error.owner is not self.owner or not self.done:
                raise
            raise RuntimeError(
                f"{where}: the {role}, traced by JAX after the call returned, uses the "
                f"tracked Variable `{tracked.path(error.index)}` (or its module), which the "
                "primal function does not use, so it was not given to the rule. Use the "
                "same modules in the primal function and in the rules (a rule usually "
                "calls the primal function), or pass the value as an argument."
            ) from None


def _named_as(lifted: Callable[..., Any], user: Callable[..., Any]) -> Callable[..., Any]:
    """``lifted`` under the user's function's name and source location, so that JAX's
    errors and jaxprs name the user's function, not the adapter's. Its own signature
    stays: JAX binds arguments with ``inspect.signature``."""
    signature = inspect.signature(lifted)
    name = _name(user)
    lifted.__name__ = name
    lifted.__qualname__ = getattr(user, "__qualname__", name)
    module = getattr(user, "__module__", None)
    if isinstance(module, str):
        lifted.__module__ = module
    lifted.__signature__ = signature  # type: ignore[attr-defined]
    lifted.__wrapped__ = user  # type: ignore[attr-defined]  # JAX's source info
    return lifted


def _name(fun: Any) -> str:
    """JAX's name for a function (``jax._src.util.fun_name``)."""
    name = getattr(fun, "__name__", None)
    if isinstance(name, str):
        return name
    if isinstance(fun, functools.partial):
        return _name(fun.func)
    return "<unnamed function>"


class LiftedVJP(_LiftedRule):
    """What the NNX override of ``custom_vjp`` builds: JAX's rule, Variables lifted."""

    _kind = "custom_vjp"

    def _define(self, rule: Any, probing: Callable[..., Any]) -> None:
        assert self._rule is not None
        fwd, bwd, symbolic_zeros, optimize_remat = self._rule
        rule.defvjp(
            probing(fwd, "forward rule (fwd)"),
            probing(bwd, "bwd rule"),
            symbolic_zeros=symbolic_zeros,
            optimize_remat=optimize_remat,
        )

    def _lifted_rule(
        self, tracked: Tracked, order: list[int], live: _Live, args: tuple[Any, ...]
    ) -> Any:
        assert self._rule is not None
        fun, (fwd, bwd, symbolic_zeros, optimize_remat) = self._fun, self._rule
        count = len(tracked.variables)
        primals = tuple(arg for index, arg in enumerate(args) if index not in self._nondiff)
        primal_tree, primal_types = jax.tree.structure(primals), argument_types(primals)
        # Symbolic zeros tell which Variables are being differentiated (see
        # _refusing_reads); the user's rules see them only if they asked. JAX's remat
        # optimisation takes no symbolic zeros: there, as with JAX's own rule, nothing
        # tells which closed-over values are differentiated. Given no Variable, the rule
        # is the user's.
        symbolic = not optimize_remat if order else symbolic_zeros
        same = _SameWrites(tracked, WHERE, "forward rule (fwd)", order)

        def lifted_fwd(values: Any, *inner: Any) -> Any:
            perturbed = [
                index
                for index, value in values.items()
                if symbolic and index < count and any(perturbed_leaves(value))
            ]
            values = unwrap_primals(values)
            if not symbolic_zeros:
                inner = unwrap_primals(inner)
            with _refusing_reads(tracked, perturbed):
                pair, after = live.run(tracked, values, fwd, inner, WHERE, "forward rule (fwd)")
            out, residuals = fwd_output_pair(pair, fwd, fun, same.primal_out)
            written = same.conform("forward rule (fwd)", values, after)
            return (out, written), (values, residuals)

        def lifted_bwd(*rest: Any) -> Any:
            *static, (values, residuals), (out_cotangent, _) = rest
            if not symbolic_zeros:
                out_cotangent = instantiate_zeros(out_cotangent)
            # JAX traces bwd later, while it transposes (possibly inside a jit's transpose
            # trace): the Variables then hold whatever the caller's level left in them, and
            # a neutral loop in bwd would carry those as foreign constants ("No constant
            # handler for DynamicJaxprTracer"). bwd sees the values of the call instead.
            cotangents, after = live.run(
                tracked, values, bwd, (*static, residuals, out_cotangent), WHERE, "bwd rule"
            )
            written = {i: after[i] for i in order if after[i] is not values[i]}
            if written and live.policy is None:  # under solve_state: dropped
                raise write_refused(
                    tracked,
                    written,
                    "the custom_vjp's backward rule (bwd)",
                    "JAX traces it while it transposes, and its only outputs are cotangents",
                    "Keep state writes out of what bwd calls (a library's implicit "
                    "differentiation calls your function again in its backward pass: "
                    "jaxopt's implicit_diff=True does), declare what a solver's "
                    "evaluations see with `with jaxoverride.solve_state(): ...` around the "
                    "solver call (a backward pass's writes are then dropped), or use the "
                    "library's non-implicit mode (jaxopt's implicit_diff=False).",
                )
            cotangents = bwd_cotangents(cotangents, primal_tree)
            check_bwd_types(cotangents, primal_types, fun)  # JAX's check, the user's indices
            return (None, *cotangents)

        rule = self._below(
            self._primal(tracked, same, live), nondiff_argnums=self._shifted_nondiff()
        )
        rule.defvjp(
            _named_as(lifted_fwd, fwd),
            _named_as(lifted_bwd, bwd),
            symbolic_zeros=symbolic,
            optimize_remat=optimize_remat,
        )
        return rule


# The override takes JAX's constructor arguments, as ``LiftedVJP`` does.
custom_vjp = LiftedVJP


WHERE_JVP = "jaxoverride.custom_jvp"


def _tangent_zero(value: Any) -> Any:
    """A symbolic zero tangent for a written Variable's value (state, not differentiated)."""
    return SymbolicZero(jax.typeof(value).to_tangent_aval())


def _interleave(static: Sequence[Any], primals: Sequence[Any], nondiff: Sequence[int]) -> list:
    """The arguments in the function's order, from JAX's (nondiff first) split."""
    static_it, primal_it = iter(static), iter(primals)
    total = len(static) + len(primals)
    return [next(static_it) if i in nondiff else next(primal_it) for i in range(total)]


class LiftedJVP(_LiftedRule):
    """What the NNX override of ``custom_jvp`` builds: JAX's rule, Variables lifted.

    The contract is ``LiftedVJP``'s: the tracked values enter as a leading argument, the
    primal function (when JAX calls it) or the JVP rule (when JAX differentiates) runs with
    the Variables pointing at them and may write them, and the values after the call come
    back as an extra output with a zero tangent, written back once.
    """

    _kind = "custom_jvp"

    def defjvps(self, *jvps: Callable[..., Any] | None) -> None:
        self._plain.defjvps(*jvps)  # JAX's checks (no nondiff_argnums)
        fun = self._fun

        # JAX's own composition calls the decorated object for the primal output; inside
        # the lifted rule the Variables already hold this call's values, so call ``fun``.
        def jvp(primals: Sequence[Any], tangents: Sequence[Any]) -> Any:
            primal_out = fun(*primals)
            zeros = _zeros_like_pytree(primal_out)
            each = [
                rule(t, primal_out, *primals) if rule else zeros
                for t, rule in zip(tangents, jvps, strict=False)
            ]
            return primal_out, jax.tree.map(_sum_tangents, primal_out, *each)

        composed = rule_jvp(self._plain)
        assert composed is not None  # JAX's defjvps just defined it
        self._rule = (_named_as(jvp, composed), False)

    def _define(self, rule: Any, probing: Callable[..., Any]) -> None:
        assert self._rule is not None
        jvp, symbolic_zeros = self._rule
        rule.defjvp(probing(jvp, "JVP rule"), symbolic_zeros=symbolic_zeros)

    def _lifted_rule(
        self, tracked: Tracked, order: list[int], live: _Live, args: tuple[Any, ...]
    ) -> Any:
        assert self._rule is not None
        fun, (jvp, symbolic_zeros) = self._fun, self._rule
        nondiff = sorted(self._nondiff)
        count = len(tracked.variables)
        same = _SameWrites(tracked, WHERE_JVP, "JVP rule", order)

        def lifted_jvp(*rest: Any) -> Any:
            *static, (values, *primals), (values_dot, *tangents) = rest
            perturbed = [
                index
                for index, tangent in values_dot.items()
                if index < count and any(perturbed_leaves(tangent))
            ]
            if not any(perturbed_leaves(tangents)):
                # Only the Variables are perturbed: raw JAX would not call the rule here
                # (it gives derivatives for its arguments only), and a rule may refuse to
                # be called (equinox's ``nondifferentiable``). The output tangent is zero,
                # which is right unless the function reads a perturbed Variable: refused.
                ordered = _interleave(static, primals, nondiff)
                with _refusing_reads(tracked, perturbed, WHERE_JVP):
                    out, after = live.run(
                        tracked, values, fun, ordered, WHERE_JVP, "primal function"
                    )
                written = _written(order, values, after)
                return (out, written), (
                    jax.tree.map(_tangent_zero, out),
                    [None if w is None else _tangent_zero(w) for w in written],
                )
            if not symbolic_zeros:
                tangents = instantiate_zeros(tangents)
            with _refusing_reads(tracked, perturbed, WHERE_JVP):
                pair, after = live.run(
                    tracked,
                    values,
                    jvp,
                    (*static, tuple(primals), tuple(tangents)),
                    WHERE_JVP,
                    "JVP rule",
                )
            out, out_dot = jvp_output_pair(pair, jvp, fun, same.primal_out)
            written = same.conform("JVP rule", values, after)
            return (out, written), (
                out_dot,
                [None if w is None else _tangent_zero(w) for w in written],
            )

        rule = self._below(
            self._primal(tracked, same, live), nondiff_argnums=self._shifted_nondiff()
        )
        # Symbolic zeros tell which Variables are being differentiated; given no Variable,
        # the rule is the user's.
        rule.defjvp(_named_as(lifted_jvp, jvp), symbolic_zeros=True if order else symbolic_zeros)
        return rule


# The override takes JAX's constructor arguments, as ``LiftedJVP`` does.
custom_jvp = LiftedJVP
