"""``interpose``: make an unmodified module's jax calls neutral by rebinding its globals."""

from __future__ import annotations

import sys
import threading
import types
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.lax

from jaxoverride import _api, _lax, _raw, lax as neutral_lax
from jaxoverride._names import JAX_IMPLS
from jaxoverride._words import counted, listed
from jaxoverride.errors import ImportOrderWarning


class _NeutralJax(types.ModuleType):
    """``jax`` as an interposed module sees it: neutral transforms, the rest is jax's."""

    lax: types.ModuleType

    def __getattr__(self, name: str) -> Any:
        return getattr(jax, name)

    def __dir__(self) -> list[str]:
        return dir(jax)


def _neutral_object(name: str) -> Any:
    return getattr(_lax, name[4:]) if name.startswith("lax.") else getattr(_api, name)


neutral_jax = _NeutralJax("jax", "jax, with jaxoverride's neutral transforms and lax.")
for _name in JAX_IMPLS:
    if not _name.startswith("lax."):
        setattr(neutral_jax, _name, _neutral_object(_name))
neutral_jax.lax = neutral_lax

# identity of a raw jax object -> (the object, its neutral replacement)
_REPLACEMENTS: dict[int, tuple[Any, Any]] = {
    id(jax): (jax, neutral_jax),
    id(jax.lax): (jax.lax, neutral_lax),
    **{id(impl): (impl, _neutral_object(name)) for name, impl in JAX_IMPLS.items()},
}
# identity of a neutral replacement -> the raw jax object it stands for
ORIGINALS: dict[int, Any] = {id(new): raw for raw, new in _REPLACEMENTS.values()}
_REFUSED_PREFIXES = ("jax", "jaxlib", "jaxoverride")


@dataclass
class _Binding:
    module: types.ModuleType
    attribute: str
    original: Any
    replacement: Any
    holders: int = 0


# Reentrant: a module imported while interpose_on_import holds it registers its bindings.
_lock = threading.RLock()
_bindings: dict[tuple[int, str], _Binding] = {}


@dataclass
class Interposition:
    """What ``interpose`` rebound; ``restore()`` (or leaving the ``with`` block) undoes it.

    Attributes:
      rebound: ``{module name: [attribute, ...]}`` that now refer to the neutral API.
      precompiled: ``module.attribute`` names holding transforms that the package built
        with raw JAX when it was imported (``jax.jit`` functions, ``eqx.filter_jit``
        wrappers, ``custom_vjp`` objects), as ``ImportOrderError`` lists them: they keep
        calling raw JAX until the package is imported under ``interpose_on_import``.

    Example:
      >>> import jaxoverride as jo
      >>> import optax._src.linear_algebra as linear_algebra
      >>> handle = jo.interpose(linear_algebra)
      >>> handle.rebound
      {'optax._src.linear_algebra': ['jax', 'lax']}
      >>> handle.restore()
      >>> linear_algebra.lax.while_loop is jo.lax.while_loop
      False
    """

    rebound: dict[str, list[str]] = field(default_factory=dict)
    precompiled: list[str] = field(default_factory=list)
    _held: list[_Binding] = field(default_factory=list, repr=False)

    def restore(self) -> None:
        """Rebinds the original jax objects, unless another interposition still holds them."""
        with _lock:
            release(self)

    def __enter__(self) -> Interposition:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.restore()


def release(handle: Interposition) -> None:
    held, handle._held = handle._held, []
    for binding in reversed(held):
        binding.holders -= 1
        if binding.holders:
            continue
        del _bindings[(id(binding.module), binding.attribute)]
        if binding.module.__dict__.get(binding.attribute) is binding.replacement:
            setattr(binding.module, binding.attribute, binding.original)


def is_refused(module_name: str) -> bool:
    return any(
        module_name == prefix or module_name.startswith((prefix + ".", prefix + "_"))
        for prefix in _REFUSED_PREFIXES
    )


def _submodules(module: types.ModuleType) -> Iterable[types.ModuleType]:
    prefix = module.__name__ + "."
    # dict.copy() runs no Python code; list(d.items()) may (a garbage collection can run
    # finalizers mid-way), letting another thread import and change the dict under it.
    for name, candidate in sys.modules.copy().items():
        if name.startswith(prefix) and isinstance(candidate, types.ModuleType):
            yield candidate


def warn_unreachable(found: list[str], where: str, stacklevel: int) -> None:
    """Warns that ``found`` raw import-time transforms stay out of reach."""
    if not found:
        return
    packages = sorted({name.partition(".")[0] for name in found})
    warnings.warn(
        ImportOrderWarning(
            f"{where}: {', '.join(map(repr, packages))} holds {counted(len(found), 'transform')} "
            f"built with raw JAX while it was imported ({listed(found)}); rebinding cannot reach "
            "them, so they keep calling raw JAX and adapters do not apply inside them. Fix: call "
            f"{_raw.fix_for([*packages, *_raw.builders(found)])}."
        ),
        stacklevel=stacklevel,
    )


def bind_module(
    target: types.ModuleType, handle: Interposition, adopt: frozenset[int] = frozenset()
) -> bool:
    """Rebinds ``target``'s references to jax for ``handle``; True if it has any.

    ``adopt`` holds the ids of neutral objects that ``target`` received in place of jax's
    own while it was imported (``interpose_on_import``): they are recorded as bindings, so
    that restoring puts jax's objects back. Call it with ``_lock`` held.
    """
    relevant = False
    for attribute, value in vars(target).copy().items():
        binding = _bindings.get((id(target), attribute))
        if binding is not None and value is binding.replacement:
            pass
        elif (entry := _REPLACEMENTS.get(id(value))) and entry[0] is value:
            binding = _Binding(target, attribute, value, entry[1])
            setattr(target, attribute, entry[1])
            _bindings[(id(target), attribute)] = binding
        elif id(value) in adopt and (original := ORIGINALS.get(id(value))) is not None:
            binding = _Binding(target, attribute, original, value)
            _bindings[(id(target), attribute)] = binding
        else:
            package = target.__name__.partition(".")[0]
            if _raw.holds_raw_transform(value) and _raw.defined_in(value, (package,)):
                handle.precompiled.append(f"{target.__name__}.{attribute}")
            continue
        relevant = True
        binding.holders += 1
        handle._held.append(binding)
        handle.rebound.setdefault(target.__name__, []).append(attribute)
    return relevant


def interpose(module: types.ModuleType, *, recursive: bool = False) -> Interposition:
    """Makes an unmodified module's calls to jax go through the neutral API.

    The module's globals that refer to ``jax``, ``jax.lax`` or an overridable JAX function
    (``import jax``, ``from jax.lax import scan``, ...) are rebound to their neutral
    counterparts, nothing else. Safe to leave in place (with nothing active the neutral
    API is JAX); idempotent, and nesting: each handle keeps its bindings until restored.

    Args:
      module: the module object whose functions call jax.
      recursive: also interpose every already-imported submodule of a package.

    Returns:
      An ``Interposition`` handle: use it as a context manager to restore the module on
      exit, or call ``restore()``. ``precompiled`` lists the transforms the package built
      with raw JAX at import time, which stay out of reach; an ``ImportOrderWarning``
      names them and the ``interpose_on_import`` call that reaches them.

    Raises:
      TypeError: ``module`` is not a module object.
      ValueError: the module is jax, jaxlib or jaxoverride itself, or refers to no jax
        object that could be interposed.

    Example:
      >>> import jaxoverride as jo
      >>> import optax._src.linesearch as linesearch
      >>> with jo.interpose(linesearch) as handle:
      ...     linesearch.jax.lax.while_loop is jo.lax.while_loop
      True
      >>> handle.rebound
      {'optax._src.linesearch': ['jax']}
      >>> linesearch.jax.lax.while_loop is jo.lax.while_loop
      False
    """
    if not isinstance(module, types.ModuleType):
        hint = (
            " Pass the module object: interpose(importlib.import_module(name))."
            if isinstance(module, str)
            else " It rebinds a module's globals, so it needs the module that defines the"
            " functions (see their __module__)."
        )
        raise TypeError(
            f"jaxoverride.interpose expects a module, got {type(module).__name__} {module!r}.{hint}"
        )
    if is_refused(module.__name__):
        raise ValueError(
            f"jaxoverride.interpose refuses {module.__name__!r}: jax, jaxlib and jaxoverride "
            "must keep calling JAX directly. Interpose the library that calls jax instead."
        )
    modules = [module]
    if recursive:
        modules += [m for m in _submodules(module) if not is_refused(m.__name__)]

    handle = Interposition()
    relevant = False
    with _lock:
        try:
            for target in modules:
                relevant = bind_module(target, handle) or relevant
        except BaseException:
            release(handle)
            raise
    if not relevant:
        where = "it or its submodules" if recursive else "it"
        raise ValueError(
            f"jaxoverride.interpose: {module.__name__!r} holds no module-level reference to "
            f"jax, jax.lax or an overridable jax function, so there is nothing to rebind in "
            f"{where}. Interpose the submodule that calls jax (see the functions' "
            "__module__), or pass recursive=True for a package."
        )
    warn_unreachable(handle.precompiled, "jaxoverride.interpose", stacklevel=3)
    return handle
