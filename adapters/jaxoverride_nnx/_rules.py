"""``custom_vjp`` and ``custom_jvp`` under ``track``: the tracked Variables' values as an
explicit argument.

JAX traces a rule's primal function and its ``fwd`` at levels of their own: a neutral
loop inside would close over the caller's Variable values, which JAX refuses
("differentiation of a custom_vjp function with respect to a closed-over value"). So
the values go in as a leading argument (with a zero cotangent: gradients reach the
parameters through the rule's arguments, which ``closure_convert`` provides), the
functions run with the Variables pointing at them (``run_lifted``), and the values after
the call come back as an extra output, written back once.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from jaxoverride import errors
from jaxoverride.adapter_kit import LiftedRule, perturbed_leaves, resumed
from jaxoverride_nnx._compat import chain_on_get_value
from jaxoverride_nnx._lift import run_lifted, write_back
from jaxoverride_nnx._probes import NeedsState
from jaxoverride_nnx._solve import frozen_values, policy_for, written as declared_writes
from jaxoverride_nnx._touched import Threads, given_values
from jaxoverride_nnx._tracked import Tracked, current

WHERE = "jaxoverride.custom_vjp"


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
def _refusing_reads(tracked: Any, perturbed: list[int] | None, where: str) -> Iterator[None]:
    """Refuses reads of the Variables being differentiated, at the read itself (NNX's
    ``on_get_value`` hook): the rule gives gradients for its explicit arguments only, so
    such a Variable would get a silently zero gradient."""
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


@dataclasses.dataclass(eq=False)
class _SameWrites:
    """Makes a rule's primal function and ``fwd`` (or JVP rule) write the same Variables,
    as JAX needs the same outputs from both: the second traced returns what the first
    wrote, and writing one the first did not is refused."""

    _tracked: Any
    _where: str
    _rule: str
    _order: Sequence[int]  # the given Variables' indices, in the outputs' order
    _first: tuple[str, frozenset[int]] | None = None

    def conform(self, role: str, given: dict[int, Any], after: Sequence[Any]) -> list[Any]:
        """The given Variables' values after a run, in order (``None``: not written)."""
        written = [None if after[i] is given[i] else after[i] for i in self._order]
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


class _Call:
    """One call of a lifted rule (the kit's ``RuleCall`` and ``RuleBackward``). ``done``:
    the call returned, so a module first touched by a later trace (``fwd`` or ``bwd``)
    can no longer be given, and is refused with the fix."""

    __slots__ = (
        "__weakref__", "done", "fun", "order", "owner", "policy", "received", "same", "tracked",
        "where",
    )  # fmt: skip

    def __init__(
        self, rule: NNXRule, tracked: Tracked, order: list[int], owner: object, policy: Any
    ):
        self.tracked, self.order, self.owner = tracked, order, owner
        self.fun, self.where = rule._fun, rule._where
        first = "forward rule (fwd)" if rule._name == "custom_vjp" else "JVP rule"
        self.same = _SameWrites(tracked, rule._where, first, order)
        self.done = False
        self.policy = policy  # the jaxoverride.solve_state participant of the call
        # What the evaluations before the call left (read at the call, the same for every
        # function of the rule traced during it); after the call, the values given.
        self.received: dict[int, Any] | None = None

    def lifted(
        self, values: dict[int, Any], fn: Callable[..., Any], args: Sequence[Any], role: str
    ) -> tuple[Any, list[Any]]:
        """``fn(*args)`` with the Variables holding ``values`` (the others probes)."""
        tracked, where = self.tracked, self.where
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

    def differentiated(self, values: dict[int, Any]) -> list[int]:
        """The Variables being differentiated (reads of them are refused: ``_refusing_reads``)."""
        count = len(self.tracked.variables)
        return [i for i, value in values.items() if i < count and any(perturbed_leaves(value))]

    def _run(
        self, role: str, values: Any, fun: Callable[..., Any], args: Sequence[Any], refused: Any
    ) -> tuple[Any, list[Any]]:
        with _refusing_reads(self.tracked, refused, self.where):
            out, after = self.lifted(values, fun, args, role)
        return out, self.same.conform(role, values, after)

    def run(
        self, values: Any, fun: Callable[..., Any], args: Sequence[Any], refused: Any = None
    ) -> tuple[Any, Any]:
        """The primal function or the JVP rule with the Variables holding ``values``."""
        return self._run(
            "primal function" if fun is self.fun else "JVP rule", values, fun, args, refused
        )

    def run_forward(
        self, values: Any, fun: Callable[..., Any], args: Sequence[Any], refused: Any
    ) -> tuple[Any, Any, Any]:
        # bwd runs from the values of the call
        return *self._run("forward rule (fwd)", values, fun, args, refused), values

    def staged_values(self, values: Any, used: list[bool]) -> tuple[Any, list[bool]]:
        raise NotImplementedError  # NNXRule stages no primal: a probe finds what it reads

    def refuse_differentiated_state(self, cotangent: Any) -> None:
        pass  # the written Variables' cotangents are dropped

    def run_backward(self, saved: Any, fun: Callable[..., Any], args: Sequence[Any]) -> Any:
        """``bwd`` with the Variables holding the values of the call (JAX traces it while
        it transposes, when they hold the caller's level's); a write is refused."""
        tracked, values = self.tracked, saved
        cotangents, after = self.lifted(values, fun, args, "bwd rule")
        written = {i: after[i] for i in self.order if after[i] is not values[i]}
        if written and self.policy is None:  # under solve_state: dropped
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
        return cotangents


class NNXRule(LiftedRule):
    """What the NNX override of ``custom_vjp``/``custom_jvp`` builds: the kit's lifted
    rule over the tracked Variables that its functions touch (module docstring)."""

    # A staged primal is not traced apart: the probes already give the rule only the
    # modules that its functions touch.
    _stages_primal = False

    def __init__(
        self, name: str, fun: Callable[..., Any], nondiff_argnums: Sequence[int] = (),
        nondiff_argnames: Sequence[str] = (),
    ):  # fmt: skip
        super().__init__(name, fun, nondiff_argnums, nondiff_argnames)
        self._threads = Threads()  # the modules that the rule's functions touch

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tracked = current()
        if tracked is None or self._rule is None:
            return self._plain(*args, **kwargs)
        called = self._call_arguments(args, kwargs)
        if called is None:  # JAX's own error, about the user's function
            return self._plain(*args, **kwargs)
        args = called
        count = len(tracked.variables)
        functions = (self._fun, *self._rule[:2])
        # Under jaxoverride.solve_state: the values are frozen at this read, and the rule's
        # functions, the backward rule too (traced after the declaration exited), run
        # under the declaration of this call.
        policy = policy_for(tracked)

        def attempt(given: frozenset[int], owner: object) -> Any:
            order = [i for i in sorted(given) if i < count]
            call = _Call(self, tracked, order, owner, policy)
            if not given:  # JAX's rule over the user's functions, run with probes
                try:
                    return self._probing_rule(call)(*args), {}
                finally:
                    call.done = True
            values = given_values(tracked, given, (*functions, args))
            if policy is not None:
                order_all = sorted(values)
                call.received = policy.current(dict(values))
                frozen = frozen_values(policy, tracked, order_all, [values[i] for i in order_all])
                values = dict(zip(order_all, frozen, strict=True))
            try:
                if self._name == "custom_vjp":
                    rule = self._vjp_rule(call, call, args, differentiable_state=bool(order))
                else:
                    rule, values = self._jvp_binder(call, args, bool(order))(values)
                out, written = rule(values, *args)
            finally:
                call.done = True
                call.received = None  # values of the caller's trace: a later run keeps none
            pairs = zip(order, written, strict=True)
            return out, {i: value for i, value in pairs if value is not None}

        out, updates = self._threads.run(tracked, attempt, functions)
        write_back(tracked, declared_writes(policy, tracked, updates), self._where)
        return out

    def _probing_rule(self, call: _Call) -> Any:
        """JAX's rule over the user's own functions, every tracked value a probe: while they
        touch no tracked module it is the user's rule; a touch retraces with it given."""

        def probing(fn: Callable[..., Any], role: str) -> Callable[..., Any]:
            return lambda *inner: call.lifted({}, fn, inner, role)[0]

        return self._rule_over(probing)


_BUILDERS = NNXRule.overrides()
custom_vjp = _BUILDERS["custom_vjp"]
custom_jvp = _BUILDERS["custom_jvp"]
