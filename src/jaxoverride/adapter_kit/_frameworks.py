"""Telling the missing-adapter check which frameworks an adapter handles."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxoverride import _frameworks


def declare_handler(
    framework: str, label: str, *, covers: Callable[[Any], bool] | None = None
) -> None:
    """Declares that override layers labelled ``label`` handle ``framework``.

    While no layer that handles a framework is active, a neutral function that meets the
    framework's state raises ``jaxoverride.errors.MissingAdapterError``. The built-in
    adapters are known already (``jaxoverride_haiku``, ``jaxoverride_linen``,
    ``jaxoverride_nnx``); an adapter of one's own for the same framework declares itself
    here. Declaring again is harmless.

    Args:
      framework: ``"haiku"``, ``"linen"`` or ``"nnx"``.
      label: the ``name=`` the adapter gives ``jaxoverride.override_context`` or
        ``jaxoverride.install``.
      covers: for ``"nnx"``, a predicate telling whether a captured module or Variable is
        threaded by the active adapter (for ``jaxoverride_nnx``: is it tracked). Without
        one, every captured object counts as covered while the layer is active.

    Raises:
      ValueError: the framework is not one of those above.
      TypeError: the label is not a non-empty string, or ``covers`` is not callable.

    Example:
      >>> from jaxoverride import adapter_kit
      >>> adapter_kit.declare_handler("haiku", "my_haiku_adapter")
    """
    _frameworks.declare_handler(framework, label, covers)
