"""tinystate's record for jaxoverride's missing-adapter check.

With it registered, a neutral function called inside ``tinystate.transform`` while no
layer labelled ``tinystate_adapter`` is active raises
``jaxoverride.errors.MissingAdapterError`` with ``fix``, instead of leaking tracers into
the frame. An installed adapter names this object in its package metadata, so that the
check fires even where the adapter was never imported::

    [project.entry-points."jaxoverride.frameworks"]
    tinystate = "tinystate_record:RECORD"

(the entry point's name is the watched module). This example is not installed: importing
the module registers the record. It imports only the kit, never tinystate itself, which
it reaches through ``sys.modules`` once it has been imported.
"""

from __future__ import annotations

import sys
from typing import Any

import jax

from jaxoverride import adapter_kit as kit


class TinyState(kit.Framework):
    """tinystate, as the missing-adapter check sees it."""

    key = "tinystate"
    module = "tinystate"
    title = "tinystate (a neutral function ran inside tinystate.transform)"
    fix = "run the transform inside `with tinystate_adapter.context():`"
    label = "tinystate_adapter"

    def running(self) -> bool:
        """Whether a transformed function is running in this thread."""
        framework = sys.modules.get(self.module)
        return framework is not None and framework.in_transform()

    def leaked_state(self) -> list[Any]:
        """The leaves a raw JAX transform would leak: the running frame's values."""
        if not self.running():
            return []
        frame = sys.modules[self.module].current_frame()
        return jax.tree.leaves((frame.params, frame.state, frame.rng))


RECORD = TinyState()
kit.register_framework(RECORD)
