"""``override_context`` and process-wide ``install``/``uninstall``."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from jaxoverride import _stack
from jaxoverride._names import check_mapping

F = TypeVar("F", bound=Callable[..., Any])


def _label(
    mapping: object, impls: Mapping[str, Callable[..., Any]], name: str | None, kind: str
) -> str:
    if name is not None:
        if not isinstance(name, str):
            raise TypeError(f"name= must be a string label, got {type(name).__name__} {name!r}.")
        return name
    if isinstance(mapping, OverrideContext):
        return mapping.name
    owners = sorted({getattr(impl, "__module__", None) or "?" for impl in impls.values()})
    return f"{kind}(" + ", ".join(owners) + ")"


def calls_inside(manager: Any, fn: F) -> F:
    """``fn`` wrapped so that each of its calls runs inside ``with manager:``.

    What a context manager that is also a decorator returns. A coroutine function stays
    one, and its whole run (its awaits included) is inside ``manager``.

    Args:
      manager: a reusable context manager (entered once per call).
      fn: the function to decorate.

    Returns:
      The wrapper, with ``fn``'s name, docstring and signature.

    Raises:
      TypeError: ``fn`` is not callable.

    Example:
      >>> from jaxoverride.adapter_kit import calls_inside
      >>> log = []
      >>> class Logged:
      ...     def __enter__(self):
      ...         log.append("enter")
      ...     def __exit__(self, *exc_info):
      ...         log.append("exit")
      >>> double = calls_inside(Logged(), lambda x: 2 * x)
      >>> double(3), double(4), log
      (6, 8, ['enter', 'exit', 'enter', 'exit'])
    """
    if not callable(fn):
        raise TypeError(
            f"{manager!r} used as a decorator expects a function, got {type(fn).__name__}."
        )
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def run_async(*args: Any, **kwargs: Any) -> Any:
            with manager:
                return await fn(*args, **kwargs)

        return run_async  # type: ignore[return-value]

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with manager:
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]


class OverrideContext(Mapping[str, Callable[..., Any]]):
    """A layer of overrides, entered with ``with``; returned by ``override_context``.

    A read-only mapping of its overrides, so contexts compose
    (``override_context({**jaxoverride_plain.context(), "jit": my_jit})``), and a
    decorator that enters around each call. It keeps no state: one object may be entered
    any number of times, nested, from many threads and tasks at once.

    Example:
      >>> import jax, jaxoverride as jo
      >>> ctx = jo.override_context({"lax.map": lambda f, xs, **kw: "mine"}, name="demo")
      >>> sorted(ctx), ctx.name
      (['lax.map'], 'demo')
      >>> @ctx
      ... def run():
      ...     return jo.lax.map(abs, jax.numpy.arange(2))
      >>> run()
      'mine'
    """

    __slots__ = ("_layer",)

    def __init__(self, mapping: Mapping[str, Callable[..., Any]], *, name: str | None = None):
        impls = check_mapping(mapping, where="jaxoverride.override_context")
        self._layer = _stack.intern_layer(_label(mapping, impls, name, "override_context"), impls)

    @property
    def name(self) -> str:
        """The label shown by ``jaxoverride.current_stack()``."""
        return self._layer.label

    def __getitem__(self, key: str) -> Callable[..., Any]:
        return self._layer.impls[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._layer.impls)

    def __len__(self) -> int:
        return len(self._layer.impls)

    def __enter__(self) -> OverrideContext:
        current = _stack.context_snapshot()
        _stack.enter(current.push(self._layer), self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        _stack.leave(self)

    def __call__(self, fn: F) -> F:
        """Decorates ``fn`` so that each of its calls runs inside this context."""
        return calls_inside(self, fn)

    def __repr__(self) -> str:
        return f"<OverrideContext {self.name}: {', '.join(sorted(self))}>"


def override_context(
    mapping: Mapping[str, Callable[..., Any]], *, name: str | None = None
) -> OverrideContext:
    """A context in which neutral functions dispatch to the given implementations.

    Contexts nest (the innermost override of a name wins, and reaches those below it
    with ``jaxoverride.next_impl``), are private to a thread and an asyncio task, unwind
    on exceptions, and are resolved at each call, so ``jo.jit(f)`` may be made before.

    Args:
      mapping: ``{name: implementation}`` where each name is in
        ``jaxoverride.OVERRIDEABLE`` and each implementation has the signature of the JAX
        function it replaces (``"lax.scan"`` takes ``jax.lax.scan``'s arguments; ``"jit"``
        takes ``jax.jit``'s and returns the jitted function).
      name: a label for ``jaxoverride.current_stack()``; by default, the modules that
        define the implementations.

    Returns:
      An ``OverrideContext``: a context manager, a decorator, and a read-only mapping.

    Raises:
      TypeError: ``mapping`` is not a mapping, or an implementation is not callable.
      ValueError: a name is not overridable; the message names the closest valid one.

    Example:
      >>> import jax, jaxoverride as jo
      >>> seen = []
      >>> def logging_scan(f, init, xs=None, length=None, **kwargs):
      ...     seen.append("scan")
      ...     return jo.next_impl("lax.scan")(f, init, xs, length, **kwargs)
      >>> with jo.override_context({"lax.scan": logging_scan}, name="logging"):
      ...     _ = jo.lax.scan(lambda c, x: (c + x, None), 0, xs=jax.numpy.arange(3))
      >>> seen
      ['scan']
    """
    return OverrideContext(mapping, name=name)


class _Scope:
    """The dynamic extent in which a scoped installation is active; see ``Installation.scope``."""

    __slots__ = ("_installation",)

    def __init__(self, installation: Installation):
        self._installation = installation

    def __enter__(self) -> None:
        _stack.enter_scoped(self._installation._entry.layer, self)

    def __exit__(self, *exc_info: object) -> None:
        _stack.leave(self)

    def __repr__(self) -> str:
        return f"<scope of {self._installation.name}>"


class Installation:
    """A handle on an adapter installed for the whole process; see ``install``.

    Example:
      >>> import jax, jaxoverride as jo
      >>> with jo.install({"lax.map": lambda f, xs, **kw: "mine"}, scoped=True) as handle:
      ...     outside = jo.lax.map(abs, jax.numpy.arange(2)).tolist()
      ...     with handle.scope():
      ...         inside = jo.lax.map(abs, jax.numpy.arange(2))
      >>> outside, inside, handle.installed
      ([0, 1], 'mine', False)
    """

    __slots__ = ("_entry",)

    def __init__(self, entry: _stack.Installed):
        self._entry = entry

    @property
    def name(self) -> str:
        return self._entry.layer.label

    @property
    def installed(self) -> bool:
        """Whether this installation is still registered."""
        return self._entry in _stack.installed

    def scope(self) -> _Scope:
        """A context manager inside which a ``scoped=True`` installation is active.

        The adapter enters it from a hook of its framework (Haiku: while a transform
        runs), any number of times, nested, from many threads; the layer sits beneath
        every override context.

        Raises:
          TypeError: the installation was not made with ``scoped=True``.
        """
        if not self._entry.scoped:
            raise TypeError(
                f"{self!r} is activated by its when= predicate; scope() is only for "
                "installations made with install(..., scoped=True)."
            )
        return _Scope(self)

    def uninstall(self) -> bool:
        """Removes the installation; returns False if it had already been removed.

        Scopes already entered stay active until they exit.
        """
        return _stack.remove_installed(self._entry)

    def __enter__(self) -> Installation:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.uninstall()

    def __repr__(self) -> str:
        state = "installed" if self.installed else "uninstalled"
        return f"<Installation {self.name} ({state})>"


def install(
    mapping: Mapping[str, Callable[..., Any]],
    *,
    when: Callable[[], bool] | None = None,
    scoped: bool = False,
    name: str | None = None,
) -> Installation:
    """Registers overrides for every thread and task, active by a predicate or in scopes.

    How an adapter makes library code stateful without the library knowing
    (``jaxoverride_haiku.install()``). Installed layers sit beneath all entered contexts,
    in installation order; installing an equal layer the same way again returns the
    existing installation. ``when=`` costs a Python-level dispatch on every neutral call
    (about 10 % of a ``jax.jit`` cache hit); ``scoped=True`` leaves the process idle
    outside ``installation.scope()``, which the adapter enters from a hook of its framework.

    Args:
      mapping: as for ``override_context``; an ``OverrideContext`` works too.
      when: a cheap predicate taking no arguments; ``None`` means always active.
      scoped: activate only inside ``scope()`` instead; excludes ``when``.
      name: a label for ``jaxoverride.current_stack()``.

    Returns:
      An ``Installation``; call its ``uninstall()`` (or ``jaxoverride.uninstall``) to
      remove it. Used as a context manager it uninstalls on exit.

    Raises:
      TypeError: as for ``override_context``; ``when`` is not callable; or both
        ``when`` and ``scoped`` were given.

    Example:
      >>> import jax, jaxoverride as jo
      >>> switch = {"on": False}
      >>> handle = jo.install({"lax.map": lambda f, xs, **kw: "overridden"},
      ...                     when=lambda: switch["on"], name="demo")
      >>> jo.lax.map(abs, jax.numpy.arange(2)).tolist()
      [0, 1]
      >>> switch["on"] = True
      >>> jo.lax.map(abs, jax.numpy.arange(2))
      'overridden'
      >>> handle.uninstall()
      True
    """
    impls = check_mapping(mapping, where="jaxoverride.install")
    if when is not None:
        try:
            inspect.signature(when).bind()
        except ValueError:
            pass  # no signature to check (some builtins): it is called as when()
        except TypeError:  # not callable, or it takes arguments
            raise TypeError(
                "jaxoverride.install: when= must be a predicate taking no arguments, got "
                f"{type(when).__name__} {when!r}. Close over what it needs instead, e.g. "
                "when=lambda: frame_is_active(frame)."
            ) from None
    if when is not None and scoped:
        raise TypeError(
            "jaxoverride.install: pass either when= (asked on every call) or scoped=True "
            "(active inside installation.scope()), not both."
        )
    layer = _stack.intern_layer(_label(mapping, impls, name, "install"), impls)
    return Installation(_stack.add_installed(_stack.Installed(layer, when, scoped)))


def uninstall(installation: Installation) -> bool:
    """Removes an installation made by ``install``.

    Args:
      installation: what ``install`` returned.

    Returns:
      True, or False if it had already been removed.

    Example:
      >>> import jax, jaxoverride as jo
      >>> handle = jo.install({"lax.scan": jax.lax.scan}, name="example")
      >>> jo.uninstall(handle), jo.uninstall(handle)
      (True, False)
    """
    if not isinstance(installation, Installation):
        raise TypeError(
            "jaxoverride.uninstall expects the Installation that install() returned, got "
            f"{type(installation).__name__}."
        )
    return installation.uninstall()
