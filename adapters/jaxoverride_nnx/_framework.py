"""Flax NNX's record for the missing-adapter check (entry point ``flax.nnx.variablelib``).

Loaded by the core when ``flax.nnx.variablelib`` is in ``sys.modules`` (in every supported
Flax), so the check fires for a program that imports NNX and never this adapter. It
imports only the kit: Flax is read from ``sys.modules``, never imported.
"""

from __future__ import annotations

import sys
from typing import Any

from jaxoverride import adapter_kit


class NnxFramework(adapter_kit.Framework):
    """Flax NNX: no scope; its state is the modules and Variables a function captures."""

    key = "nnx"
    module = "flax.nnx.variablelib"
    title = "Flax NNX (the function captures NNX modules or Variables)"
    fix = "`with jaxoverride_nnx.track(model):` around the call, naming the top-level module"
    label = "jaxoverride_nnx"

    def is_state(self, value: Any) -> bool:
        """Whether ``value`` is an NNX graph node or a Variable that raw JAX would not thread."""
        # The graph module is ``graphlib`` in recent Flax, ``graph`` in Flax 0.12.1.
        graphlib = sys.modules.get("flax.nnx.graphlib") or sys.modules.get("flax.nnx.graph")
        if graphlib is None:
            return False
        if type(value) in graphlib.GRAPH_REGISTRY:
            return True
        variablelib = sys.modules.get(self.module)
        if variablelib is None or not isinstance(value, variablelib.Variable):
            return False
        # ref=True Variables already work inside raw JAX transforms, and hijax=True ones
        # either work (Flax 0.12.8) or raise Flax's own error when written (0.12.10).
        metadata = getattr(value, "_var_metadata", None) or {}
        return not (metadata.get("ref") or metadata.get("hijax"))

    def fix_for(self, names: list[str], *, covered: list[str] | None = None) -> str:
        """``track`` naming the captured modules; under ``track``, the tracked ones too
        (as the program names them, where its frames tell)."""
        if covered is not None:
            roots = ", ".join(dict.fromkeys([*(covered or ["<the modules tracked now>"]), *names]))
            return f"track it too, `with jaxoverride_nnx.track({roots}):` around the call"
        return f"`with jaxoverride_nnx.track({', '.join(names)}):` around the call"

    def write_error(self) -> type[BaseException] | None:
        """Flax's ``TraceContextError``: a captured Variable written under a raw trace."""
        errors = sys.modules.get("flax.errors")
        return getattr(errors, "TraceContextError", None) if errors is not None else None


NNX = NnxFramework()
adapter_kit.register_framework(NNX)
