"""Lists import cycles and upward imports among the project's own modules.

Usage: ``python ci/import_cycles.py [ROOT]`` (default: this checkout).

Every import counts, wherever it is written: at module level, inside a function (a lazy
import runs too, later), and ``importlib.import_module("a.literal.name")``. Only imports
under ``if TYPE_CHECKING:`` are left out: they never run. ``from package import name``
is an edge to ``package.name`` where that is a module, else to ``package``.

Two checks, each printed, then the counts; exits 1 if either finds anything:

- **cycles**: a circle of imports (a package importing its own submodules is not one);
- **upward imports**: the project is layered (``LAYERS``, lowest first): the core's own
  layers, then the adapter kit, then the adapters. A module may import its own layer or a
  lower one, never a higher one, lazily or not; a package may still load its own
  submodules (``jaxoverride.__getattr__`` loads ``jaxoverride.adapter_kit`` at first use).
  Every core module must be given a layer: a new one fails until it is placed.
"""

from __future__ import annotations

import ast
import fnmatch
import pathlib
import sys

# Lowest first. A module's layer is that of the first pattern it matches.
LAYERS: tuple[tuple[str, ...], ...] = (
    # leaf helpers that import nothing of the project
    ("jaxoverride._tree_diff", "jaxoverride._words"),
    # what everything stands on: errors, JAX's private names, the override names
    ("jaxoverride.errors", "jaxoverride._compat", "jaxoverride._names", "jaxoverride._signatures"),
    ("jaxoverride._own_frames",),
    # the stack and the framework registry: state every upper module reads
    ("jaxoverride._stack", "jaxoverride._frameworks", "jaxoverride._solve_state"),
    ("jaxoverride._context", "jaxoverride._dispatch", "jaxoverride._introspect"),
    ("jaxoverride._raw", "jaxoverride._user_frames", "jaxoverride._detect"),
    ("jaxoverride._jitapi",),
    ("jaxoverride._neutral",),
    ("jaxoverride._lax", "jaxoverride._api"),
    ("jaxoverride.lax",),
    ("jaxoverride._interpose",),
    ("jaxoverride._first_call", "jaxoverride._import_hook"),
    ("jaxoverride._selfcheck",),
    ("jaxoverride", "jaxoverride.__main__"),
    # the kit, on the public core
    ("jaxoverride.adapter_kit", "jaxoverride.adapter_kit.*"),
    # the adapters, on the kit
    ("jaxoverride_*",),
)


def _modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    paths: dict[str, pathlib.Path] = {}
    for base in (root / "src", root / "adapters"):
        for path in base.rglob("*.py"):
            name = ".".join(path.relative_to(base).with_suffix("").parts)
            paths[name.removesuffix(".__init__")] = path
    return paths


def _package(name: str, path: pathlib.Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _skipped(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.AST, package: str, known: dict[str, pathlib.Path]) -> set[str]:
    """The project's modules that ``tree`` imports anywhere but under TYPE_CHECKING."""
    found: set[str] = set()
    pending = [tree]
    while pending:
        node = pending.pop()
        if _skipped(node):
            pending += getattr(node, "orelse", [])
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                # ``import a.b.c`` runs a, a.b and a.b.c.
                parts = alias.name.split(".")
                found.update(".".join(parts[: i + 1]) for i in range(len(parts)))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in known else base)
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func).endswith("import_module")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value)
        pending += ast.iter_child_nodes(node)
    return found


def module_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """``{module: the project's modules it imports}``, every import counted (see above)."""
    paths = _modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        imported = _imports(ast.parse(path.read_text()), _package(name, path), paths)
        graph[name] = {other for other in imported if other in paths and other != name}
    return graph


def _inside(parent: str, child: str) -> bool:
    return child.startswith(parent + ".")


def cycles(graph: dict[str, set[str]], longest: int = 12) -> set[tuple[str, ...]]:
    """Every elementary circle of at most ``longest`` modules, each turned to start at its
    least name; circles through a package loading its own submodule are left out."""
    found: set[tuple[str, ...]] = set()

    def walk(start: str, path: list[str], on_path: set[str]) -> None:
        for other in graph.get(path[-1], ()):
            if other == start and len(path) > 1:
                pairs = zip(path, path[1:] + path[:1], strict=True)
                if not any(_inside(parent, child) for parent, child in pairs):
                    turn = min(range(len(path)), key=path.__getitem__)
                    found.add(tuple(path[turn:] + path[:turn]))
            elif other > start and other not in on_path and len(path) < longest:
                walk(start, [*path, other], on_path | {other})

    for module in sorted(graph):
        walk(module, [module], {module})
    return found


def layer_of(module: str) -> int | None:
    """The index in ``LAYERS`` of ``module``'s layer; None for a module outside them."""
    for level, patterns in enumerate(LAYERS):
        if any(fnmatch.fnmatchcase(module, pattern) for pattern in patterns):
            return level
    return None


def upward(graph: dict[str, set[str]]) -> list[str]:
    """The edges to a higher layer, and the core modules given no layer, as lines."""
    problems = []
    for module in sorted(graph):
        level = layer_of(module)
        if level is None:
            problems.append(f"{module} has no layer: add it to LAYERS in ci/import_cycles.py")
            continue
        for other in sorted(graph[module]):
            above = layer_of(other)
            if above is not None and above > level and not _inside(module, other):
                problems.append(f"{module} (layer {level}) imports {other} (layer {above})")
    return problems


def main() -> int:
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parent.parent)
    graph = module_graph(root.resolve())
    found = sorted(cycles(graph))
    for cycle in found:
        print(" -> ".join((*cycle, cycle[0])))
    problems = upward(graph)
    for problem in problems:
        print(problem)
    print(f"{len(found)} import cycles, {len(problems)} upward imports")
    return 1 if found or problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
