"""Flax NNX adapter: closure-captured NNX modules work in every neutral function.

``with jaxoverride_nnx.track(model): ...`` lets library code that calls
``jaxoverride.jit``, ``jaxoverride.lax.scan``, ``jaxoverride.jacfwd`` and the rest run
functions that read and write ``model`` through closures. The modules are left exactly
as eager Python execution would leave them, shared references stay shared, and
``jaxoverride.jit`` never serves stale weights. See the "Flax NNX" page of the documentation.
"""

try:
    import flax.nnx  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "jaxoverride_nnx needs flax (Flax NNX): pip install 'jaxoverride[nnx]'"
    ) from error

from jaxoverride.adapter_kit import publish_errors as _publish_errors
from jaxoverride_nnx._context import context as context, install as install, uninstall as uninstall
from jaxoverride_nnx._errors import (
    LevelError as LevelError,
    StructureChangeError as StructureChangeError,
    UntrackedModuleError as UntrackedModuleError,
)
from jaxoverride_nnx._rules import (
    ClosedOverDifferentiationError as ClosedOverDifferentiationError,
    PureFunctionWriteError as PureFunctionWriteError,
)
from jaxoverride_nnx._track import (
    Track as Track,
    track as track,
    tracked_variables as tracked_variables,
)

__all__ = [
    "ClosedOverDifferentiationError",
    "PureFunctionWriteError",
    "LevelError",
    "StructureChangeError",
    "Track",
    "UntrackedModuleError",
    "context",
    "install",
    "track",
    "tracked_variables",
    "uninstall",
]

_publish_errors(globals())  # its errors print as jaxoverride_nnx.<Name>
