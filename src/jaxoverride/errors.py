"""The errors jaxoverride and its adapters raise, under one base class.

Every error that jaxoverride raises for a misuse it can name is a
:class:`JaxoverrideError`, so one ``except jaxoverride.errors.JaxoverrideError`` catches
them all. Adapters raise these classes or subclass them: ``jaxoverride_haiku`` and
``jaxoverride_nnx`` keep their historical names (``jaxoverride_nnx.UntrackedModuleError``
...) as subclasses, so handlers written against either keep working.

Example:
  >>> import jaxoverride.errors as joe
  >>> issubclass(joe.ClosedOverDifferentiationError, joe.JaxoverrideError)
  True
"""

from __future__ import annotations

__all__ = [
    "ClosedOverDifferentiationError",
    "DifferentiatedStateError",
    "ImportOrderWarning",
    "JaxoverrideError",
    "MissingAdapterError",
    "MissingAdapterWarning",
    "PureFunctionWriteError",
]


class JaxoverrideError(Exception):
    """The base class of every error that jaxoverride and its adapters raise."""


class ClosedOverDifferentiationError(JaxoverrideError, ValueError):
    """A custom rule reads framework state that is being differentiated.

    A rule gives gradients for its explicit arguments only, so the state would get a
    silently zero gradient. ``jaxoverride.closure_convert`` makes what a function reads
    explicit arguments.
    """


class DifferentiatedStateError(JaxoverrideError, ValueError):
    """State written inside a custom rule is differentiated after it.

    The rule's ``bwd`` gives cotangents only for the rule's own output, so the state would
    get a silently zero gradient.
    """


class PureFunctionWriteError(JaxoverrideError, RuntimeError):
    """Framework state written inside a function that JAX turns into a pure jaxpr.

    ``closure_convert``, ``lax.custom_root``, ``lax.custom_linear_solve`` and a custom
    rule's ``bwd`` keep only the function's outputs: the write would be silently lost.
    """


class MissingAdapterError(JaxoverrideError, RuntimeError):
    """A neutral function met a stateful framework that no active adapter handles.

    The message names the framework and the call that activates its adapter.
    """


class MissingAdapterWarning(UserWarning):
    """Like :class:`MissingAdapterError`, where the program may still be right."""


class ImportOrderWarning(UserWarning):
    """An interposition reached a package that holds transforms it built with raw JAX
    while it was imported, which no rebinding can reach.

    They keep calling raw JAX, so adapters do not apply inside them. The message names
    the packages, how many such transforms each holds, and the ``interpose_on_import``
    call, made before their first import, that makes them neutral.
    """
