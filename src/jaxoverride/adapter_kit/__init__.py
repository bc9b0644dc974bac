"""The adapter kit: what every jaxoverride adapter is written on.

For adapter authors, not for library or model authors. An adapter imports the public
core (``jaxoverride``), this kit and its own framework, and nothing from
``jaxoverride._*``.
"""

from jaxoverride.adapter_kit._frameworks import declare_handler as declare_handler
from jaxoverride.adapter_kit._leaks import (
    escaped_tracers as escaped_tracers,
    raw_transform_error as raw_transform_error,
)
from jaxoverride.adapter_kit._raw import (
    SOLVER_LIBRARIES as SOLVER_LIBRARIES,
    interpose_fix as interpose_fix,
    raw_import_time_transforms as raw_import_time_transforms,
)
