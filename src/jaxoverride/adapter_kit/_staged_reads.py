"""A lifted rule's primal traced once where JAX stages the rule: what it does not read stays out.

A lifted ``custom_jvp`` takes the framework's values (all the model's parameters) as its
first argument. Where the call is staged (``jax.jit``, ``jax.make_jaxpr``, a loop body:
a ``DynamicJaxprTrace``) JAX traces the primal into the ``custom_jvp_call`` equation,
whose inputs are every value passed, read or not. From JAX 0.12 a staged
``custom_jvp_call`` met in a partial evaluation (``jax.linearize`` of a jitted function,
as optimistix's Newton step does) stays one equation, so each of its known inputs
becomes a residual of the linearization: a parameter the function never reads would be
one more leaf of the linearized function (lineax's operator). Tracing the primal here,
once, instead of JAX, tells which values it reads; the rule then takes only those, and
its primal evaluates the traced program (no second trace of the user's function).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxoverride._compat import current_trace, staged_for


class StagedPrimal:
    """A lifted primal ``fun(values, *args)`` traced once, and which leaves of ``values`` it reads.

    Build it with ``StagedPrimal.trace``. ``used[i]``: whether leaf ``i`` of ``values``
    (in ``jax.tree.leaves`` order) is read or returned. ``primal(kept)`` is the function
    to bind in place of ``fun``: it takes values holding exactly the leaves ``kept``
    marks (a superset of ``used``, in the same order) and the same arguments, and
    evaluates the traced program.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxoverride import adapter_kit as kit
      >>> fun = lambda values, x: values["w"] * x
      >>> seen = []
      >>> def staged(x):
      ...     values = {"b": jnp.zeros(()), "w": jnp.ones(())}
      ...     traced = kit.StagedPrimal.trace(fun, values, (x,), nondiff=())
      ...     seen.append(traced.used)
      ...     return traced.primal(traced.used)({"w": values["w"]}, x)
      >>> out = jax.jit(staged)(2.0)
      >>> seen, float(out)
      ([[False, True]], 2.0)
    """

    __slots__ = ("_jaxpr", "_nondiff", "_out_tree", "used")

    def __init__(self, jaxpr: Any, used: list[bool], out_tree: Any, nondiff: frozenset[int]):
        self._jaxpr = jaxpr
        self._out_tree = out_tree
        self._nondiff = nondiff
        self.used = used

    @classmethod
    def trace(
        cls, fun: Callable[..., Any], values: Any, args: Sequence[Any], nondiff: Sequence[int]
    ) -> StagedPrimal:
        """Traces ``fun(values, *args)`` once.

        Args:
          fun: the lifted primal.
          values: its first argument (the framework's values).
          args: the rest, as the rule is called.
          nondiff: positions in ``args`` that the rule does not differentiate (any Python
            value: they are closed over, not traced).

        Returns:
          The ``StagedPrimal``.
        """
        fixed = frozenset(nondiff)
        traced = [arg for index, arg in enumerate(args) if index not in fixed]

        def dynamic(values: Any, *traced: Any) -> Any:
            rest = iter(traced)
            return fun(values, *(a if i in fixed else next(rest) for i, a in enumerate(args)))

        closed, shapes = jax.make_jaxpr(dynamic, return_shape=True)(values, *traced)
        count = len(jax.tree.leaves(values))
        read = _read_variables(closed.jaxpr)
        used = [var in read for var in closed.jaxpr.invars[:count]]
        return cls(closed, used, jax.tree.structure(shapes), fixed)

    def primal(self, kept: Sequence[bool]) -> Callable[..., Any]:
        """The primal to bind: ``(values, *args)``, ``values`` holding the ``kept`` leaves."""
        from jax.extend import core  # at the first staged rule: jax.extend costs 20-40 ms

        closed = self._jaxpr
        jaxpr = closed.jaxpr
        count = len(self.used)
        taken = [k and u for k, u in zip(kept, self.used, strict=True) if k]
        invars = [v for v, u in zip(jaxpr.invars[:count], self.used, strict=True) if u]
        pruned = core.ClosedJaxpr(
            jaxpr.replace(invars=[*invars, *jaxpr.invars[count:]]), closed.consts
        )
        run = core.jaxpr_as_fun(pruned)
        nondiff, out_tree = self._nondiff, self._out_tree

        def primal(values: Any, *args: Any) -> Any:
            leaves = [leaf for leaf, t in zip(jax.tree.leaves(values), taken, strict=True) if t]
            rest = [a for index, a in enumerate(args) if index not in nondiff]
            return jax.tree.unflatten(out_tree, run(*leaves, *jax.tree.leaves(rest)))

        return primal

    @staticmethod
    def unused_read_error(where: str, what: str) -> ValueError:
        """The error for a JVP rule that reads a value its staged primal does not use.

        The rule took only what the primal reads (``used``), so the value is not among
        its arguments; read anyway, it would be a value of the caller's trace.

        Args:
          where: the neutral name of the rule, as the adapter's messages name it.
          what: the value, as the framework names it (``"the Haiku parameter 'cell/b'"``).

        Returns:
          A ``ValueError`` naming the value, why it is missing, and the fix.

        Example:
          >>> from jaxoverride import adapter_kit as kit
          >>> error = kit.StagedPrimal.unused_read_error("custom_jvp", "the parameter 'b'")
          >>> str(error).startswith("custom_jvp: the JVP rule reads the parameter 'b', which")
          True
        """
        return ValueError(
            f"{where}: the JVP rule reads {what}, which the primal function does not use. "
            "Where the call is staged (inside jax.jit, a loop or jax.make_jaxpr), the rule "
            "takes only the params its primal function uses (from JAX 0.12 every other would "
            "become a residual of jax.linearize). Pass the value to the rule as an argument "
            "(jaxoverride.closure_convert makes what a function reads arguments), or use it "
            "in the primal function."
        )


def _read_variables(jaxpr: Any) -> set[Any]:
    """The variables an equation of ``jaxpr`` reads, and those it returns."""
    from jax.extend import core

    read = {v for v in jaxpr.outvars if not isinstance(v, core.Literal)}
    for eqn in jaxpr.eqns:
        read.update(v for v in eqn.invars if not isinstance(v, core.Literal))
    return read


def staged() -> bool:
    """Whether JAX stages a call made now into a jaxpr (``jax.jit``, ``jax.make_jaxpr``,
    control flow: a ``DynamicJaxprTrace``), where it traces a custom rule's primal itself.

    Example:
      >>> import jax
      >>> from jaxoverride import adapter_kit as kit
      >>> seen = []
      >>> _ = jax.jit(lambda x: seen.append(kit.staged()) or x)(1.0)
      >>> seen, kit.staged()
      ([True], False)
    """
    return staged_for(current_trace()) is not None
