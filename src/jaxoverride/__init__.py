"""jaxoverride: one neutral API over JAX's transforms and control flow.

Library code calls ``jaxoverride.jit``, ``jaxoverride.lax.scan`` and the rest where it
would call ``jax.jit`` and ``jax.lax.scan``. With nothing active these are JAX's own
functions in results, jaxprs and speed. Adapters (``jaxoverride_haiku``,
``jaxoverride_nnx``, ``jaxoverride_plain``, ``jaxoverride_dag``) plug into the override
stack and make the same calls stateful, init-safe or identity-preserving.
"""

from typing import TYPE_CHECKING, Any

from jaxoverride import _detect, _stack, errors as errors, lax as lax
from jaxoverride._api import (
    checkpoint as checkpoint,
    closure_convert as closure_convert,
    custom_jvp as custom_jvp,
    custom_vjp as custom_vjp,
    eval_shape as eval_shape,
    grad as grad,
    hessian as hessian,
    jacfwd as jacfwd,
    jacrev as jacrev,
    jit as jit,
    jvp as jvp,
    linearize as linearize,
    make_jaxpr as make_jaxpr,
    pmap as pmap,
    remat as remat,
    shard_map as shard_map,
    value_and_grad as value_and_grad,
    vjp as vjp,
    vmap as vmap,
)
from jaxoverride._context import (
    Installation as Installation,
    OverrideContext as OverrideContext,
    install as install,
    override_context as override_context,
    uninstall as uninstall,
)
from jaxoverride._detect import set_adapter_check as set_adapter_check
from jaxoverride._dispatch import next_impl as next_impl, resolve as resolve
from jaxoverride._jitapi import jit_api as jit_api, reuse_jit as reuse_jit
from jaxoverride._names import OVERRIDEABLE as OVERRIDEABLE
from jaxoverride._neutral import NeutralRule as NeutralRule, Transformed as Transformed
from jaxoverride._own_frames import hide_own_frames as _hide_own_frames
from jaxoverride._solve_state import solve_state as solve_state, solver_map as solver_map
from jaxoverride.errors import ImportOrderError as ImportOrderError

if TYPE_CHECKING:  # loaded at first use (``__getattr__``), for ``import jaxoverride``'s time
    from jaxoverride import adapter_kit as adapter_kit
    from jaxoverride._import_hook import (
        ImportInterposition as ImportInterposition,
        interpose_on_import as interpose_on_import,
    )
    from jaxoverride._interpose import Interposition as Interposition, interpose as interpose
    from jaxoverride._introspect import Stack as Stack, current_stack as current_stack
    from jaxoverride._selfcheck import self_check as self_check

    __version__: str

_hide_own_frames()  # errors and equations name the user's line, as JAX's own would


def _load_first_call_check() -> None:
    # ``_first_call`` (and the interposition machinery it reads) is loaded by the first
    # context entry that has something to check, not by ``import jaxoverride``; its
    # import puts its own ``refresh`` in ``_stack.on_new_modules``. Here, at the top of
    # the core, so that the lower layers never import upward, lazily or not.
    if not _detect.watching():
        _stack._no_check()
        return
    from jaxoverride import _first_call

    _first_call.refresh()


if _stack.on_new_modules is _stack._not_set:  # not _first_call's own, if loaded
    _stack.on_new_modules = _load_first_call_check

# Public names whose modules are imported at their first use, not by ``import
# jaxoverride``: a program that never interposes, inspects the stack or runs the
# self-check does not pay for them. ``{name: module that defines it}``.
_LAZY = {
    "ImportInterposition": "jaxoverride._import_hook",
    "interpose_on_import": "jaxoverride._import_hook",
    "Interposition": "jaxoverride._interpose",
    "interpose": "jaxoverride._interpose",
    "Stack": "jaxoverride._introspect",
    "current_stack": "jaxoverride._introspect",
    "self_check": "jaxoverride._selfcheck",
}


def __getattr__(name: str) -> Any:
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name == "adapter_kit":
        value = importlib.import_module("jaxoverride.adapter_kit")
    elif name == "__version__":  # the one source of truth: pyproject.toml, installed
        from importlib.metadata import PackageNotFoundError, version

        try:
            value = version("jaxoverride")
        except PackageNotFoundError:  # run from a source tree that was never installed
            value = "0+unknown"
    else:
        raise AttributeError(f"module 'jaxoverride' has no attribute {name!r}")
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, "adapter_kit", "__version__"})


__all__ = [
    "OVERRIDEABLE",
    "ImportInterposition",
    "ImportOrderError",
    "Installation",
    "Interposition",
    "NeutralRule",
    "OverrideContext",
    "Stack",
    "Transformed",
    "checkpoint",
    "closure_convert",
    "current_stack",
    "custom_jvp",
    "custom_vjp",
    "errors",
    "eval_shape",
    "grad",
    "hessian",
    "install",
    "interpose",
    "interpose_on_import",
    "jacfwd",
    "jacrev",
    "jit",
    "jit_api",
    "jvp",
    "lax",
    "linearize",
    "make_jaxpr",
    "next_impl",
    "override_context",
    "pmap",
    "remat",
    "resolve",
    "reuse_jit",
    "self_check",
    "set_adapter_check",
    "shard_map",
    "solve_state",
    "solver_map",
    "uninstall",
    "value_and_grad",
    "vjp",
    "vmap",
]
