"""jaxoverride_haiku: every neutral jaxoverride function works inside ``hk.transform``.

Library code written against ``jaxoverride`` (``jo.jit``, ``jo.vmap``, ``jo.jacfwd``,
``jaxoverride.lax.scan``, ``while_loop``, ...) runs unchanged with Haiku modules in the
functions it receives: params, state and rng are threaded through JAX, init creates every
parameter apply uses and returns what apply returns, and modules built inside callbacks
are named as Haiku names them. ``context()`` activates it in a ``with`` block;
``install()`` activates it process-wide, inside transforms only.

``pmap``, ``shard_map`` and ``jit`` with shardings work on many devices: Haiku state enters
replicated and must leave replicated (reduce it with ``lax.pmean`` before writing it).
"""

try:
    import haiku as _haiku  # noqa: F401
except ImportError as _error:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "jaxoverride_haiku needs dm-haiku: pip install 'jaxoverride[haiku]'"
    ) from _error

from jaxoverride.adapter_kit import publish_errors as _publish_errors
from jaxoverride_haiku import (
    _context,
    _framework as _framework,  # registers its record
    _solve as _solve,  # registers its solve_state source
)
from jaxoverride_haiku._context import *  # noqa: F403  (its __all__: context, install, ...)
from jaxoverride_haiku._convert import PureFunctionWriteError as PureFunctionWriteError
from jaxoverride_haiku._frames import in_transform as in_transform, state_usable as state_usable
from jaxoverride_haiku._rules import (
    ClosedOverDifferentiationError as ClosedOverDifferentiationError,
    DifferentiatedStateError as DifferentiatedStateError,
)

__all__ = [
    "ClosedOverDifferentiationError",
    "DifferentiatedStateError",
    "PureFunctionWriteError",
    "in_transform",
    "state_usable",
]
__all__ += _context.__all__

_publish_errors(globals())  # its errors print as jaxoverride_haiku.<Name>
