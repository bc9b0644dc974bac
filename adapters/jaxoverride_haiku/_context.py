"""``context()``, ``install()`` and ``uninstall()``: the overrides as one layer."""

from __future__ import annotations

import contextvars
import threading
from typing import Any

from haiku._src import base

import jaxoverride as jo
from jaxoverride import adapter_kit as kit
from jaxoverride_haiku import _control, _convert, _jit, _layer, _mapped, _rules, _transforms

__all__ = ["context", "install", "is_installed", "uninstall"]

# Every overridable name is Haiku-aware; nothing passes through.
TABLE = kit.OverrideTable(
    "jaxoverride_haiku",
    {
        **kit.overrides_in(_jit, "jit"),
        **kit.overrides_in(_mapped, "pmap", "shard_map"),
        **_transforms.TRANSFORMS,
        "eval_shape": _transforms.eval_shape,
        **_control.OVERRIDES,
        **_convert.CONVERSIONS,
        **kit.overrides_in(_rules, "custom_vjp", "custom_jvp"),
    },
)


class _HaikuContext(jo.OverrideContext):
    """The table's layer, with Haiku's transform exit hooked while it is entered.

    When a transform ends, no parameter or state value may be a tracer left behind by a
    raw JAX transform (a library's import-time ``jax.jit``, which no guard reaches).
    """

    __slots__ = ()

    def __enter__(self) -> jo.OverrideContext:
        global _context_entries
        result = super().__enter__()
        _entered_depth.set(_entered_depth.get() + 1)
        with _INSTALLER.lock:
            _context_entries += 1
            base.HaikuContext.__exit__ = _exit_transform  # type: ignore[method-assign]
        return result

    def __exit__(self, *exc_info: object) -> None:
        global _context_entries
        # Leaving out of order raises with nothing changed: the hook stays counted too.
        super().__exit__(*exc_info)
        _entered_depth.set(_entered_depth.get() - 1)
        with _INSTALLER.lock:
            _context_entries -= 1
            _restore_exit_if_unused()


# One layer for the whole process: re-entering it finds the builds made for it before.
_CONTEXT = _HaikuContext(TABLE.overrides, name=TABLE.label)

# How deep this thread or task is inside ``context()``; read only by the exit hook.
_entered_depth: contextvars.ContextVar[int] = contextvars.ContextVar(
    "jaxoverride_haiku_context_depth", default=0
)
# Entries of ``context()`` in all threads and tasks now open: Haiku's transform exit is
# hooked while any is (a class attribute is process-wide), and put back after the last.
_context_entries = 0

# install() enters the installation's scope in HaikuContext.__enter__ (where Haiku pushes
# a transform frame) and leaves it on exit: outside transforms neutral calls cost what
# JAX's do. Each thread pairs a context with the scope its enter opened, so an exit closes
# exactly that, also across install()/uninstall() inside a transform.
_haiku_enter = base.HaikuContext.__enter__
_haiku_exit = base.HaikuContext.__exit__
_open_scopes = 0


class _Scopes(threading.local):
    def __init__(self) -> None:
        self.stack: list[tuple[base.HaikuContext, Any]] = []


_scopes = _Scopes()


def _enter_transform(context: base.HaikuContext) -> base.HaikuContext:
    global _open_scopes
    result = _haiku_enter(context)
    installation = _INSTALLER.installation
    if installation is None:
        return result
    if not installation.installed:
        # Removed through the handle, not ``uninstall()``: a stale one must not activate.
        _INSTALLER.forget(installation)
        return result
    scope = installation.scope()
    try:
        scope.__enter__()
    except BaseException:
        _haiku_exit(context, None, None, None)
        raise
    _scopes.stack.append((context, scope))
    with _INSTALLER.lock:
        _open_scopes += 1
    return result


def _exit_transform(context: base.HaikuContext, *exc_info: Any) -> None:
    global _open_scopes
    stack = _scopes.stack
    scoped = bool(stack) and stack[-1][0] is context
    escaped = 0
    try:
        if (scoped or _entered_depth.get()) and exc_info[0] is None and kit.adapter_check_on():
            # A library never interposed ran Haiku code inside its raw transform.
            frame = base.current_frame()
            escaped = len(kit.escaped_tracers((frame.params, frame.state)))
        if scoped:
            _, scope = stack.pop()
            with _INSTALLER.lock:
                _open_scopes -= 1
                _restore_exit_if_unused()
            scope.__exit__(None, None, None)
    finally:
        _haiku_exit(context, *exc_info)
    if escaped:
        raise kit.raw_transform_error("Haiku", "hk.transform", escaped)


def context() -> jo.OverrideContext:
    """The Haiku overrides, to enter with ``with``: neutral functions become Haiku-aware.

    Inside ``hk.transform`` every neutral function threads Haiku params, state and rng
    through JAX, creates parameters at init, and names modules as Haiku would; elsewhere
    it is JAX's own. A transform ending inside raises ``MissingAdapterError`` for
    parameters or state left as tracers by a raw JAX transform.

    Returns:
      The adapter's ``OverrideContext`` (one object, reusable, reentrant; also a
      decorator and a mapping).

    Example:
      >>> import jax, jax.numpy as jnp, haiku as hk
      >>> import jaxoverride as jo, jaxoverride_haiku as joh
      >>> def f(x):
      ...     layer = hk.Linear(2)
      ...     return jo.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(layer(h)), x)
      >>> model = hk.transform(f)
      >>> x = jnp.ones((1, 2))
      >>> with joh.context():
      ...     params = model.init(jax.random.PRNGKey(0), x)
      ...     out = model.apply(params, None, x)
      >>> sorted(params), out.shape
      (['linear'], (1, 2))
    """
    return _CONTEXT


def install() -> jo.Installation:
    """Registers the Haiku overrides for the whole process, active only inside transforms.

    Scoped (``jaxoverride.install(..., scoped=True)``): a hook on Haiku's transform context
    enters it, so everything outside ``hk.transform`` runs at JAX's own speed. Calling it
    again returns the same installation.

    Returns:
      The ``jaxoverride.Installation``; ``uninstall()`` removes it.

    Example:
      >>> import jax, jax.numpy as jnp, haiku as hk
      >>> import jaxoverride as jo, jaxoverride_haiku as joh
      >>> handle = joh.install()
      >>> def f(x):
      ...     return jo.lax.scan(lambda c, _: (hk.Linear(2)(c), None), x, length=2)[0]
      >>> model = hk.transform(f)
      >>> params = model.init(jax.random.PRNGKey(0), jnp.ones(2))
      >>> sorted(params)
      ['linear']
      >>> joh.uninstall()
      True
    """
    return _INSTALLER.install()


def uninstall() -> bool:
    """Removes what ``install()`` registered.

    Returns:
      True if it was installed, False if there was nothing to remove.

    Example:
      >>> import jaxoverride_haiku as joh
      >>> joh.uninstall()
      False
    """
    return _INSTALLER.uninstall()


def is_installed() -> bool:
    """Whether ``install()`` is in effect.

    Returns:
      True between ``install()`` and ``uninstall()``.

    Example:
      >>> import jaxoverride_haiku as joh
      >>> joh.is_installed()
      False
    """
    return _INSTALLER.is_installed()


def _restore_exit_if_unused() -> None:
    """Haiku's own transform exit back once no installed transform is open and no
    ``context()`` is entered anywhere (the lock held)."""
    unused = _INSTALLER.installation is None and _open_scopes == 0 and _context_entries == 0
    if unused and base.HaikuContext.__exit__ is _exit_transform:
        base.HaikuContext.__exit__ = _haiku_exit  # type: ignore[method-assign]


def _hook() -> None:
    base.HaikuContext.__enter__ = _enter_transform  # type: ignore[method-assign]
    base.HaikuContext.__exit__ = _exit_transform  # type: ignore[method-assign]


def _unhook() -> None:
    if base.HaikuContext.__enter__ is _enter_transform:
        base.HaikuContext.__enter__ = _haiku_enter  # type: ignore[method-assign]
    _restore_exit_if_unused()


_INSTALLER = kit.ScopedInstaller(_CONTEXT, "jaxoverride_haiku", hook=_hook, unhook=_unhook)

_layer.record(_CONTEXT, is_installed)
