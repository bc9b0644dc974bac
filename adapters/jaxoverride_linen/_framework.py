"""Flax Linen's record for the missing-adapter check (entry point ``flax.linen.module``).

Loaded by the core when ``flax.linen.module`` is in ``sys.modules``, so the check fires
for a program that imports Linen and never this adapter. It imports only the kit and JAX:
Flax is read from ``sys.modules``, never imported.
"""

from __future__ import annotations

import sys
from typing import Any

import jax

from jaxoverride import adapter_kit


class LinenFramework(adapter_kit.Framework):
    """Flax Linen: a scope is a bound module's method running; its state the variables
    of that module's root scope."""

    key = "linen"
    module = "flax.linen.module"
    title = "Flax Linen (a neutral function ran inside a bound Linen module)"
    fix = (
        "jaxoverride_linen.install() once at the start of the program "
        "(or run init/apply inside `with jaxoverride_linen.context():`)"
    )
    label = "jaxoverride_linen"

    def _bound_scope(self) -> Any:
        """The scope of the innermost running Linen module, if it is bound; else None."""
        module = sys.modules.get(self.module)
        if module is None:
            return None
        top = module._context.module_stack[-1]
        return None if top is None else getattr(top, "scope", None)

    def running(self) -> bool:
        # ``_bound_scope``, inline: the check asks this at neutral calls.
        module = sys.modules.get(self.module)
        if module is None:
            return False
        top = module._context.module_stack[-1]
        return top is not None and getattr(top, "scope", None) is not None

    def leaked_state(self) -> list[Any]:
        scope = self._bound_scope()
        return [] if scope is None else jax.tree_util.tree_leaves(scope.root._variables)


LINEN = LinenFramework()
adapter_kit.register_framework(LINEN)
