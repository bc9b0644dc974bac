"""The errors jaxoverride and its adapters raise, under one base class.

Every error jaxoverride raises for a misuse it can name is a ``JaxoverrideError``.
Adapters raise these classes or subclass them (``jaxoverride_nnx.UntrackedModuleError``
and other historical names), so handlers written against either keep working.

Example:
  >>> import jaxoverride.errors as joe
  >>> issubclass(joe.ClosedOverDifferentiationError, joe.JaxoverrideError)
  True
"""

from __future__ import annotations

import functools
from typing import Any, TypeVar

from jaxoverride import _tree_diff

_ClosedOver = TypeVar("_ClosedOver", bound="ClosedOverDifferentiationError")
_CameOut = TypeVar("_CameOut", bound="DifferentiatedStateError")

__all__ = [
    "ClosedOverDifferentiationError",
    "DifferentiatedStateError",
    "ImportOrderError",
    "ImportOrderWarning",
    "JaxoverrideError",
    "MissingAdapterError",
    "MissingAdapterWarning",
    "PureFunctionWriteError",
    "SharingError",
    "StructureChangeError",
    "UntrackedModuleError",
]


class JaxoverrideError(Exception):
    """The base class of every error that jaxoverride and its adapters raise."""


class ClosedOverDifferentiationError(JaxoverrideError, ValueError):
    """A custom rule reads framework state that is being differentiated.

    A rule gives gradients for its explicit arguments only, so the state would get a
    silently zero gradient. ``jaxoverride.closure_convert`` makes what a function reads
    explicit arguments.

    Example:
      >>> from jaxoverride.errors import ClosedOverDifferentiationError
      >>> error = ClosedOverDifferentiationError.reading("jaxoverride.custom_vjp", "`w`")
      >>> str(error)[:58]
      'jaxoverride.custom_vjp: the rule reads `w`, which is being'
    """

    @classmethod
    def reading(cls: type[_ClosedOver], where: str, what: str) -> _ClosedOver:
        """The error for a rule that reads ``what`` while it is being differentiated.

        Args:
          where: the neutral function, such as ``"jaxoverride.custom_vjp"``.
          what: the state read, in the framework's words (``"the Haiku value '~/w'"``).

        Returns:
          An instance of ``cls`` (an adapter's subclass builds its own) with the message
          every adapter gives: what was read, why it is refused, and the fix.
        """
        return cls(
            f"{where}: the rule reads {what}, which is being differentiated, without having "
            "it as an argument. A custom rule gives gradients for its explicit arguments "
            "only, so it would get a silently zero gradient (JAX refuses the same for a "
            "closed-over value). Pass it in: jaxoverride.closure_convert(f, *example_args) "
            "hoists what f reads into explicit arguments; or pass the parameters to the "
            "library's solve/run call as arguments."
        )


class DifferentiatedStateError(JaxoverrideError, ValueError):
    """State written inside a custom rule is differentiated after it.

    The rule's ``bwd`` gives cotangents only for the rule's own output, so the state would
    get a silently zero gradient.

    Example:
      >>> from jaxoverride.errors import DifferentiatedStateError
      >>> error = DifferentiatedStateError.came_out("jaxoverride.custom_vjp", "the state `n`")
      >>> str(error)[:62]
      'jaxoverride.custom_vjp: the state `n` came out of the rule (wr'
    """

    @classmethod
    def came_out(cls: type[_CameOut], where: str, what: str) -> _CameOut:
        """The error for state that came out of a rule and is differentiated after it.

        Args:
          where: the neutral function, such as ``"jaxoverride.custom_vjp"``.
          what: the state, in the framework's words (``"the Haiku state ~/y"``).

        Returns:
          An instance of ``cls`` (an adapter's subclass builds its own) with the message
          every adapter gives: what came out, why its gradient would be zero, and the fix.
        """
        return cls(
            f"{where}: {what} came out of the rule (written in it, or carried through a "
            "neutral loop or jit inside it) and is differentiated afterwards. The rule's bwd "
            "gives cotangents from its output only, so it would get a silently zero "
            "gradient. Write it outside the rule (before or after the call), or return the "
            "value from the rule as part of its output."
        )


class PureFunctionWriteError(JaxoverrideError, RuntimeError):
    """Framework state written inside a function that JAX turns into a pure jaxpr.

    ``closure_convert``, ``lax.custom_root``, ``lax.custom_linear_solve`` and a custom
    rule's ``bwd`` keep only the function's outputs: the write would be silently lost.
    """


class MissingAdapterError(JaxoverrideError, RuntimeError):
    """A neutral function met a stateful framework that no active adapter handles.

    The message names the framework and the call that activates its adapter.
    """


@functools.cache
def _missing_adapter_also(other: type[BaseException]) -> type[MissingAdapterError]:
    """``MissingAdapterError`` that is also ``other`` (Flax's ``TraceContextError``), for
    handlers of the error it replaces; made here, so it prints as this module's."""
    return type(
        "MissingAdapterError",
        (MissingAdapterError, other),
        {
            "__module__": __name__,
            "__qualname__": "MissingAdapterError",
            "__doc__": MissingAdapterError.__doc__,
        },
    )


class MissingAdapterWarning(UserWarning):
    """Like ``MissingAdapterError``, where the program may still be right."""


class UntrackedModuleError(JaxoverrideError, RuntimeError):
    """A stateful module was written inside a neutral call that no adapter threads it through.

    The write would be lost or leak a tracer; the message names the module and the call
    that makes the adapter thread it (``jaxoverride_nnx.track(model)``).
    """


class StructureChangeError(JaxoverrideError, ValueError):
    """Traced code changed the structure of state (a new attribute, a new shape).

    A JAX trace has fixed inputs and outputs, so a new attribute or variable, or one of a
    new shape or dtype, cannot come out of it: make the change outside the neutral call
    (or let init create it). The kit's state threading (``adapter_kit.StateStructureError``
    is this class) and every adapter raise it, naming what changed (``between``).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxoverride.errors import StructureChangeError
      >>> error = StructureChangeError.between(
      ...     "jaxoverride.lax.scan", {"w": jnp.ones(2)}, {"w": jnp.ones(2), "b": jnp.ones(())},
      ...     "Create every variable before the loop.")
      >>> print(str(error).split(": ", 2)[2])
      ['b'] added (float32[]). Create every variable before the loop.
    """

    @classmethod
    def between(cls, where: str, before: Any, after: Any, fix: str) -> StructureChangeError:
        """The error for state that went in as pytree ``before`` and came out as ``after``.

        Args:
          where: the neutral call, as messages name it (``"jaxoverride.lax.scan"``).
          before: the state the traced function received.
          after: the state it left.
          fix: what to do instead, one or more sentences.

        Returns:
          The error, its message naming the paths added or removed and the leaves whose
          shape or dtype changed (not the two raw tree structures).
        """
        return cls(
            f"{where}: the traced function changed the structure of the state it threads: "
            f"{_tree_diff.describe(before, after)}. {fix}"
        )


class SharingError(JaxoverrideError, ValueError):
    """A sharing pattern (one object at several places) that a transform cannot honour.

    The message names the paths and says how to fix it.
    """


class ImportOrderError(JaxoverrideError, RuntimeError):
    r"""A package was imported before ``interpose_on_import`` could reach its import-time
    transforms, which therefore keep calling raw JAX.

    The message names each package, how many such transforms it holds, and where.

    Example:
      >>> import jaxoverride as jo
      >>> jo.ImportOrderError is jo.errors.ImportOrderError
      True
    """


class ImportOrderWarning(UserWarning):
    """An interposition reached a package that holds transforms it built with raw JAX
    while it was imported, which no rebinding can reach.

    Adapters do not apply inside them. The message names the packages, their transforms
    and the ``interpose_on_import`` call, made before their first import, that reaches them.
    """
