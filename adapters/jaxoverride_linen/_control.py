"""Overrides of the neutral control flow: Linen state threaded through, and init-exact.

Each override is the kit's threaded combinator over the state source of the Linen modules
running now (``_source.LinenSource``). Outside a bound module each one is the
implementation below it, untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxoverride import adapter_kit as kit
from jaxoverride_linen._source import in_bound_module, source

OVERRIDES: dict[str, Callable[..., Any]] = kit.threaded_control_flow(
    in_bound_module, lambda where: source(where, allow_fresh=True), module=__name__
)
"""Neutral name -> Linen override, for the control flow."""
