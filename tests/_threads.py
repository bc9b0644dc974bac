"""Running one worker in several threads at once, with their failures reported."""

from __future__ import annotations

import threading
from collections.abc import Callable


def run_in_threads(worker: Callable[[int], object], count: int) -> None:
    """Runs ``worker(i)`` for ``i`` in ``range(count)``, each in its own thread, and
    fails with every thread's exception if any raised."""
    errors: list[BaseException] = []

    def guarded(index: int) -> None:
        try:
            worker(index)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
