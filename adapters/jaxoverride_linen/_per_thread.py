"""What the Linen adapter keeps per thread: the stacks its wrappers of ``Scope`` read.

Each wrapper costs Linen's own method one read of these while the adapter is idle here.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxoverride.adapter_kit import Participant
    from jaxoverride_linen._guards import _Lifted, _Pure
    from jaxoverride_linen._source import _Step


class _PerThread(threading.local):
    def __init__(self) -> None:
        # _source: the step keys substituted for the roots' rngs, by threaded body; the
        # roots each threaded body carries; the recorder of a running creation pass.
        self.steps: list[dict[int, _Step]] = []
        self.roots: list[set[int]] = []
        self.created: dict[Any, Any] | None = None
        # _context: the roots (ids of their variable dicts) of bound modules whose
        # outermost call runs inside a JAX trace they were not bound in (a module from
        # .bind() called in a free function's loop): _source refuses their writes.
        self.foreign: list[int] = []
        # _guards: the values custom rules lift, and the guards of pure functions.
        self.lifted: list[dict[int, _Lifted]] = []
        self.pure: list[_Pure] = []
        # _declared: the solve_state declarations that custom rules' functions run under.
        self.declared: list[Participant] = []


local = _PerThread()
"""This thread's stacks."""
