"""Haiku's record for the missing-adapter check (entry point ``haiku._src.base``).

Loaded by the core when ``haiku._src.base`` is in ``sys.modules``, so the check fires for
a program that imports Haiku and never this adapter. It imports only the kit and JAX:
Haiku is read from ``sys.modules``, never imported.
"""

from __future__ import annotations

import sys
from typing import Any

import jax

from jaxoverride import adapter_kit


class HaikuFramework(adapter_kit.Framework):
    """Haiku: a scope is ``hk.transform`` running; its state the frame's params, state
    and rng."""

    key = "haiku"
    module = "haiku._src.base"
    title = "Haiku (a neutral function ran inside hk.transform)"
    fix = (
        "jaxoverride_haiku.install() once at the start of the program "
        "(or run the transform inside `with jaxoverride_haiku.context():`)"
    )
    label = "jaxoverride_haiku"

    def running(self) -> bool:
        base = sys.modules.get(self.module)
        return base is not None and base.inside_transform()

    def leaked_state(self) -> list[Any]:
        base = sys.modules.get(self.module)
        if base is None or not base.inside_transform():
            return []
        frame = base.current_frame()
        leaves = jax.tree_util.tree_leaves((frame.params, frame.state))
        for sequence in frame.rng_stack:
            if sequence is not None:
                leaves += jax.tree_util.tree_leaves(sequence.internal_state)
        return leaves

    def counted(self, leaked: list[Any]) -> int:
        """The leaked tracers among the parameters and state: the rng key sequence is
        Haiku's own bookkeeping, not a value the program made."""
        base = sys.modules.get(self.module)
        if base is None or not base.inside_transform():
            return len(leaked)
        frame = base.current_frame()
        values = {id(leaf) for leaf in jax.tree_util.tree_leaves((frame.params, frame.state))}
        return sum(id(leaf) in values for leaf in leaked)


HAIKU = HaikuFramework()
adapter_kit.register_framework(HAIKU)
