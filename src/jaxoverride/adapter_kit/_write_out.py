"""Writes out of a jaxpr: the state a converted map wrote, handed to its evaluation.

A library that converts a map with ``jax.make_jaxpr`` (Equinox's
``filter_closure_convert``: optimistix, lineax, diffrax) later evaluates the jaxpr
itself, inside its own loops; the jaxpr's outputs are the library's, so state the map
wrote cannot be one. Under ``jaxoverride.solve_state`` the writes to the frozen parts
become the operands of ``write_out_p``, an equation with no outputs. Each evaluation
that binds it hands them, as values of the evaluating trace, to its ``Written`` hook,
which passes them to the adapter only in the trace the declaration's innermost
boundary is tracing (``Participant.here``), never in a transform's or rule's trace
inside it, a backward pass, or after the exit. The primitive computes and lowers to
nothing (dead-code elimination drops it once staged); its derivative and batching
carry nothing.

Stability: semi-public, as the rest of the kit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jaxoverride.adapter_kit._solve_policy import Participant


class Written:
    """What a ``write_out_p`` equation does when an evaluation binds it.

    Args:
      policy: the declaration's ``Participant`` (its frames are the declaration's).
      write: ``write(values)``, the adapter's action for the operands as values of the
        evaluating trace, called only where ``policy.here()`` (or, with ``everywhere``,
        at every evaluation: a check that keeps nothing).
      where: the neutral name that converted the map, for the jaxpr's text.
      everywhere: call ``write`` at every evaluation.
    """

    __slots__ = ("everywhere", "policy", "where", "write")

    def __init__(
        self,
        policy: Participant,
        write: Callable[[list[Any]], None],
        where: str,
        everywhere: bool = False,
    ):
        self.policy = policy
        self.write = write
        self.where = where
        self.everywhere = everywhere

    def received(self, values: Sequence[Any]) -> None:
        """Hands ``values`` to ``write`` where they belong to the innermost boundary."""
        if self.everywhere or self.policy.here():
            self.write(list(values))

    def __repr__(self) -> str:
        return f"Written({self.where})"


class _WriteOut(Primitive):
    """``write_out_p``: a ``Primitive`` whose ``bind`` first tells its hook."""

    def bind(self, *args: Any, **params: Any) -> Any:
        params["written"].received(args)
        return super().bind(*args, **params)


write_out_p = _WriteOut("jaxoverride_write_out")
write_out_p.multiple_results = True
write_out_p.def_impl(lambda *values, written: [])
write_out_p.def_abstract_eval(lambda *values, written: [])
mlir.register_lowering(write_out_p, lambda ctx, *values, written: [])
ad.primitive_jvps[write_out_p] = lambda primals, tangents, written: ([], [])
batching.primitive_batchers[write_out_p] = lambda values, dims, written: ([], [])


def write_out(
    policy: Participant, values: Sequence[Any], write: Callable[[list[Any]], None], where: str
) -> None:
    """Stages ``values`` (what a map being converted wrote) for each later evaluation.

    Call it inside the function being traced, with the values as that trace has them:
    each evaluation of the jaxpr in the trace of the declaration's innermost boundary
    calls ``write(values)`` with its own values (nothing is staged if ``values`` is empty).

    Args:
      policy: the declaration's ``Participant`` for the framework.
      values: arrays, in an order ``write`` knows.
      write: ``write(values)``: keep them as the evaluation's writes (e.g.
        ``policy.written_parts``, or into the framework's live state, which the
        boundary then carries out).
      where: the neutral name that converts the map, for the jaxpr's text.

    Returns:
      None.

    Example:
      >>> import jax, jax.extend.core, jaxoverride as jo
      >>> from jaxoverride import adapter_kit as kit
      >>> policy = kit.Participant(jo.solve_state(), "doc", kit.DictStateSource({}))
      >>> got = []
      >>> closed = jax.make_jaxpr(
      ...     lambda x: kit.write_out(policy, [2 * x], got.extend, "doc") or x)(1.0)
      >>> got  # traced, not evaluated: nothing yet
      []
      >>> _ = jax.extend.core.jaxpr_as_fun(closed)(3.0)
      >>> got
      [Array(6., dtype=float32, weak_type=True)]
    """
    if values:
        write_out_p.bind(*values, written=Written(policy, write, where))


def ahead_of_evaluation(policy: Participant, check: Callable[[], None], where: str) -> None:
    """Stages ``check()`` at the start of each later evaluation of the jaxpr being traced.

    Call it first in the function being traced: each evaluation of the jaxpr, in any
    trace, calls ``check()`` before it has staged anything (so does staging it). An
    adapter that learns what a traced function writes by aborting its trace (NNX's
    probes) raises there, so the aborted trace holds none of the jaxpr's constants.

    Args:
      policy: the declaration's ``Participant`` for the framework.
      check: called with no arguments; it keeps nothing, and what it raises propagates.
      where: the neutral name that converts the map, for the jaxpr's text.

    Returns:
      None: the equation is staged in the trace running now.

    Example:
      >>> import jax, jax.extend.core, jaxoverride as jo
      >>> from jaxoverride import adapter_kit as kit
      >>> def traced(x):
      ...     empty = kit.Participant(jo.solve_state(), "doc", kit.DictStateSource({}))
      ...     kit.ahead_of_evaluation(empty, lambda: print("checked"), "doc")
      ...     return x + 1
      >>> closed = jax.make_jaxpr(traced)(1.0)  # staging it checks too
      checked
      >>> float(jax.extend.core.jaxpr_as_fun(closed)(2.0)[0])
      checked
      3.0
    """
    write_out_p.bind(written=Written(policy, lambda values: check(), where, everywhere=True))
