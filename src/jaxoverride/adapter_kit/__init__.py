"""The adapter kit: what every jaxoverride adapter is written on.

For adapter authors, not for library or model authors. An adapter imports the public
core (``jaxoverride``), this kit and its own framework, and nothing from
``jaxoverride._*``.
"""

from jaxoverride.adapter_kit._state_threading import (
    DictStateSource as DictStateSource,
    StateSource as StateSource,
    StateStructureError as StateStructureError,
    Threaded as Threaded,
    applying as applying,
    init_safe as init_safe,
    is_applying as is_applying,
    threaded_call as threaded_call,
    threaded_cond as threaded_cond,
    threaded_fori_loop as threaded_fori_loop,
    threaded_map as threaded_map,
    threaded_scan as threaded_scan,
    threaded_switch as threaded_switch,
    threaded_while_loop as threaded_while_loop,
)
