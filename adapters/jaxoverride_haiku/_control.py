"""Overrides of the neutral control flow: Haiku state threaded through, and init-exact.

Each override is the kit's threaded combinator over a ``_source.HaikuSource`` (state and
rng in the carry, as ``hk.scan`` carries them); where Haiku state is unusable it is the
implementation below.
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
