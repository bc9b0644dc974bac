"""jaxoverride_linen: every neutral jaxoverride function works inside bound Flax Linen modules.

Library code written against ``jaxoverride`` (``jo.jit``, ``jo.vmap``, ``jo.grad``,
``jaxoverride.lax.scan``, ``while_loop``, ...) runs unchanged when the functions it
receives call Linen submodules or read ``self.variables``: every mutable variable
collection and rng stream of the bound scope is threaded through JAX, init creates the
variables that apply uses (with the names Linen gives outside the loop) and returns what
apply returns. ``context()`` activates it in a ``with`` block; ``install()`` activates it
process-wide, inside bound modules only.
"""

try:
    import flax.linen as _linen  # noqa: F401
except ImportError as _error:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError("jaxoverride_linen needs flax: pip install 'jaxoverride[linen]'") from _error

from jaxoverride.adapter_kit import publish_errors as _publish_errors
from jaxoverride_linen import _context, _framework as _framework  # registers its record
from jaxoverride_linen._context import *  # noqa: F403  (its __all__: context, install, ...)
from jaxoverride_linen._errors import (
    ClosedOverDifferentiationError as ClosedOverDifferentiationError,
    DifferentiatedStateError as DifferentiatedStateError,
    PureFunctionWriteError as PureFunctionWriteError,
)
from jaxoverride_linen._source import (
    LinenStateError as LinenStateError,
    in_bound_module as in_bound_module,
)

__all__ = [
    "ClosedOverDifferentiationError",
    "DifferentiatedStateError",
    "LinenStateError",
    "PureFunctionWriteError",
    "in_bound_module",
]
__all__ += _context.__all__

_publish_errors(globals())  # its errors print as jaxoverride_linen.<Name>
