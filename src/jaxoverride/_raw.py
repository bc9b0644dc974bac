"""Finding the transforms a package built with raw JAX while it was imported.

``jax.jit`` objects, ``eqx.filter_jit`` wrappers (which hold one) and ``jax.custom_vjp`` /
``custom_jvp`` objects made by a module's body keep calling raw JAX whatever is rebound
later: ``ImportOrderError``, ``Interposition.precompiled``, the warnings of ``interpose``
and ``interpose_on_import`` and ``python -m jaxoverride`` all list them with this one test.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterable, Sequence
from typing import Any

import jax

from jaxoverride import _frameworks, _stack
from jaxoverride._compat import JIT_WRAPPER_TYPE

# The libraries the self-check and the debug trace look at when asked for no package.
SOLVER_LIBRARIES = ("equinox", "optimistix", "lineax", "diffrax", "jaxopt", "optax")

# The one list of solver packages that every message tells a program to interpose together:
# they import one another and ``eqx.filter_jit`` builds their import-time transforms, so
# interposing one of them without the others leaves transforms raw. ``fix_for`` names
# those of them that are imported whenever it names one.
INTERPOSED_TOGETHER = ("equinox", "lineax", "optimistix", "diffrax")


class RawGuard:
    """A raw import-time transform of a solver library, rebound where the library holds it
    so that its calls can be checked while an adapter is active (see ``_first_call``).

    While the process is idle a call costs one Python frame more than the raw object's;
    everything else (attributes, ``__wrapped__``, the signature) is the raw object's.
    """

    check: Any = None  # set by ``_first_call``: check(guard, args, kwargs)

    def __init__(self, raw: Any, where: str):
        self.__wrapped__ = raw
        self.where = where  # ``module.attribute`` that messages name
        for attribute in ("__module__", "__name__", "__qualname__", "__doc__"):
            value = getattr(raw, attribute, None)
            if isinstance(value, str):
                setattr(self, attribute, value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _stack.idle or RawGuard.check is None:
            return self.__wrapped__(*args, **kwargs)
        return RawGuard.check(self, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        if name == "__wrapped__":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.__wrapped__, name)

    def __repr__(self) -> str:
        return repr(self.__wrapped__)


def unguarded(value: Any) -> Any:
    """The raw transform behind a ``RawGuard``; any other value as it is."""
    return value.__wrapped__ if type(value) is RawGuard else value


def _is_raw(value: Any) -> bool:
    """Whether ``value`` is itself a ``jax.jit``, ``custom_vjp`` or ``custom_jvp`` object."""
    return type(value) is JIT_WRAPPER_TYPE or isinstance(value, (jax.custom_vjp, jax.custom_jvp))


def holds_raw_transform(value: Any) -> bool:
    """Whether ``value`` is, or directly holds, a transform built with raw JAX."""
    return _is_raw(unguarded(value)) or bool(held_jits(value))


def held_jits(value: Any) -> list[str]:
    """The attributes of ``value``'s instance dict that hold a raw ``jax.jit`` object (the
    compiled core of an ``eqx.filter_jit`` wrapper), guarded or not; none for a raw
    ``jax.jit`` itself, a type or a module."""
    value, jit_type = unguarded(value), JIT_WRAPPER_TYPE
    state = getattr(value, "__dict__", None)
    if type(value) is jit_type or isinstance(value, (type, types.ModuleType)):
        return []
    if not isinstance(state, dict):
        return []
    return [name for name, inner in state.copy().items() if type(unguarded(inner)) is jit_type]


def within(module_name: str, packages: Iterable[str]) -> bool:
    return any(module_name == p or module_name.startswith(p + ".") for p in packages)


def defined_in(value: Any, packages: Iterable[str]) -> bool:
    """Whether ``value`` (or what it wraps) was defined in one of ``packages``."""
    value = unguarded(value)
    module = getattr(getattr(value, "__wrapped__", value), "__module__", None)
    return isinstance(module, str) and within(module, packages)


def builder(value: Any) -> str | None:
    """The top-level package whose code built the raw transform ``value`` holds, when that
    is not the package that defined the function (``eqx.filter_jit`` builds optimistix's)."""
    value = unguarded(value)
    if _is_raw(value):
        return None
    module = type(value).__module__
    return module.partition(".")[0] if isinstance(module, str) else None


def module_transforms(module: types.ModuleType, packages: Sequence[str]) -> list[str]:
    """``module.attribute`` of each raw import-time transform of ``module`` defined in
    ``packages``."""
    return [
        f"{module.__name__}.{attribute}"
        for attribute, value in vars(module).copy().items()
        if holds_raw_transform(value) and defined_in(value, packages)
    ]


def unreachable_transforms(packages: Sequence[str]) -> list[str]:
    """``module.attribute`` of every transform the already-imported ``packages`` built with
    raw JAX at import time, which rebinding globals cannot reach."""
    found = []
    # Copies, not iteration, of dicts another thread may change (see _interpose._submodules).
    for name, module in sys.modules.copy().items():
        if isinstance(module, types.ModuleType) and within(name, packages):
            found += module_transforms(module, packages)
    return sorted(set(found))


def builders(found: Iterable[str]) -> list[str]:
    """The packages whose code built the transforms named in ``found``."""
    names = set()
    for dotted in found:
        module_name, _, attribute = dotted.rpartition(".")
        module = sys.modules.get(module_name)
        name = builder(getattr(module, attribute, None)) if module is not None else None
        if name is not None:
            names.add(name)
    return sorted(names)


def held_by_imported(packages: Sequence[str] = SOLVER_LIBRARIES) -> dict[str, list[str]]:
    """``{package: [module.attribute, ...]}`` for each imported package of ``packages``
    that holds raw import-time transforms."""
    held = {p: unreachable_transforms([p]) for p in packages if p in sys.modules}
    return {package: found for package, found in held.items() if found}


# Packages whose own import-time transforms are never a solver library's: JAX's jitted
# functions, jaxoverride itself and the program; the registered frameworks' packages too
# (``framework_packages``).
_NOT_LIBRARIES = frozenset({"__main__", "jax", "jaxlib", "jaxoverride"})


def framework_packages() -> set[str]:
    """The top-level packages of the registered frameworks' watched modules."""
    _frameworks.refresh()  # the records of the imported frameworks, loaded
    return {record.module.partition(".")[0] for record in _frameworks.registered.values()}


def held_by_other_imported() -> dict[str, list[str]]:
    """``{package: [module.attribute, ...]}`` for each imported package outside
    ``SOLVER_LIBRARIES`` (and outside JAX, the frameworks, jaxoverride and the standard
    library) that holds raw import-time transforms: a library of the program's own.

    It reads every imported module once, so only an error path calls it.
    """
    held: dict[str, list[str]] = {}
    frameworks = framework_packages()
    for name, module in sys.modules.copy().items():
        package = name.partition(".")[0]
        if (
            not isinstance(module, types.ModuleType)
            or package in SOLVER_LIBRARIES
            or package in _NOT_LIBRARIES
            or package in frameworks
            or package.startswith(("jaxoverride_", "_"))
            or package in sys.stdlib_module_names
        ):
            continue
        found = module_transforms(module, [package])
        if found:
            held.setdefault(package, []).extend(found)
    return {package: sorted(set(found)) for package, found in sorted(held.items())}


def fix_for(packages: Iterable[str]) -> str:
    """The call that makes ``packages`` (and the packages that build their transforms)
    neutral from their first import: with one of ``INTERPOSED_TOGETHER`` it names every
    one of them that is imported, so that each message gives the same list."""
    chosen = set(packages)
    if chosen & set(INTERPOSED_TOGETHER):
        chosen |= {p for p in INTERPOSED_TOGETHER if p in sys.modules}
    names = ", ".join(repr(p) for p in sorted(chosen))
    return f"jaxoverride.interpose_on_import({names}) before their first import"
