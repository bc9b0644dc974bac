"""The Haiku layer, for the override modules that it is built from.

``_context`` records the layer here; a rule JAX traces after its transform returned
(outside ``install()``'s scope) re-enters it from here (``_rules`` importing ``_context``
would be an import cycle).
"""

from __future__ import annotations

from collections.abc import Callable

import jaxoverride as jo

_layer: jo.OverrideContext | None = None
_is_installed: Callable[[], bool] = lambda: False


def record(layer: jo.OverrideContext, is_installed: Callable[[], bool]) -> None:
    """Called once by ``_context``: the layer, and whether ``install()`` is in effect."""
    global _layer, _is_installed
    _layer, _is_installed = layer, is_installed


def installed_layer() -> jo.OverrideContext | None:
    """The layer if ``install()`` is in effect, else None."""
    return _layer if _is_installed() else None
