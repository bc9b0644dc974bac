"""``interpose_on_import``: packages whose modules are neutral from their first line on.

For the watched packages, ``builtins.__import__`` hands the importing module the neutral
``jax`` / ``jax.lax`` while its body runs, and a meta path finder wraps its loader to
record its references as bindings once the body has run, so restoring puts jax's own
back. A module loaded by another hook's finder (jaxtyping's) is recorded by
``_record_served`` instead: when a later import returns, and before ``rebound`` or
``restore()`` is read.
"""

from __future__ import annotations

import builtins
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax

from jaxoverride import _interpose, lax as neutral_lax
from jaxoverride._interpose import ORIGINALS, Interposition, bind_module, neutral_jax
from jaxoverride._raw import (
    builders,
    fix_for,
    unreachable_transforms as unreachable_transforms,
    within,
)
from jaxoverride._words import listed
from jaxoverride.errors import ImportOrderError

# The ``__import__`` that ours chains to: whatever was current when ours was installed (a
# profiler's or a lazy importer's hook, say), so that it keeps running and is put back.
_below_import: Any = builtins.__import__
_in_chain = False  # ours is builtins.__import__, or a hook installed over it calls it
_watched: Counter[str] = Counter()  # package name -> handles that watch it
# What the import hook reads on every import: rebuilt under the lock, read without it.
_prefixes: tuple[tuple[str, str], ...] = ()
_served: set[str] = set()  # modules that were handed a neutral object while importing
# Served modules that no loader of ours recorded yet (loaded by another finder's loader,
# or still running their body): recorded by ``_record_served``.
_unrecorded: set[str] = set()
_handles: list[ImportInterposition] = []


def _package_of(module_name: str) -> str | None:
    for package, dotted in _prefixes:
        if module_name == package or module_name.startswith(dotted):
            return package
    return None


def _set_watched(packages: Iterable[str], delta: int) -> None:
    global _prefixes
    for package in packages:
        _watched[package] += delta
        if _watched[package] <= 0:
            del _watched[package]
    _prefixes = tuple((package, package + ".") for package in _watched)


def _neutral_import(
    name: str,
    globals: dict[str, Any] | None = None,
    locals: Any = None,
    fromlist: Sequence[str] | None = (),
    level: int = 0,
) -> Any:
    imported = _below_import(name, globals, locals, fromlist, level)
    if _unrecorded:
        _record_served()
    if level or not (name == "jax" or name.startswith("jax.")) or not globals:
        return imported
    importer = globals.get("__name__")
    if not isinstance(importer, str) or _package_of(importer) is None:
        return imported
    # `import jax`, `import jax.lax [as x]`, `from jax import jit`: all start from jax.
    if imported is jax:
        replacement: Any = neutral_jax
    elif imported is jax.lax:  # `from jax.lax import scan`
        replacement = neutral_lax
    else:
        return imported
    if importer not in _served:
        _served.add(importer)
        _unrecorded.add(importer)
    return replacement


def _record(module: types.ModuleType) -> None:
    """Records ``module``'s references as bindings of each handle watching it (under the
    interposition lock): its neutral ones stand for jax's own if it was served them."""
    _unrecorded.discard(module.__name__)
    for handle in _handles:
        if handle._watches(module.__name__):
            adopt = frozenset(ORIGINALS) if module.__name__ in _served else frozenset()
            known = len(handle._interposition.precompiled)
            bind_module(module, handle._interposition, adopt)
            # A package not watched (equinox, for optimistix) built these.
            _interpose.warn_unreachable(
                handle._interposition.precompiled[known:],
                "jaxoverride.interpose_on_import",
                stacklevel=3,
            )


def _record_served() -> None:
    """Records each served module whose body has run and that no loader of ours recorded
    (another finder loaded it); forgets one whose import failed."""
    with _interpose._lock:
        for name in list(_unrecorded):
            module = sys.modules.get(name)
            if not isinstance(module, types.ModuleType):
                _unrecorded.discard(name)
                continue
            spec = getattr(module, "__spec__", None)
            if spec is not None and getattr(spec, "_initializing", False):
                continue  # its body is still running
            _record(module)


class _RecordingLoader(importlib.abc.Loader):
    """Runs the real loader, then records the module's references to jax as bindings."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        with _interpose._lock:
            _record(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if _package_of(fullname) is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _RecordingLoader(spec.loader)
        return spec


_finder = _Finder()


def _hooks_on(on: bool) -> None:
    global _below_import, _in_chain
    if on:
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
        if not _in_chain:  # else a hook installed over ours still calls it: reuse that
            _below_import = builtins.__import__
            builtins.__import__ = _neutral_import
            _in_chain = True
        return
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    # Leave a hook that someone installed on top of ours alone; ours passes through.
    if builtins.__import__ is _neutral_import:
        builtins.__import__ = _below_import
        _in_chain = False


@dataclass
class ImportInterposition:
    r"""What ``interpose_on_import`` watches; ``restore()`` (or the ``with`` block) undoes it.

    Attributes:
      packages: the package names whose modules are interposed as they are imported.
      rebound: ``{module name: [attribute, ...]}`` now referring to the neutral API; it
        grows as more modules of the packages are imported.

    Example:
      >>> import pathlib, sys, tempfile
      >>> import jaxoverride as jo
      >>> folder = tempfile.mkdtemp()
      >>> _ = pathlib.Path(folder, "solver_lib.py").write_text(
      ...     "import jax\nstep = jax.jit(lambda x: x + 1)\n"
      ... )
      >>> sys.path.insert(0, folder)
      >>> with jo.interpose_on_import("solver_lib") as handle:
      ...     import solver_lib  # its module-level jax.jit is jaxoverride.jit
      >>> handle.packages, handle.rebound
      (('solver_lib',), {'solver_lib': ['jax']})
      >>> type(solver_lib.step).__name__
      'Transformed'
      >>> _ = sys.path.remove(folder)
    """

    packages: tuple[str, ...]
    _interposition: Interposition = field(default_factory=Interposition, repr=False)
    _active: bool = field(default=True, repr=False)

    @property
    def rebound(self) -> dict[str, list[str]]:
        if _unrecorded:
            _record_served()
        return self._interposition.rebound

    @property
    def precompiled(self) -> list[str]:
        """Transforms that modules of the packages hold, built with raw JAX while they were
        imported (by a package not watched, such as ``equinox`` for ``optimistix``)."""
        return self._interposition.precompiled

    def _watches(self, module_name: str) -> bool:
        return self._active and within(module_name, self.packages)

    def restore(self) -> None:
        """Stops watching the packages and rebinds jax's own objects in their modules.

        Transforms built while watched stay neutral (with nothing active they are JAX).
        Restoring twice does nothing.
        """
        if _unrecorded:
            _record_served()
        with _interpose._lock:
            if not self._active:
                return
            self._active = False
            _handles.remove(self)
            _set_watched(self.packages, -1)
            if not _watched:
                _hooks_on(False)
                _served.clear()
                _unrecorded.clear()
            _interpose.release(self._interposition)

    def __enter__(self) -> ImportInterposition:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.restore()


def _check_name(name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(
            f"jaxoverride.interpose_on_import expects package names as strings, got "
            f"{type(name).__name__} {name!r}. Pass the name: interpose_on_import('optimistix')."
        )
    if not name or name.startswith(".") or not all(part.isidentifier() for part in name.split(".")):
        raise ValueError(
            f"jaxoverride.interpose_on_import: {name!r} is not an absolute module name. "
            "Pass a package's import name, such as 'optimistix' or 'equinox'."
        )
    if _interpose.is_refused(name):
        raise ValueError(
            f"jaxoverride.interpose_on_import refuses {name!r}: jax, jaxlib and jaxoverride "
            "must keep calling JAX directly. Name the library that calls jax instead."
        )
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise ModuleNotFoundError(
            f"jaxoverride.interpose_on_import: no package named {name!r} can be imported "
            "here. Check the spelling (the import name, not the distribution name: 'haiku', "
            "not 'dm-haiku') and that it is installed in this environment.",
            name=name,
        )
    return name


def _by_package(found: list[str], packages: Sequence[str]) -> str:
    groups = []
    for package in packages:
        mine = [f for f in found if f.startswith(package + ".")]
        if mine:
            groups.append(f"{package!r} {len(mine)} ({listed(mine)})")
    return "; ".join(groups)


def interpose_on_import(*packages: str) -> ImportInterposition:
    """Interposes every module of ``packages`` as it is imported, from its first line on.

    Unlike ``interpose``, this reaches transforms a module builds while it is imported
    (``eqx.filter_jit`` calls ``jax.jit`` as optimistix is imported); modules already
    imported are interposed at once. Safe to leave in place, idempotent, nesting and
    thread-safe. Call it before the packages are imported, naming those that build the
    transforms too: ``"equinox"`` as well as ``"optimistix"``, ``"lineax"``, ``"diffrax"``.

    Args:
      *packages: import names of packages (or single modules), such as ``"optimistix"``.

    Returns:
      An ``ImportInterposition`` handle: a context manager, or call ``restore()``.

    Raises:
      TypeError: a name is not a string.
      ValueError: a name is not an absolute import name, or names jax, jaxlib or
        jaxoverride.
      ModuleNotFoundError: no package of that name can be imported.
      ImportOrderError: a named package is already imported and holds transforms it built
        with raw JAX at import time, which no rebinding can reach. Nothing is changed.

    Example:
      >>> import jaxoverride as jo
      >>> try:  # the top of a program, before the first ``import optimistix``
      ...     handle = jo.interpose_on_import("equinox", "optimistix")
      ... except jo.ImportOrderError:  # imported earlier: rebind what can still be reached
      ...     import optimistix
      ...     handle = jo.interpose(optimistix, recursive=True)
      >>> import optimistix as optx  # its eqx.filter_jit wrappers hold jo.jit (first branch)
      >>> handle.restore()
    """
    names = tuple(dict.fromkeys(_check_name(name) for name in packages))
    if not names:
        raise TypeError(
            "jaxoverride.interpose_on_import needs at least one package name, such as "
            "interpose_on_import('equinox', 'optimistix')."
        )
    with _interpose._lock:
        unwatched = [p for p in names if p not in _watched]
        unreachable = unreachable_transforms(unwatched)
        if unreachable:
            raise ImportOrderError(
                "jaxoverride.interpose_on_import: these packages were already imported and "
                "built transforms with raw JAX while importing: "
                f"{_by_package(unreachable, names)}. "
                "Rebinding their globals cannot reach those, so they would keep calling raw "
                f"JAX. Fix: call {fix_for([*names, *builders(unreachable)])} (for example at "
                "the top of your program). Nothing was changed."
            )
        handle = ImportInterposition(names)
        try:
            _handles.append(handle)
            _set_watched(names, +1)
            _hooks_on(True)
            for name, module in sys.modules.copy().items():
                if isinstance(module, types.ModuleType) and handle._watches(name):
                    bind_module(module, handle._interposition)
        except BaseException:
            handle.restore()
            raise
    return handle
