"""``jaxoverride.solve_state`` for Haiku: the frame's state, given to the kit.

Haiku has one rng stream (the frame's ``PRNGSequence``) and state per module. The kit
applies a declaration at the neutral control flow's boundaries; the adapter's own (``jit``,
the transforms, conversions, rules) use the same ``Participant`` (``kit.participant``).
"""

from __future__ import annotations

import jaxoverride as jo
from jaxoverride import adapter_kit as kit
from jaxoverride_haiku import _jit
from jaxoverride_haiku._frames import state_usable
from jaxoverride_haiku._source import HaikuSource

WHERE = "jaxoverride.solve_state"


def current_source() -> HaikuSource | None:
    """The source of the Haiku frame running here, where the adapter is active; else None.

    Returns:
      A ``HaikuSource``, or None outside ``hk.transform``, where Haiku state is not
      usable, or where the adapter's overrides are not in effect.

    Example:
      >>> current_source() is None  # outside hk.transform
      True
    """
    if not state_usable() or jo.resolve("jit") is not _jit.jit:
        return None
    return HaikuSource(WHERE)


kit.register_solve_source("haiku", current_source)
