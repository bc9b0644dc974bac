"""Whether parameters are being created: ``init_context`` and ``is_initializing``."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

# True inside init_context(), False inside init_context(False) and inside the apply pass
# of an init-safe combinator, None when nobody said.
_phase: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "jaxoverride_phase", default=None
)


@contextlib.contextmanager
def init_context(initializing: bool = True) -> Iterator[None]:
    """Marks the code inside as creating parameters (or, with ``False``, as not).

    The flag lives in a contextvar, so it is private to a thread and an asyncio task, and
    nests: the innermost ``init_context`` wins and the outer value returns on exit, also
    on an exception.

    Args:
      initializing: the value ``is_initializing()`` reports inside the block.

    Example:
      >>> from jaxoverride.adapter_kit import init_context, is_initializing
      >>> with init_context():
      ...     inner = is_initializing()
      ...     with init_context(False):
      ...         innermost = is_initializing()
      >>> inner, innermost, is_initializing()
      (True, False, False)
    """
    token = _phase.set(bool(initializing))
    try:
        yield
    finally:
        _phase.reset(token)


def is_initializing() -> bool:
    """True inside ``init_context()`` and outside the apply pass of init-safe combinators.

    Returns:
      Whether code running here should create the parameters it uses.

    Example:
      >>> from jaxoverride.adapter_kit import init_context, is_initializing
      >>> is_initializing()
      False
    """
    return bool(_phase.get())


def is_applying() -> bool:
    """True inside the apply pass that an init-safe combinator runs after creation.

    Adapters use it to tell "initialising, but every parameter already exists" from a
    plain initialising call: see ``jaxoverride_haiku``.

    Example:
      >>> from jaxoverride.adapter_kit import applying, init_context, is_applying
      >>> with init_context(), applying():
      ...     inside = is_applying()
      >>> inside, is_applying()
      (True, False)
    """
    return _phase.get() is False


def applying() -> contextlib.AbstractContextManager[None]:
    """Runs the block as the apply pass (``init_context(False)``): ``is_initializing()``
    is false and ``is_applying()`` true inside it.

    Example:
      >>> from jaxoverride.adapter_kit import applying, init_context, is_initializing
      >>> with init_context(), applying():
      ...     inside = is_initializing()
      >>> inside
      False
    """
    return init_context(False)
