"""The frames of jaxoverride and its adapters count as JAX's in source info and tracebacks.

An error or an equation must name the user's line as JAX's would, not a neutral wrapper or
an adapter between. The adapters' directories are found without importing them.
"""

from __future__ import annotations

import importlib.util
import os

from jaxoverride._compat import hide_frames_under

ADAPTERS = (
    "jaxoverride_plain",
    "jaxoverride_haiku",
    "jaxoverride_nnx",
    "jaxoverride_linen",
    "jaxoverride_dag",
    "jaxoverride_debug",
)


def hide_own_frames() -> None:
    """Registers the core's directory and each installed adapter's with JAX's exclusions
    (done by ``import jaxoverride``; again is harmless)."""
    hide_frames_under(os.path.dirname(__file__))
    for name in ADAPTERS:
        spec = importlib.util.find_spec(name)
        for directory in (spec and spec.submodule_search_locations) or ():
            hide_frames_under(directory)
