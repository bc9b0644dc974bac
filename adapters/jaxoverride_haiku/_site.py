"""Parameter creation inside the one trace of a loop body or branch at init.

A parameter a traced body creates must not be a value of that trace: it is created at
the *site* (the JAX trace and Haiku frame of the outermost neutral call that started
creating), stored in the site's frame under Haiku's name, and read by the body as a value
it closes over, as at apply. Initializers draw ``fold_in(k, crc32(full name))`` with ``k``
from a copy of the site's sequence (``_creation``), so no key apply draws changes. State
created in a traced body (rare) sets ``state_created``; the owner then starts again with
the creation pass.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import haiku as hk
import jax
from haiku._src import base

from jaxoverride_haiku._compat import set_current_trace, take_current_trace
from jaxoverride_haiku._creation import _salt, _SaltedSequence
from jaxoverride_haiku._frames import Names, current_frame, initializing
from jaxoverride_haiku._rng import CheckedSequence

T = TypeVar("T")


class Site:
    """The trace and frame where parameters made inside traced bodies are created."""

    __slots__ = ("_rng", "_sandbox", "created", "frame", "state_created", "trace")

    def __init__(self, trace: Any, frame: base.Frame, rng: Any):
        self.trace = trace
        self.frame = frame
        self._rng = rng
        self._sandbox: hk.PRNGSequence | None = None
        self.created: list[tuple[str, str]] = []
        self.state_created = False

    def sandbox(self) -> hk.PRNGSequence | None:
        """A copy of the site's rng sequence at the call, made on first use (Haiku checks a
        new sequence's key with an ``eval_shape``, which a call creating nothing skips)."""
        if self._sandbox is None and self._rng is not None:
            self._sandbox = CheckedSequence(self._rng)
        return self._sandbox


_SITE: contextvars.ContextVar[Site | None] = contextvars.ContextVar(
    "jaxoverride_haiku_site", default=None
)


def _site_creator(
    next_creator: Any, shape: Any, dtype: Any, init: Any, context: hk.GetterContext
) -> Any:
    site = _SITE.get()
    if site is None:  # pragma: no cover - removed from the stack when the site ends
        return next_creator(shape, dtype, init)
    module, _, name = context.full_name.rpartition("/")
    existing = site.frame.params.get(module, {}).get(name)
    if existing is not None:  # made by an earlier trace of this call (a retrace)
        return existing
    frame = current_frame()
    # Haiku's check_jax_usage compares the frame's trace level with JAX's: both the site's.
    with set_current_trace(site.trace), base.push_jax_trace_level():
        sandbox = site.sandbox()
        salted = None if sandbox is None else _SaltedSequence(sandbox, _salt(context.full_name))
        with frame.rng_stack(salted):
            value = next_creator(shape, dtype, init)
    if value is not hk.DO_NOT_STORE and value is not None:
        site.frame.params.setdefault(module, {})[name] = value
        site.created.append((module, name))
    return value


def current_site() -> Site | None:
    """The site of the enclosing neutral call at init, if any."""
    return _SITE.get()


@contextlib.contextmanager
def create_in_trace() -> Iterator[Site]:
    """Makes parameters created by code traced inside the block at this call's site.

    Nested calls reuse the outermost site. On an exception the parameters created by
    this site are removed again.

    Yields:
      The site.
    """
    outer = _SITE.get()
    if outer is not None:
        yield outer
        return
    frame = current_frame()
    sequence = frame.rng_stack.peek()
    with take_current_trace() as trace:
        pass
    site = Site(trace, frame, None if sequence is None else sequence.internal_state)
    token = _SITE.set(site)
    # First in the creator chain, so that every other creator runs at the site's trace too.
    creators = base.param_creator_stack._storage
    creators.appendleft(_site_creator)
    try:
        yield site
    except BaseException:
        for module, name in site.created:
            bundle = frame.params.get(module)
            if bundle is not None:
                bundle.pop(name, None)
                if not bundle:
                    del frame.params[module]
        raise
    finally:
        creators.remove(_site_creator)
        _SITE.reset(token)


def init_once(one: Callable[[], T], two_pass: Callable[[], T]) -> T:
    """``one()`` (the call JAX traces); at init, with parameters created inside its trace.
    ``two_pass()`` (creation pass, then call) is the fallback where a traced function
    creates state (state, rng and naming put back first), and under ``jax.disable_jit()``
    (a zero-trip loop would not run its body)."""
    if not initializing():
        return one()
    if jax.config.jax_disable_jit:  # type: ignore[attr-defined]
        return two_pass()
    frame = current_frame()
    if current_site() is not None:
        # A nested call: the owner of the site starts again if state is created.
        with create_in_trace():
            return one()
    state: Any = frame.state  # a mapping inside a transform
    names = Names.capture(frame)
    state_before = {module: dict(bundle) for module, bundle in state.items()}
    sequence = frame.rng_stack.peek()
    rng_before = None if sequence is None else sequence.internal_state
    with create_in_trace() as site:
        out = one()
    if not site.state_created:
        return out
    # Back to the state before the call (the parameters made stay), then the two passes.
    state.clear()
    state.update(state_before)
    if sequence is not None and rng_before is not None:
        sequence.replace_internal_state(rng_before)
    names.restore_into(frame)
    return two_pass()
