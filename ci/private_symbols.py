"""Checks every private upstream name the project uses against other releases' sources.

Usage::

    python ci/private_symbols.py --jax JAX_GIT [--haiku HAIKU_GIT] [--flax FLAX_GIT]
        [--jax-refs jax-v0.11.0,main] [--haiku-refs v0.0.16,main] [--flax-refs v0.12.7,main]

Each ``*_GIT`` is a clone (or bare git directory) of the upstream repository; each ref a tag,
branch or commit in it. The names are read from ``PRIVATE_SYMBOLS`` of every ``_compat``
module (``src/jaxoverride/_compat.py`` and ``adapters/*/_compat.py``). For each name and ref
the script reads the module's source at that ref with ``git show`` and looks for a top-level
definition or import of the name. It prints one line per ref with what is missing, and
fails if anything is. It does not compare signatures: read the diff of a name it flags.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_PACKAGES = {"jax": "jax", "haiku": "haiku", "flax": "flax"}


def listed() -> dict[str, str]:
    """Every ``PRIVATE_SYMBOLS`` entry of the project's ``_compat`` modules, read statically."""
    names: dict[str, str] = {}
    for path in [*ROOT.glob("src/jaxoverride/**/_compat.py"), *ROOT.glob("adapters/*/_compat.py")]:
        for node in ast.parse(path.read_text()).body:
            target = node.target if isinstance(node, ast.AnnAssign) else None
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target = node.targets[0]
            if isinstance(target, ast.Name) and target.id == "PRIVATE_SYMBOLS":
                assert isinstance(node.value, ast.Dict)
                for key in node.value.keys:
                    assert isinstance(key, ast.Constant)
                    names[str(key.value)] = str(path.relative_to(ROOT))
    return names


def _source(git_dir: Path, ref: str, module: str) -> str | None:
    base = module.replace(".", "/")
    for path in (f"{base}.py", f"{base}/__init__.py"):
        shown = subprocess.run(
            ["git", "-C", str(git_dir), "show", f"{ref}:{path}"],
            capture_output=True,
            text=True,
        )
        if shown.returncode == 0:
            return shown.stdout
    return None


def defines(source: str, name: str) -> bool:
    """Whether ``source`` defines or imports ``name`` at its top level (or in a ``try``)."""
    body = list(ast.parse(source).body)
    for node in body:
        if isinstance(node, ast.Try | ast.If):
            body.extend([*node.body, *getattr(node, "orelse", [])])
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name == name:
            return True
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
        if isinstance(node, ast.Import | ast.ImportFrom) and any(
            (alias.asname or alias.name.split(".")[-1]) == name for alias in node.names
        ):
            return True
    return False


def check(git_dir: Path, ref: str, names: list[str]) -> list[str]:
    """The names of ``names`` that the repository lacks at ``ref``."""
    missing = []
    for dotted in names:
        module, name = dotted.rsplit(".", 1)
        source = _source(git_dir, ref, module)
        if source is None or not defines(source, name):
            missing.append(dotted)
    return missing


def main(argv: list[str] | None = None) -> int:
    """The command line; returns 1 if a name is missing at some ref."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for package, refs in (("jax", "jax-v0.11.0"), ("haiku", "main"), ("flax", "main")):
        parser.add_argument(f"--{package}", type=Path, help=f"a git clone of {package}")
        parser.add_argument(f"--{package}-refs", default=refs, help="comma-separated refs")
    options = parser.parse_args(argv)
    names = listed()
    failed = False
    for package, prefix in _PACKAGES.items():
        git_dir = getattr(options, package)
        ours = sorted(name for name in names if name.split(".")[0] == prefix)
        if git_dir is None:
            if ours:
                print(f"{package}: not checked (no --{package}); {len(ours)} names")
            continue
        for ref in getattr(options, f"{package}_refs").split(","):
            missing = check(git_dir, ref, ours)
            failed |= bool(missing)
            verdict = "all present" if not missing else f"MISSING {missing}"
            print(f"{package} {ref}: {len(ours)} names, {verdict}")
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
