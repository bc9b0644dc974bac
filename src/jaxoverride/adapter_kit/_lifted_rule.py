"""The common part of an adapter's ``custom_vjp``/``custom_jvp``: JAX's rule, and the user's.

An adapter lifts its state into a custom rule as the first argument of a JAX rule built
per call (``LiftedRule``); what differs between adapters is how one of the user's
functions runs over that state (a ``RuleCall``) and how its ``bwd`` runs (a ``RuleBackward``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol

import jax
from jax.custom_derivatives import SymbolicZero

import jaxoverride as jo
from jaxoverride._compat import jit_name, rule_jvp
from jaxoverride.adapter_kit import _rule_args as rule_args
from jaxoverride.adapter_kit._argnums import shift_argnums
from jaxoverride.adapter_kit._rule_checks import argument_types, check_bwd_types, jvp_output_pair
from jaxoverride.adapter_kit._staged_reads import StagedPrimal, staged


class RuleCall(Protocol):
    """One call of a lifted rule: how an adapter runs the user's functions over its state.

    ``values`` is the rule's leading argument (the framework's state as the adapter lifts
    it); ``after`` that state after a run (the rule's extra output); ``refused`` what
    ``differentiated`` returned (reads of it raise ``ClosedOverDifferentiationError``),
    or None: nothing refused. The object holds no JAX value (JAX keeps the rule's
    functions) and supports weak references.

    * ``differentiated(values)``: what is being differentiated, from ``values`` as a
      ``symbolic_zeros`` rule receives them (``fwd``'s primals, the JVP rule's tangents);
    * ``run(values, fun, args, refused=None)``: ``fun(*args)`` over ``values``; returns
      ``(out, after)``;
    * ``run_forward(values, fun, args, refused)``: as ``run`` for ``fwd``; returns
      ``(out, after, saved)``, ``saved`` (a residual) what ``bwd`` runs from;
    * ``staged_values(values, used)``: for a staged ``custom_jvp``, the values the rule
      takes given what its primal reads (``StagedPrimal.used``), and per leaf of
      ``values`` whether it is among them.
    """

    def differentiated(self, values: Any) -> Any: ...

    def run(
        self, values: Any, fun: Callable[..., Any], args: Sequence[Any], refused: Any = None
    ) -> tuple[Any, Any]: ...

    def run_forward(
        self, values: Any, fun: Callable[..., Any], args: Sequence[Any], refused: Any
    ) -> tuple[Any, Any, Any]: ...

    def staged_values(self, values: Any, used: list[bool]) -> tuple[Any, list[bool]]: ...


class RuleBackward(Protocol):
    """How an adapter runs a lifted ``custom_vjp``'s ``bwd``, which JAX may run after the
    call returned (so it holds no JAX value of the call).

    * ``refuse_differentiated_state(cotangent)``: refuses a cotangent of ``after`` (the
      state that came out would get a silently zero gradient: ``DifferentiatedStateError``);
    * ``run_backward(saved, fun, args)``: ``fun(*args)`` over ``saved``
      (``RuleCall.run_forward``'s), every write and draw refused; returns its output.
    """

    def refuse_differentiated_state(self, cotangent: Any) -> None: ...

    def run_backward(self, saved: Any, fun: Callable[..., Any], args: Sequence[Any]) -> Any: ...


class LiftedRule:
    """Base class of an override of ``custom_vjp``/``custom_jvp`` that lifts its state.

    The constructor takes JAX's constructor arguments and builds the rule below
    (``_plain``); ``defvjp``, ``defjvp`` and ``defjvps`` define the rule there too (so
    JAX checks the functions as it does) and record them in ``_rule``:
    ``(fwd, bwd, symbolic_zeros, optimize_remat)`` or ``(jvp, symbolic_zeros)``. Any
    other public attribute is read from the rule below. A subclass defines ``__call__``:
    ``self._plain(*args, **kwargs)`` where it has nothing to do, else its lifted rule:
    JAX's rule over a function whose first argument is its state, built by ``_vjp_rule``
    or ``_jvp_binder`` from a ``RuleCall`` (and a ``RuleBackward``) of its own.

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

    # Whether a staged custom_jvp's primal is traced once, the rule given only the values
    # it reads (``_jvp_binder``).
    _stages_primal: ClassVar[bool] = True

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
        """``_nondiff`` for the lifted function, whose first argument is the state (a
        negative position still counts from the end)."""
        return shift_argnums(self._nondiff)

    def _in_order(self, count: int, static: Sequence[Any], primals: Sequence[Any]) -> list[Any]:
        """The user's ``count`` arguments, in call order, from a JVP rule's nondiff and primals."""
        positions = self._static_positions(count)
        ordered: list[Any] = [None] * count
        for position, value in zip(positions, static, strict=True):
            ordered[position] = value
        rest = iter(primals)
        return [ordered[i] if i in positions else next(rest) for i in range(count)]

    def _static_positions(self, count: int) -> list[int]:
        """The non-differentiable positions among the user's ``count`` arguments, resolved."""
        return [n % (count + 1) - 1 for n in self._lifted_nondiff]

    def _call_arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The call's arguments as JAX binds them (``positional_arguments``), or None
        where JAX refuses them (the rule below then raises JAX's own error)."""
        try:
            signature = inspect.signature(self._fun)
        except (TypeError, ValueError):
            return rule_args.positional_arguments(self._fun, args, kwargs)  # JAX decides
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return None
        if bound.kwargs:  # keyword-only arguments have no position
            return None
        bound.apply_defaults()
        return bound.args if kwargs else args

    def _rule_over(self, wrap: Callable[[Callable[..., Any], str], Callable[..., Any]]) -> Any:
        """The user's rule below, each function ``fn`` run through ``wrap(fn, role)`` and named
        as ``fn`` (JAX's jaxprs and errors are the user's); ``role`` names it for messages."""
        assert self._rule is not None
        named = lambda fn, role: _named_as(wrap(fn, role), fn)
        rule = self._below(
            named(self._fun, "primal function"), nondiff_argnums=tuple(sorted(self._nondiff))
        )
        if self._name == "custom_vjp":
            fwd, bwd, symbolic_zeros, optimize_remat = self._rule
            rule.defvjp(
                named(fwd, "forward rule (fwd)"),
                named(bwd, "bwd rule"),
                symbolic_zeros=symbolic_zeros,
                optimize_remat=optimize_remat,
            )
        else:
            jvp, symbolic_zeros = self._rule
            rule.defjvp(named(jvp, "JVP rule"), symbolic_zeros=symbolic_zeros)
        return rule

    def _lifted_primal(self, call: RuleCall, seen: list[Any]) -> Callable[..., Any]:
        """The lifted rule's primal ``(values, *args) -> (out, after)``, holding ``call`` weakly
        (JAX keeps it in a ``custom_vjp``'s bwd, past the call); ``seen`` gets its output types."""
        fun, where, live = self._fun, self._where, weakref.ref(call)

        def primal(values: Any, *args: Any) -> Any:
            call = live()
            if call is None:
                raise RuntimeError(f"{where}: the primal function ran after its call")
            out, after = call.run(values, fun, args)
            with contextlib.suppress(TypeError):  # not JAX types: JAX's own error follows
                seen[:] = [jax.tree.map(jax.typeof, out)]
            return out, after

        return _named_as(primal, fun)

    def _vjp_rule(
        self,
        call: RuleCall,
        backward: RuleBackward,
        args: Sequence[Any],
        differentiable_state: bool = True,
    ) -> Any:
        """JAX's ``custom_vjp`` below over the lifted primal ``(values, *args) -> (out, after)``.

        ``fwd`` runs through ``call``, its ``refused`` learnt from symbolic zeros (which the
        user's rules see only if they asked); ``bwd`` through ``backward``, holding no
        ``call``. With ``optimize_remat`` (which takes no symbolic zeros) or where
        ``differentiable_state`` is False, nothing is refused: the rule is the user's.
        """
        assert self._rule is not None
        fwd, bwd, symbolic_zeros, optimize_remat = self._rule
        fun = self._fun
        static = set(self._static_positions(len(args)))
        primals = tuple(arg for index, arg in enumerate(args) if index not in static)
        primal_tree = jax.tree.structure(primals)
        try:  # only the types: bwd, traced later, must not hold the arguments
            primal_types = argument_types(primals)
        except TypeError:  # not JAX types: JAX's own error follows
            primal_types = None
        lifting = differentiable_state and not optimize_remat
        seen: list[Any] = []

        def lifted_fwd(values: Any, *args: Any) -> Any:
            refused = call.differentiated(values) if lifting else None
            values = rule_args.unwrap_primals(values)
            if not symbolic_zeros:
                args = rule_args.unwrap_primals(args)
            pair, after, saved = call.run_forward(values, fwd, args, refused)
            out, residuals = rule_args.fwd_output_pair(pair, fwd, fun, seen[0] if seen else None)
            return (out, after), (residuals, saved)

        def lifted_bwd(*rest: Any) -> Any:
            *nondiff, (residuals, saved), (out_cotangent, state_cotangent) = rest
            if lifting:
                backward.refuse_differentiated_state(state_cotangent)
            if not symbolic_zeros:
                out_cotangent = rule_args.instantiate_zeros(out_cotangent)
            cotangents = backward.run_backward(saved, bwd, (*nondiff, residuals, out_cotangent))
            cotangents = rule_args.bwd_cotangents(cotangents, primal_tree)
            if primal_types is not None:  # JAX's check, with the user's indices
                check_bwd_types(cotangents, primal_types, fun)
            return (None, *cotangents)

        rule = self._below(self._lifted_primal(call, seen), nondiff_argnums=self._lifted_nondiff)
        rule.defvjp(
            _named_as(lifted_fwd, fwd),
            _named_as(lifted_bwd, bwd),
            symbolic_zeros=lifting or symbolic_zeros,
            optimize_remat=optimize_remat,
        )
        return rule

    def _jvp_binder(
        self, call: RuleCall, args: Sequence[Any], differentiable_state: bool = True
    ) -> Callable[[Any], tuple[Any, Any]]:
        """``bind(values)``: JAX's ``custom_jvp`` below over the lifted primal, and the values
        it takes, for a call on ``args``.

        The JVP rule runs through ``call``; where only the state is perturbed, the primal
        runs instead with zero tangents, as JAX calls no rule then (equinox's
        ``nondifferentiable`` raises in its rule). Staged (and ``_stages_primal``), the
        primal is traced once and the rule takes only the values it reads.
        """
        assert self._rule is not None
        jvp, symbolic_zeros = self._rule
        fun = self._fun
        count = len(args)  # only the count: the rule must not close over the arguments
        seen: list[Any] = []

        def lifted_jvp(*rest: Any) -> Any:
            *nondiff, (values, *primals), (value_tangents, *tangents) = rest
            refused = call.differentiated(value_tangents) if differentiable_state else None
            if not any(rule_args.perturbed_leaves(tangents)):
                ordered = self._in_order(count, nondiff, primals)
                out, after = call.run(values, fun, ordered, refused)
                return (out, after), (_symbolic_zeros(out), _symbolic_zeros(after))
            if not symbolic_zeros:
                tangents = rule_args.instantiate_zeros(tangents)
            pair, after = call.run(
                values, jvp, (*nondiff, tuple(primals), tuple(tangents)), refused
            )
            out, out_tangent = jvp_output_pair(pair, jvp, fun, seen[0] if seen else None)
            return (out, after), (out_tangent, _symbolic_zeros(after))

        def bind(values: Any) -> tuple[Any, Any]:
            primal = self._lifted_primal(call, seen)
            if self._stages_primal and staged():
                # JAX would trace the primal here: trace it once instead, and pass only
                # the values it reads.
                traced = StagedPrimal.trace(primal, values, args, self._static_positions(count))
                values, kept = call.staged_values(values, traced.used)
                primal = traced.primal(kept)
            rule = self._below(primal, nondiff_argnums=self._lifted_nondiff)
            rule.defjvp(
                _named_as(lifted_jvp, jvp), symbolic_zeros=differentiable_state or symbolic_zeros
            )
            return rule, values

        return bind

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
    """The non-differentiable positions as the rule below resolved them (``static_argnums``
    in JAX's next ``custom_vjp``), else alike here: a name that is no parameter is ignored."""
    for attribute in ("nondiff_argnums", "static_argnums"):
        resolved = getattr(plain, attribute, None)
        if resolved is not None:
            return tuple(sorted(resolved))
    try:
        names = set(inspect.signature(fun).parameters)
    except (TypeError, ValueError):
        names = set()
    return rule_args.nondiff_positions(fun, argnums, [name for name in argnames if name in names])


def _symbolic_zeros(tree: Any) -> Any:
    """Symbolic zero tangents for the values of ``tree`` (JAX's for an unperturbed output)."""
    return jax.tree.map(lambda x: SymbolicZero(jax.typeof(x).to_tangent_aval()), tree)


def _named_as(lifted: Callable[..., Any], user: Callable[..., Any]) -> Callable[..., Any]:
    """``lifted`` named and located as ``user`` for JAX's errors and jaxprs; its own signature
    stays, since JAX binds arguments with ``inspect.signature``."""
    signature = inspect.signature(lifted)
    name = jit_name(user)
    lifted.__name__ = name
    lifted.__qualname__ = getattr(user, "__qualname__", name)
    module = getattr(user, "__module__", None)
    if isinstance(module, str):
        lifted.__module__ = module
    lifted.__signature__ = signature  # type: ignore[attr-defined]
    lifted.__wrapped__ = user  # type: ignore[attr-defined]  # JAX's source info
    return lifted
