"""``trace()``: log every neutral call, and optionally show progress bars for loops."""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import jaxoverride as jo
from jaxoverride import adapter_kit
from jaxoverride.adapter_kit import check_name
from jaxoverride.errors import ImportOrderWarning
from jaxoverride_debug._layer import _SESSION, Config, Session, context_for
from jaxoverride_debug._progress import require_tqdm
from jaxoverride_debug._record import Call

F = TypeVar("F", bound=Callable[..., Any])

logger = logging.getLogger("jaxoverride_debug")


class NothingTracedWarning(UserWarning):
    """A ``trace()`` ended without recording a single neutral call.

    The usual cause: the code that ran calls ``jax.*`` directly (a third-party library),
    so no call reached jaxoverride. Interpose it first: ``jaxoverride.interpose(module)``.

    Example:
      >>> import warnings, jaxoverride_debug as jd
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     with jd.trace(log=print):
      ...         pass
      >>> caught[0].category.__name__
      'NothingTracedWarning'
    """


class _Tokens(threading.local):
    def __init__(self) -> None:
        self.stack: list[Any] = []  # the session tokens of this thread's entries


def _to_logger(call: Call) -> None:
    logger.info("%s", call)


class Trace:
    """An entered or enterable trace; returned by ``trace``.

    While entered, every neutral call reaching the layer is recorded in ``calls``, sent to
    ``log``, and handed down unchanged. It may be re-entered, nested, and used as a decorator.

    Example:
      >>> import jax.numpy as jnp, jaxoverride as jo, jaxoverride_debug
      >>> with jaxoverride_debug.trace(log=print) as t:
      ...     _ = jo.lax.map(jnp.sin, jnp.zeros(3))
      lax.map(f32[3]) -> jax.lax.map
      >>> t.calls[0].impl, t.calls[0].function
      ('jax.lax.map', 'sin')
    """

    __slots__ = ("_context", "_session", "_tokens")

    def __init__(self, context: jo.OverrideContext, session: Session):
        self._context = context
        self._session = session
        self._tokens = _Tokens()

    @property
    def calls(self) -> list[Call]:
        """The records so far, in the order the calls were made (a live list)."""
        return self._session.calls

    @property
    def context(self) -> jo.OverrideContext:
        """The trace layer (one per configuration), e.g. to look at ``current_stack()``."""
        return self._context

    def format(self) -> str:
        """The records as the log shows them, one line each, indented by depth."""
        return "\n".join(str(call) for call in self.calls)

    def __enter__(self) -> Trace:
        token = _SESSION.set(self._session)
        try:
            self._context.__enter__()
        except BaseException:
            _SESSION.reset(token)
            raise
        self._tokens.stack.append(token)
        return self

    def __exit__(self, *exc_info: object) -> None:
        stack = self._tokens.stack
        if not stack:
            raise RuntimeError(
                f"{self!r} was exited in a thread or task that did not enter it; nothing changed."
            )
        # Traces of one configuration share a layer, so the core cannot tell them apart:
        # refuse a misordered exit here, before anything changes.
        if _SESSION.get() is not self._session:
            raise RuntimeError(
                f"jaxoverride_debug: exiting {self!r}, but another trace was entered after it "
                "and is still active. Traces must exit in the reverse order of entry; "
                "nothing was changed."
            )
        # The core refuses, unchanged, an exit across another entered context.
        self._context.__exit__(*exc_info)
        _SESSION.reset(stack.pop())
        if stack or exc_info[0] is not None:
            return
        if not self.calls:
            warnings.warn(
                NothingTracedWarning(
                    "jaxoverride_debug.trace() recorded no call: nothing that ran inside it "
                    "called the neutral API. A library that calls jax.jit / jax.lax directly "
                    "is invisible until it is interposed: jaxoverride.interpose_on_import("
                    "'package') before its first import, or jaxoverride.interpose(module)."
                ),
                stacklevel=2,
            )
        _warn_unreached()

    def __call__(self, fn: F) -> F:
        """Decorates ``fn`` so that each of its calls runs inside this trace."""
        return adapter_kit.calls_inside(self, fn)

    def __repr__(self) -> str:
        return f"<jaxoverride_debug.trace {self._context.name}: {len(self.calls)} calls>"


_reported: set[tuple[str, ...]] = set()


def _warn_unreached() -> None:
    """Warns, once per set of packages, about imported solver libraries whose import-time
    transforms are raw JAX: their calls never reach the trace, or any adapter."""
    held = adapter_kit.raw_import_time_transforms()
    key = tuple(sorted(held))
    if not held or key in _reported:
        return
    _reported.add(key)
    counts = ", ".join(f"{package!r} {len(names)}" for package, names in held.items())
    warnings.warn(
        ImportOrderWarning(
            "jaxoverride_debug.trace(): imported libraries hold transforms they built with "
            f"raw JAX while they were imported ({counts}); calls inside those are invisible "
            "to the trace and to every adapter. Fix: call "
            f"{adapter_kit.interpose_fix(list(held))}."
        ),
        stacklevel=3,
    )


def _check_names(names: Iterable[str] | None) -> frozenset[str] | None:
    if names is None:
        return None
    if isinstance(names, str):
        raise TypeError(
            f"jaxoverride_debug.trace(names=...) expects a collection of names, got the "
            f"string {names!r}; write names=[{names!r}]."
        )
    try:
        items = list(names)
    except TypeError:
        raise TypeError(
            f"jaxoverride_debug.trace(names=...) expects a collection of names such as "
            f"['lax.scan', 'jit'], got {type(names).__name__}."
        ) from None
    return frozenset(check_name(name, where="jaxoverride_debug.trace(names=...)") for name in items)


def _check_options(options: Mapping[str, Any] | None) -> tuple[tuple[str, Any], ...]:
    if options is None:
        return ()
    if not isinstance(options, Mapping):
        raise TypeError(
            "jaxoverride_debug.trace(progress_options=...) expects a mapping of tqdm keyword "
            f"arguments such as {{'leave': False}}, got {type(options).__name__}."
        )
    items = tuple(sorted(options.items()))
    try:
        hash(items)
    except TypeError:
        raise TypeError(
            "jaxoverride_debug.trace(progress_options=...): the values must be hashable, "
            "since they are compiled into the traced loops and so select the trace layer; "
            f"got {options!r}."
        ) from None
    return items


def trace(
    *,
    log: Callable[[Call], object] | None = None,
    names: Iterable[str] | None = None,
    progress: bool = False,
    min_steps: int = 2,
    progress_options: Mapping[str, Any] | None = None,
) -> Trace:
    """Logs every neutral call, with its shapes and the implementation it goes to.

    While the returned ``Trace`` is entered, each neutral call reaching the trace layer is
    recorded as a ``Call`` (name, argument shapes, the implementation below it) and handed
    down unchanged. Calls are recorded when Python runs them (inside ``jit``, when JAX
    traces); a transform gives a ``"build"`` record when its function is built and a
    ``"run"`` record per call. Entered innermost, it sees the calls as the library makes
    them; not entered, it costs nothing.

    Args:
      log: called with each ``Call`` as it is recorded, e.g. ``print``; by default each
        record goes to the ``logging`` logger ``"jaxoverride_debug"`` at INFO level.
      names: record only these overridable names (and attach bars only to these);
        default all. Unknown names are rejected with the closest match.
      progress: attach a tqdm progress bar to each ``lax.scan``, ``lax.fori_loop`` and
        ``lax.map`` with a static trip count of at least ``min_steps``, updated from
        inside the compiled loop by ``jax.debug.callback``. Needs tqdm
        (``pip install 'jaxoverride[debug]'``).
      min_steps: the smallest trip count that gets a bar.
      progress_options: keyword arguments for ``tqdm.tqdm``, such as
        ``{"leave": False}`` or ``{"file": sys.stdout}``; hashable values.

    Returns:
      A ``Trace``: a context manager and decorator whose ``calls`` lists the records.

    Raises:
      TypeError: ``log`` is not callable, or an argument has the wrong type.
      ValueError: an unknown name in ``names``, or ``min_steps`` below 1.
      ImportError: ``progress=True`` without tqdm installed.

    Example:
      >>> import jax.numpy as jnp, jaxoverride as jo, jaxoverride_debug
      >>> def total(xs):
      ...     return jo.lax.scan(lambda c, x: (c + x, None), 0.0, xs)[0]
      >>> with jaxoverride_debug.trace(log=print) as t:
      ...     _ = jo.jit(total)(jnp.ones(4))
      jit(total) built -> jax.jit
      jit(total)(f32[4]) -> jax.jit
        lax.scan(float, f32[4]) -> jax.lax.scan
      >>> [call.depth for call in t.calls]
      [0, 0, 1]
    """
    if log is not None and not callable(log):
        raise TypeError(
            f"jaxoverride_debug.trace(log=...) expects a callable taking a Call, such as "
            f"print or a list's append, got {type(log).__name__} {log!r}."
        )
    if not isinstance(progress, bool):
        raise TypeError(f"jaxoverride_debug.trace(progress=...) expects a bool, got {progress!r}.")
    if isinstance(min_steps, bool) or not isinstance(min_steps, int):
        raise TypeError(
            f"jaxoverride_debug.trace(min_steps=...) expects an int, got {min_steps!r}."
        )
    if min_steps < 1:
        raise ValueError(
            f"jaxoverride_debug.trace(min_steps=...) is the smallest trip count that gets a "
            f"progress bar and must be at least 1, got {min_steps}."
        )
    checked_names = _check_names(names)
    options = _check_options(progress_options)
    if progress:
        require_tqdm()
    else:
        min_steps, options = 0, ()  # nothing of them is compiled in: share the layer
    config = Config(checked_names, progress, min_steps, options)
    return Trace(context_for(config), Session(_to_logger if log is None else log))
