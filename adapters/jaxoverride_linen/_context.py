"""``context()``, ``install()``, ``uninstall()``: the Linen overrides as one layer."""

from __future__ import annotations

from typing import Any

from flax.linen import module as linen_module

import jaxoverride as jo
from jaxoverride import adapter_kit as kit
from jaxoverride_linen import _control, _patches, _rules, _transforms

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
    """The table's layer, with Linen's ``Scope`` patched while it is entered (``_patches``)."""

    __slots__ = ()

    def __enter__(self) -> jo.OverrideContext:
        _patches.acquire()
        try:
            return super().__enter__()
        except BaseException:
            _patches.release()
            raise

    def __exit__(self, *exc_info: object) -> None:
        try:
            super().__exit__(*exc_info)
        finally:
            _patches.release()


# One layer for the whole process: re-entering it finds the builds made for it before.
_CONTEXT = _LinenContext(TABLE.overrides, name=TABLE.label)

# install() enters the installation's scope around every method call of a bound Linen
# module (Module._call_wrapped_method, the one place where Linen runs a module's method:
# __call__, setup, nn.compact and any other method) and leaves it on return. Outside
# every module the process stays idle: neutral functions cost exactly what JAX's do, with
# no per-call predicate. Inside, the cost is one scope entry per method call, which JAX
# pays only while tracing.
_Module = linen_module.Module
_linen_call = _Module._call_wrapped_method


def _call_in_scope(module: Any, fun: Any, args: Any, kwargs: Any) -> Any:
    installation = _INSTALLER.installation
    if installation is None or module.scope is None or not installation.installed:
        return _linen_call(module, fun, args, kwargs)
    with installation.scope():
        return _linen_call(module, fun, args, kwargs)


def context() -> jo.OverrideContext:
    """The Linen overrides, to enter with ``with``: neutral functions become Linen-aware.

    Inside a bound Linen module (``init``, ``init_with_output``, ``apply``, a module from
    ``bind``) every neutral transform and control-flow function threads the module's
    mutable variable collections and rng streams through JAX, creates at init the
    variables its functions use (init returns what apply returns), and names the
    submodules made in those functions as Linen would outside them. Outside a bound
    module each neutral function is JAX's own.

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

    Library code that calls the neutral API then works with Linen modules without a
    ``with`` block, while everything outside Linen modules runs exactly as before, at
    JAX's own speed: the installation is scoped (``jaxoverride.install(...,
    scoped=True)``), entered and left around each method call of a bound module (a hook
    on ``Module._call_wrapped_method``), so no predicate is asked on each neutral call.
    Calling it again returns the same installation.

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
    if _Module._call_wrapped_method is _call_in_scope:
        # Method calls running now keep the scope they entered until they return.
        _Module._call_wrapped_method = _linen_call  # type: ignore[method-assign]
    _patches.release()


_INSTALLER = kit.ScopedInstaller(_CONTEXT, "jaxoverride_linen", hook=_hook, unhook=_unhook)
