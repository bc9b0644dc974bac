"""jaxoverride_debug: see what the neutral calls of a library do, without changing it.

``with jaxoverride_debug.trace() as t:`` records every neutral call (``jo.jit``,
``jaxoverride.lax.scan``, ..., or ``jax.*`` in a library after
``jaxoverride.interpose``): its name, the shapes of its arguments, and the
implementation it goes to. ``trace(progress=True)`` also shows a tqdm progress bar for
long ``scan``/``fori_loop``/``map`` loops, updated from inside compiled code. It is a
plain override layer: results are unchanged, and it costs nothing when not entered.
See the "Debugging" page of the documentation.
"""

from jaxoverride.adapter_kit import publish_errors as _publish_errors
from jaxoverride_debug._record import Call as Call
from jaxoverride_debug._trace import (
    NothingTracedWarning as NothingTracedWarning,
    Trace as Trace,
    trace as trace,
)

__all__ = ["Call", "NothingTracedWarning", "Trace", "trace"]

_publish_errors(globals())  # its errors print as jaxoverride_debug.<Name>
