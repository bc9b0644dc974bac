"""Every private JAX, Haiku or Flax name the project uses is listed, exists, and has no
public name.

The source of ``src/`` and ``adapters/`` is read (not imported) for imports from private
modules (``jax._src``, ``haiku._src``, Flax NNX's internal ``graphlib``, ``variablelib``,
``pytreelib`` and ``tracers``) and for attributes read off such a module. Each must be in
``PRIVATE_SYMBOLS`` of a ``_compat`` module of the same package, with its reason; see
"Private symbols and supported versions" in ``docs/design.md``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import pathlib
import types

import pytest

# The tables name each symbol as the newest supported releases spell it, and that is what
# ci/private_symbols.py audits upstream. Flax 0.12.1 (the oldest set, `make test-oldest`)
# names its graph module ``flax.nnx.graph``, not ``graphlib``: ``jaxoverride_nnx._compat``
# imports either, so there the names resolve to another module and cannot be compared.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("flax.nnx.graphlib") is None,
    reason=f"Flax {importlib.metadata.version('flax')} predates flax.nnx.graphlib (0.12.1, the "
    "oldest supported, names it flax.nnx.graph), the module the audited names live in",
)

ROOT = pathlib.Path(__file__).resolve().parent.parent
INTERNAL_FLAX = (
    "flax.nnx.graph",
    "flax.nnx.graphlib",
    "flax.nnx.variablelib",
    "flax.nnx.pytreelib",
    "flax.nnx.tracers",
)
PUBLIC_MODULES = (
    "jax",
    "jax.lax",
    "jax.core",
    "jax.custom_derivatives",
    "jax.extend.core",
    "jax.tree_util",
    "haiku",
    "haiku.experimental",
    "flax.nnx",
)


def _is_private(module: str) -> bool:
    return "._src" in module or module.startswith(INTERNAL_FLAX)


def _packages() -> dict[str, pathlib.Path]:
    folders = [ROOT / "src" / "jaxoverride", *sorted((ROOT / "adapters").glob("jaxoverride_*"))]
    return {folder.name: folder for folder in folders if (folder / "__init__.py").exists()}


def _uses(path: pathlib.Path) -> set[str]:
    """The dotted private names that one file imports or reads off a private module."""
    tree = ast.parse(path.read_text())
    aliases: dict[str, str] = {}
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                try:
                    value = getattr(importlib.import_module(node.module), alias.name)
                except (ImportError, AttributeError):
                    value = None
                if isinstance(value, types.ModuleType):
                    if _is_private(value.__name__):  # the first binding: a try's body
                        aliases.setdefault(alias.asname or alias.name, value.__name__)
                elif _is_private(node.module):
                    used.add(f"{node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _is_private(alias.name) and alias.asname:
                    aliases.setdefault(alias.asname, alias.name)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
        ):
            used.add(f"{aliases[node.value.id]}.{node.attr}")
        elif (  # getattr(module, "name", default): a name some releases lack
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and len(node.args) >= 2
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id in aliases
            and isinstance(node.args[1], ast.Constant)
        ):
            used.add(f"{aliases[node.args[0].id]}.{node.args[1].value}")
    return used


def _listed(package: str, folder: pathlib.Path) -> dict[str, str]:
    listed: dict[str, str] = {}
    for path in folder.rglob("_compat.py"):
        relative = path.relative_to(folder).with_suffix("").parts
        module = importlib.import_module(".".join((package, *relative)))
        listed.update(getattr(module, "PRIVATE_SYMBOLS", {}))
    return listed


def _resolve(dotted: str) -> object:
    module, name = dotted.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


PACKAGES = _packages()


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_every_private_name_used_is_listed_with_a_reason(package):
    folder = PACKAGES[package]
    used: dict[str, list[str]] = {}
    for path in sorted(folder.rglob("*.py")):
        for name in _uses(path):
            used.setdefault(name, []).append(str(path.relative_to(ROOT)))
    listed = _listed(package, folder)
    missing = {name: files for name, files in used.items() if name not in listed}
    assert not missing, f"private names used but not in a _compat.PRIVATE_SYMBOLS: {missing}"
    assert all(reason.strip() for reason in listed.values())
    stale = sorted(set(listed) - set(used))
    assert not stale, f"listed in {package}'s _compat but no longer used: {stale}"


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_every_listed_name_exists_and_has_no_public_name(package):
    public = {}
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for attribute in dir(module):
            if not attribute.startswith("_"):
                value = getattr(module, attribute, None)
                public.setdefault(id(value), f"{module_name}.{attribute}")
    for dotted in _listed(package, PACKAGES[package]):
        value = _resolve(dotted)  # raises if this release lacks it
        if isinstance(value, (type, types.FunctionType)):
            assert id(value) not in public, f"{dotted} is public as {public[id(value)]}: use that"


def test_the_scan_sees_the_known_kinds_of_use(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text(
        "from haiku._src import base\n"
        "from jax._src.api_util import fun_signature\n"
        "from jaxoverride_nnx._compat import graphlib\n"
        "import jax.custom_derivatives\n"
        "base.frame_stack, graphlib.get_node_impl, getattr(graphlib, 'DataElem', None)\n"
    )
    assert _uses(source) == {
        "haiku._src.base.frame_stack",
        "jax._src.api_util.fun_signature",
        "flax.nnx.graphlib.get_node_impl",
        "flax.nnx.graphlib.DataElem",
    }
