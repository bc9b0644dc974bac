"""Registering a framework with the missing-adapter check, and declaring its handlers.

A framework is described by a ``Framework`` record (defined in the core's registry,
re-exported here). It reaches the check in one of two ways, both idempotent per key:

- ``register_framework(record)``, called by the adapter (at its import, say);
- an entry point in the group ``jaxoverride.frameworks`` of the adapter's distribution,
  whose name is the watched module and whose value is ``package.module:record``, e.g. in
  ``pyproject.toml``::

      [project.entry-points."jaxoverride.frameworks"]
      "toy.core" = "toy_adapter._framework:TOY"

  The core reads the group once, lazily, and loads a record only once its watched module
  is in ``sys.modules``: the check then fires for a user who imported the framework but
  never the adapter. The record's module imports only the kit, never the framework.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxoverride import _frameworks
from jaxoverride._frameworks import Framework as Framework


def register_framework(record: Framework) -> None:
    """Registers a framework with the missing-adapter check (idempotent per key).

    Once registered, and while the record's watched module (``record.module``) is in
    ``sys.modules``, a neutral function that meets the framework's state while no layer
    labelled ``record.label`` (or declared with ``declare_handler``) is active raises
    ``jaxoverride.errors.MissingAdapterError`` naming ``record.title`` and ``record.fix``.

    Args:
      record: a ``Framework`` instance with non-empty ``key``, ``module``, ``title``,
        ``fix`` and ``label``.

    Raises:
      TypeError: ``record`` is not a ``Framework``, or an attribute is not a non-empty
        string.
      ValueError: another record of another class or module holds the key already.

    Example:
      >>> import sys
      >>> from jaxoverride import adapter_kit
      >>> class Toy(adapter_kit.Framework):
      ...     key, module, label = "doc_toy", "doc_toy.core", "doc_toy_adapter"
      ...     title = "Toy (a neutral function ran inside doc_toy.transform)"
      ...     fix = "doc_toy_adapter.install()"
      ...     def running(self):
      ...         core = sys.modules.get(self.module)
      ...         return core is not None and core.depth > 0
      >>> adapter_kit.register_framework(Toy())
      >>> adapter_kit.register_framework(Toy())  # again: nothing changes
    """
    _frameworks.register(record)


def declare_handler(
    framework: str, label: str, *, covers: Callable[[Any], bool] | None = None
) -> None:
    """Declares that override layers labelled ``label`` handle ``framework``.

    While no layer that handles a framework is active, a neutral function that meets the
    framework's state raises ``jaxoverride.errors.MissingAdapterError``. A record's own
    ``label`` handles it already; an adapter of one's own for the same framework declares
    itself here. Declaring again is harmless.

    Args:
      framework: the key of a registered framework (``"haiku"``, ``"linen"``, ``"nnx"``
        with the built-in adapters installed, or one's own; see ``register_framework``).
      label: the ``name=`` the adapter gives ``jaxoverride.override_context`` or
        ``jaxoverride.install``.
      covers: for a framework whose state is captured in closures (its record overrides
        ``is_state``), a predicate telling whether a captured object is threaded by the
        active adapter (for ``jaxoverride_nnx``: is it tracked). Without one, every
        captured object counts as covered while the layer is active.

    Raises:
      ValueError: no registered framework has that key (the message lists those that do).
      TypeError: the label is not a non-empty string, or ``covers`` is not callable.

    Example:
      >>> from jaxoverride import adapter_kit
      >>> adapter_kit.declare_handler("haiku", "my_haiku_adapter")
    """
    _frameworks.declare_handler(framework, label, covers)
