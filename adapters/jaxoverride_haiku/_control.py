"""Overrides of the neutral control flow: Haiku state threaded through, and init-exact.

Each override is the kit's threaded combinator (``jaxoverride.adapter_kit.threaded_scan``
& co., ``lax.map`` a scan of them: ``threaded_map``) over a ``_source.HaikuSource``: the
Haiku state and rng in the carry, exactly as ``hk.scan`` & co. carry them. Outside a
transform, or where Haiku state is unusable, each override is the implementation below
it, untouched.

At init the loop is traced once, as at apply, and a parameter that a body or branch
creates is made at the call's site (``_site``): outside the trace, under the name Haiku
gives it there, so that init returns what apply returns and a loop that runs zero times
has still created its parameters. Only where a body creates Haiku *state* (which would
change the carry) does init fall back to the kit's creation pass first.

At apply the functions handed to JAX are reused across calls (the source's
``reuse_key``) and params ride in the carry instead of being closed over, so that an
identical eager call hits JAX's caches and compiles once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxoverride import adapter_kit as kit
from jaxoverride_haiku._frames import state_usable
from jaxoverride_haiku._source import HaikuSource

OVERRIDES: dict[str, Callable[..., Any]] = kit.threaded_control_flow(
    state_usable, HaikuSource, module=__name__
)
"""Neutral name -> Haiku override, for the control flow."""
