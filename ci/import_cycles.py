"""Lists module-level import cycles among the project's own modules.

Usage: ``python ci/import_cycles.py [ROOT]`` (default: this checkout). Imports inside
functions and under ``TYPE_CHECKING`` are not counted: they do not run at import time. A
package importing its own submodules is not a cycle. Prints each cycle, then the count;
exits 1 if there is any.
"""

from __future__ import annotations

import ast
import pathlib
import sys


def _module_graph(root: pathlib.Path) -> dict[str, set[str]]:
    paths: dict[str, pathlib.Path] = {}
    for base in (root / "src", root / "adapters"):
        for path in base.rglob("*.py"):
            name = ".".join(path.relative_to(base).with_suffix("").parts)
            paths[name.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        imported: set[str] = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                continue
            for sub in ast.walk(node):
                if isinstance(sub, ast.Import):
                    imported.update(alias.name for alias in sub.names)
                elif isinstance(sub, ast.ImportFrom) and sub.module and sub.level == 0:
                    imported.add(sub.module)
                    imported.update(f"{sub.module}.{alias.name}" for alias in sub.names)
        graph[name] = {other for other in imported if other in paths and other != name}
    return graph


def _cycles(graph: dict[str, set[str]], longest: int = 6) -> set[tuple[str, ...]]:
    found: set[tuple[str, ...]] = set()

    def walk(start: str, path: list[str]) -> None:
        for other in graph.get(path[-1], ()):
            if other == start and len(path) > 1:
                pairs = zip(path, path[1:] + path[:1], strict=True)
                if not any(child.startswith(parent + ".") for parent, child in pairs):
                    turn = min(range(len(path)), key=path.__getitem__)
                    found.add(tuple(path[turn:] + path[:turn]))
            elif other not in path and len(path) < longest:
                walk(start, [*path, other])

    for module in graph:
        walk(module, [module])
    return found


def main() -> int:
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parent.parent)
    cycles = sorted(_cycles(_module_graph(root.resolve())))
    for cycle in cycles:
        print(" -> ".join((*cycle, cycle[0])))
    print(f"{len(cycles)} import cycles")
    return 1 if cycles else 0


if __name__ == "__main__":
    raise SystemExit(main())
