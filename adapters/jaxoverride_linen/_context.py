"""``context()``, ``install()``, ``uninstall()``: the Linen overrides as one layer."""

from __future__ import annotations

import contextvars
from typing import Any

from flax.core import tracers as core_tracers
from flax.linen import module as linen_module

import jaxoverride as jo
from jaxoverride import adapter_kit as kit
from jaxoverride_linen import _control, _patches, _rules, _source, _transforms
from jaxoverride_linen._per_thread import local as _local

__all__ = ["context", "install", "is_installed", "uninstall"]

# Every overridable name is Linen-aware; nothing passes through.
TABLE = kit.OverrideTable(
    "jaxoverride_linen",
    {
        **_transforms.OVERRIDES,
        **_control.OVERRIDES,
        **_rules.IMPLICIT_OVERRIDES,
    },
)


class _LinenContext(jo.OverrideContext):
    """The table's layer, with Linen's ``Scope`` patched while it is entered (``_patches``),
    and Linen's method calls hooked for the end-of-call check (``_call_in_scope``)."""

    __slots__ = ()

    def __enter__(self) -> jo.OverrideContext:
        global _context_entries
        _patches.acquire()
        try:
            result = super().__enter__()
        except BaseException:
            _patches.release()
            raise
        _entered_depth.set(_entered_depth.get() + 1)
        with _INSTALLER.lock:
            _context_entries += 1
            _Module._call_wrapped_method = _call_in_scope  # type: ignore[method-assign]
        return result

    def __exit__(self, *exc_info: object) -> None:
        global _context_entries
        try:
            # Leaving out of order raises with nothing changed (the patches stay counted
            # too, as before); the hook is released only by a real exit.
            super().__exit__(*exc_info)
        except BaseException:
            _patches.release()
            raise
        _entered_depth.set(_entered_depth.get() - 1)
        try:
            with _INSTALLER.lock:
                _context_entries -= 1
                _restore_calls_if_unused()
        finally:
            _patches.release()


# One layer for the whole process: re-entering it finds the builds made for it before.
_CONTEXT = _LinenContext(TABLE.overrides, name=TABLE.label)

# install() enters the installation's scope around every method call of a bound module
# (Module._call_wrapped_method runs them all): outside modules neutral calls cost what
# JAX's do. The same hook, also under ``context()``, checks on the outermost call's return
# that no variable is a tracer of an ended trace (a library's raw import-time jax.jit).
_Module = linen_module.Module
_linen_call = _Module._call_wrapped_method
_linen_context = linen_module._context  # Linen's thread-local module stack

# How deep this thread or task is inside ``context()``; read only by the method hook.
_entered_depth: contextvars.ContextVar[int] = contextvars.ContextVar(
    "jaxoverride_linen_context_depth", default=0
)
# Entries of ``context()`` in all threads and tasks now open: the method hook stays on
# while any is (a class attribute is process-wide), and comes off after the last.
_context_entries = 0


def _call_in_scope(module: Any, fun: Any, args: Any, kwargs: Any) -> Any:
    if module.scope is None:
        return _linen_call(module, fun, args, kwargs)
    installation = _INSTALLER.installation
    if installation is not None and installation.installed:
        with installation.scope():
            out = _call_marked(module, fun, args, kwargs)
    elif _entered_depth.get():
        out = _call_marked(module, fun, args, kwargs)
    else:
        return _linen_call(module, fun, args, kwargs)
    if _linen_context.module_stack[-1] is None and kit.adapter_check_on():
        escaped = kit.escaped_tracers(module.scope.root._variables)
        if escaped:
            raise kit.raw_transform_error("Flax Linen", "A bound Linen module's call", len(escaped))
    return out


def _call_marked(module: Any, fun: Any, args: Any, kwargs: Any) -> Any:
    """Linen's call; an outermost call inside a JAX trace its root was not bound in (a
    ``.bind()`` module in a free function's loop) is marked, so a write of its variables
    is refused (``_source``): nothing threads its state."""
    root = module.scope.root
    if _linen_context.module_stack[-1] is not None or root.trace_level == (
        core_tracers.current_trace()
    ):
        return _linen_call(module, fun, args, kwargs)
    foreign = _local.foreign
    foreign.append(id(root._variables))
    try:
        return _linen_call(module, fun, args, kwargs)
    finally:
        foreign.pop()
        # Linen rewinds a compact module's scope after each call, and the new root takes
        # the trace running now as its own: it keeps the one it was bound in instead.
        module.scope.root.trace_level = root.trace_level


def _restore_calls_if_unused() -> None:
    """Linen's own method runner back once nothing needs the hook (the lock held)."""
    unused = _INSTALLER.installation is None and _context_entries == 0
    if unused and _Module._call_wrapped_method is _call_in_scope:
        # Method calls running now keep the scope they entered until they return.
        _Module._call_wrapped_method = _linen_call  # type: ignore[method-assign]


def context() -> jo.OverrideContext:
    """The Linen overrides, to enter with ``with``: neutral functions become Linen-aware.

    Inside a bound Linen module every neutral function threads the mutable collections
    and rng streams through JAX, creates at init the variables its functions use, and
    names submodules as Linen would; outside one it is JAX's own. The outermost method
    call raises ``MissingAdapterError`` for variables left as tracers by a raw JAX
    transform.

    Returns:
      The adapter's ``OverrideContext`` (one object, reusable, reentrant).

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn
      >>> import jaxoverride as jo, jaxoverride_linen as jol
      >>> class Loop(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x):
      ...         dense = nn.Dense(2)
      ...         return jo.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(dense(h)), x)
      >>> with jol.context():
      ...     variables = Loop().init(jax.random.key(0), jnp.ones((1, 2)))
      ...     out = Loop().apply(variables, jnp.ones((1, 2)))
      >>> list(variables["params"]), out.shape
      (['Dense_0'], (1, 2))
    """
    return _CONTEXT


def install() -> jo.Installation:
    """Registers the Linen overrides for the whole process, active inside bound modules.

    Scoped (``jaxoverride.install(..., scoped=True)``): a hook on
    ``Module._call_wrapped_method`` enters it around each method call of a bound module,
    so everything outside runs at JAX's own speed. Calling it again returns the same
    installation.

    Returns:
      The ``jaxoverride.Installation``; ``uninstall()`` removes it.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn
      >>> import jaxoverride as jo, jaxoverride_linen as jol
      >>> handle = jol.install()
      >>> class Scan(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x):
      ...         return jo.lax.scan(lambda c, _: (nn.Dense(2)(c), None), x, length=2)[0]
      >>> variables = Scan().init(jax.random.key(0), jnp.ones(2))
      >>> list(variables["params"])
      ['Dense_0']
      >>> jol.uninstall(), jol.is_installed()
      (True, False)
    """
    return _INSTALLER.install()


def uninstall() -> bool:
    """Takes the Linen overrides out of the process, and puts Flax's ``Scope`` back.

    Method calls of bound modules that are running keep the scope they entered until
    they return.

    Returns:
      True if ``install()`` was in effect, False if there was nothing to remove.

    Example:
      >>> import jaxoverride_linen as jol
      >>> handle = jol.install()
      >>> jol.uninstall(), jol.uninstall()
      (True, False)
    """
    return _INSTALLER.uninstall()


def is_installed() -> bool:
    """Whether ``install()`` is in effect; entering ``context()`` does not count.

    Returns:
      True from ``install()`` until ``uninstall()`` or the handle's own ``uninstall()``.

    Example:
      >>> import jaxoverride_linen as jol
      >>> with jol.context():
      ...     inside = jol.is_installed()
      >>> handle = jol.install()
      >>> inside, jol.is_installed(), jol.uninstall(), jol.is_installed()
      (False, True, True, False)
    """
    return _INSTALLER.is_installed()


def _hook() -> None:
    """Linen's ``Scope`` patched, and method calls entering the installation's scope."""
    _patches.acquire()
    _Module._call_wrapped_method = _call_in_scope  # type: ignore[method-assign]


def _unhook() -> None:
    """Linen's own method runner and ``Scope`` back (the installer's lock held)."""
    _restore_calls_if_unused()
    _patches.release()


_INSTALLER = kit.ScopedInstaller(_CONTEXT, "jaxoverride_linen", hook=_hook, unhook=_unhook)


def _solve_source() -> Any:
    """The source a ``jaxoverride.solve_state`` applies to: the Linen modules running now
    where this adapter is active; None elsewhere (the declaration changes nothing)."""
    if not _source.in_bound_module():
        return None
    installation = _INSTALLER.installation
    if not _entered_depth.get() and not (installation is not None and installation.installed):
        return None
    return _source.source("jaxoverride.solve_state", solve_entry=True)


kit.register_solve_source("linen", _solve_source)
