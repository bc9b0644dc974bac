"""``install()``/``uninstall()``/``is_installed()`` for an adapter active inside its framework.

An adapter such as Haiku's or Linen's installs its overrides process-wide but *scoped*
(``jaxoverride.install(..., scoped=True)``): a hook in its framework (Haiku's transform
context, Linen's method calls) enters the installation's scope where the framework runs,
so that everything else runs at JAX's own speed with no per-call predicate. What is the
same for every such adapter, the one installation per process, its lock, and putting the
hook in and taking it out, is ``ScopedInstaller``.

Stability: semi-public, as the rest of the kit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import jaxoverride as jo


class ScopedInstaller:
    """One scoped installation of an adapter's overrides, and its framework hook.

    Args:
      context: the adapter's ``OverrideContext``.
      name: the adapter's name, for ``jaxoverride.install``.
      hook: puts the framework hook in (called under ``lock`` on install).
      unhook: takes it out (called under ``lock``, once per ``hook``: on uninstall, and
        when an installation removed through its handle is forgotten or replaced).

    Attributes:
      installation: the current ``jaxoverride.Installation``, or None. The hook reads it.
      lock: guards ``installation`` and the hook; the hook may take it too.

    Example:
      >>> import jaxoverride as jo
      >>> from jaxoverride.adapter_kit import ScopedInstaller
      >>> hooked = []
      >>> installer = ScopedInstaller(
      ...     jo.override_context({}), "example",
      ...     hook=lambda: hooked.append(True), unhook=hooked.clear)
      >>> handle = installer.install()
      >>> installer.is_installed(), hooked
      (True, [True])
      >>> installer.uninstall(), installer.is_installed(), hooked
      (True, False, [])
    """

    __slots__ = ("_context", "_hook", "_name", "_unhook", "installation", "lock")

    def __init__(
        self,
        context: jo.OverrideContext,
        name: str,
        *,
        hook: Callable[[], None],
        unhook: Callable[[], None],
    ):
        self._context = context
        self._name = name
        self._hook = hook
        self._unhook = unhook
        self.installation: jo.Installation | None = None
        self.lock = threading.Lock()

    def install(self) -> jo.Installation:
        """Installs the overrides, scoped, and hooks the framework; idempotent."""
        with self.lock:
            if self.installation is None or not self.installation.installed:
                if self.installation is not None:  # removed through its handle: still hooked
                    self.installation = None
                    self._unhook()
                self.installation = jo.install(self._context, scoped=True, name=self._name)
                self._hook()
            return self.installation

    def uninstall(self) -> bool:
        """Removes what ``install()`` registered; True if it was installed."""
        with self.lock:
            installation, self.installation = self.installation, None
            if installation is not None:  # an unhook pairs with its hook (counted hooks)
                self._unhook()
        return installation is not None and installation.uninstall()

    def forget(self, installation: jo.Installation) -> None:
        """Unhooks the framework from ``installation``, removed through its handle."""
        with self.lock:
            if self.installation is installation:
                self.installation = None
                self._unhook()

    def is_installed(self) -> bool:
        """Whether ``install()`` is in effect."""
        installation = self.installation
        return installation is not None and installation.installed
