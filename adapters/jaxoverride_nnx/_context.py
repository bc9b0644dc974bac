"""``context()``, ``install()`` and ``uninstall()``: the NNX overrides as a layer."""

from __future__ import annotations

from typing import Any

import jaxoverride as jo
from jaxoverride import adapter_kit as kit
from jaxoverride_nnx import _control, _convert, _jit, _mapped, _rules, _transforms

# Every overridable name is NNX-aware; nothing passes through.
_TRANSFORMS = ("vmap", "grad", "value_and_grad", "jacfwd", "jacrev", "hessian", "checkpoint")
_TRANSFORMS += ("remat", "eval_shape", "jvp", "vjp", "linearize")
_CONTROL = ("lax.scan", "lax.while_loop", "lax.fori_loop", "lax.cond", "lax.switch")
TABLE = kit.OverrideTable(
    "jaxoverride_nnx",
    {
        "jit": _jit.jit,
        **kit.overrides_in(_mapped, "pmap", "shard_map"),
        **kit.overrides_in(_transforms, *_TRANSFORMS),
        **kit.overrides_in(_control, *_CONTROL),
        "lax.map": _control.lax_map,  # ``map`` would shadow the builtin there
        **kit.overrides_in(_rules, "custom_vjp", "custom_jvp"),
        **kit.overrides_in(
            _convert, "closure_convert", "lax.custom_root", "lax.custom_linear_solve"
        ),
        "make_jaxpr": _convert.make_jaxpr,
    },
)
_CONTEXT = TABLE.context()


def context() -> jo.OverrideContext:
    """The NNX overrides as an ``OverrideContext``, to enter or to compose.

    ``track`` enters it by itself, so most code never needs this. Use it to combine the
    NNX overrides with others in one layer, or to enter them without tracking anything
    (modules passed as arguments are then still threaded).

    Returns:
      The module's single ``OverrideContext`` (re-entering it reuses every cached build).

    Example:
      >>> import jaxoverride as jo, jaxoverride_nnx
      >>> sorted(jaxoverride_nnx.context())[:3]
      ['checkpoint', 'closure_convert', 'custom_jvp']
      >>> with jaxoverride_nnx.context():
      ...     jo.resolve("jit").__module__
      'jaxoverride_nnx._jit'
    """
    return _CONTEXT


# Scoped: ``track`` enters the installation's scope (``activation``); no framework hook.
_INSTALLER = kit.ScopedInstaller(
    _CONTEXT, "jaxoverride_nnx", hook=lambda: None, unhook=lambda: None
)


def install() -> jo.Installation:
    """Installs the NNX overrides for the whole process, active inside every ``track``.

    The installation is scoped (``jaxoverride.install(..., scoped=True)``): ``track``
    enters its scope instead of entering ``context()``, so the layer sits beneath every
    override context, and outside ``track`` scopes neutral functions cost what JAX's do.

    Returns:
      The ``jaxoverride.Installation``; installing twice returns the same one.

    Example:
      >>> import jax.numpy as jnp, jaxoverride as jo, jaxoverride_nnx
      >>> from flax import nnx
      >>> handle = jaxoverride_nnx.install()
      >>> counter = nnx.Variable(jnp.array(0))
      >>> def bump(_, __):
      ...     counter[...] += 1
      ...     return None, None
      >>> with jaxoverride_nnx.track(counter):
      ...     _ = jo.lax.scan(bump, None, length=3)
      >>> int(counter[...]), jaxoverride_nnx.uninstall()
      (3, True)
    """
    return _INSTALLER.install()


def activation() -> Any:
    """What ``track`` enters to make the NNX layer active: the installation's scope when
    installed, else ``context()``."""
    handle = _INSTALLER.installation
    return handle.scope() if handle is not None and handle.installed else _CONTEXT


def uninstall() -> bool:
    """Removes the installation made by ``install``; returns False if there was none.

    Returns:
      Whether an installation was removed.

    Example:
      >>> import jaxoverride_nnx
      >>> jaxoverride_nnx.uninstall()
      False
    """
    return _INSTALLER.uninstall()


def layer_active() -> bool:
    """Whether the NNX layer is already in effect here (entered or installed and active)."""
    for layer in jo.current_stack().layers:
        if layer.source != "installed (inactive)" and layer.overrides.get("jit") is _jit.jit:
            return True
    return False
