"""Checks every private upstream name the project uses against other releases' sources.

Usage::

    python ci/private_symbols.py --jax JAX_GIT [--haiku HAIKU_GIT] [--flax FLAX_GIT]
        [--jax-refs jax-v0.11.0,main] [--haiku-refs v0.0.16,main] [--flax-refs v0.12.7,main]
        [--site .venv-newest/lib/python3.12/site-packages] [--since]

Each ``*_GIT`` is a clone (or bare git directory) of the upstream repository; each ref a tag,
branch or commit in it. ``--site`` (repeatable) is a folder of installed packages: the
releases installed there (their wheels' sources, for releases newer than a clone's tags)
are read too, named by their installed version. The names are read from
``PRIVATE_SYMBOLS`` of every ``_compat`` module (``src/jaxoverride/_compat.py`` and
``adapters/*/_compat.py``). For each name and ref the script reads the module's source at
that ref with ``git show`` (or from the folder) and looks for a top-level definition or
import of the name. It prints one line per ref with what is missing, and fails if anything
is. ``--since`` also prints, per name, the first release tag of the clone that has it (the
version that introduced it at that module path; a name that moved is new at its new path)
and any later tag that lacks it. It does not compare signatures: read the diff of a name it
flags.
"""

from __future__ import annotations

import argparse
import ast
import functools
import re
import subprocess
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_PACKAGES = {"jax": "jax", "haiku": "haiku", "flax": "flax"}
_DISTRIBUTIONS = {"jax": "jax", "haiku": "dm-haiku", "flax": "flax"}
_TAG = {
    "jax": re.compile(r"\Ajax-v(\d+(?:\.\d+)*)\Z"),
    "haiku": re.compile(r"\Av(\d+(?:\.\d+)*)\Z"),
}
_TAG["flax"] = _TAG["haiku"]

Source = Callable[[str], "str | None"]
"""A release's source of one module, by dotted name (``None`` where it has no such module)."""


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


def _paths(module: str) -> tuple[str, str]:
    base = module.replace(".", "/")
    return f"{base}.py", f"{base}/__init__.py"


@functools.cache
def _source(git_dir: Path, ref: str, module: str) -> str | None:
    for path in _paths(module):
        shown = subprocess.run(
            ["git", "-C", str(git_dir), "show", f"{ref}:{path}"],
            capture_output=True,
            text=True,
        )
        if shown.returncode == 0:
            return shown.stdout
    return None


def git_source(git_dir: Path, ref: str) -> Source:
    """The sources of ``ref`` in the clone ``git_dir``."""
    return functools.partial(_source, git_dir, ref)


def site_source(site: Path) -> Source:
    """The sources of the packages installed in ``site`` (a ``site-packages`` folder)."""

    def read(module: str) -> str | None:
        for path in _paths(module):
            if (site / path).is_file():
                return (site / path).read_text()
        return None

    return read


def installed_version(site: Path, package: str) -> str | None:
    """The version of ``package`` (``"jax"``, ``"haiku"`` or ``"flax"``) installed in
    ``site``, from its distribution's metadata; ``None`` where it is not installed there."""
    for found in metadata.distributions(path=[str(site)]):
        if found.metadata["Name"].lower() == _DISTRIBUTIONS[package]:
            return found.version
    return None


def release_tags(git_dir: Path, package: str) -> list[str]:
    """The clone's release tags of ``package`` (``jax-v0.10.2``, ``v0.0.16``), oldest first."""
    listed = subprocess.run(
        ["git", "-C", str(git_dir), "tag"], capture_output=True, text=True, check=True
    )
    versions = {}
    for tag in listed.stdout.split():
        if found := _TAG[package].match(tag):
            versions[tag] = tuple(int(part) for part in found[1].split("."))
    return sorted(versions, key=versions.__getitem__)


def since(git_dir: Path, package: str, names: list[str]) -> dict[str, str]:
    """Per name, the first release tag that has it and any later tag that lacks it."""
    tags = release_tags(git_dir, package)
    history = {}
    for dotted in names:
        present = [not check(git_source(git_dir, tag), [dotted]) for tag in tags]
        if True not in present:
            history[dotted] = "in no release tag"
            continue
        first = present.index(True)
        gaps = [tag for tag, has in zip(tags[first:], present[first:], strict=True) if not has]
        history[dotted] = tags[first] + (f"; absent again at {', '.join(gaps)}" if gaps else "")
    return history


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


def check(source_of: Source, names: list[str]) -> list[str]:
    """The names of ``names`` that a release lacks, its modules read with ``source_of``."""
    missing = []
    for dotted in names:
        module, name = dotted.rsplit(".", 1)
        source = source_of(module)
        try:
            found = source is not None and defines(source, name)
        except SyntaxError as error:  # jax 0.12 writes `class Tracer[TraceType: Trace]`
            raise SystemExit(
                f"cannot parse {module} ({error.msg}, line {error.lineno}) with Python "
                f"{sys.version.split()[0]}: run this script with the Python that release needs"
            ) from None
        if not found:
            missing.append(dotted)
    return missing


def _verdict(package: str, label: str, names: list[str], missing: list[str]) -> str:
    verdict = "all present" if not missing else f"MISSING {missing}"
    return f"{package} {label}: {len(names)} names, {verdict}"


def main(argv: list[str] | None = None) -> int:
    """The command line; returns 1 if a name is missing at some ref."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for package, refs in (("jax", "jax-v0.11.0"), ("haiku", "main"), ("flax", "main")):
        parser.add_argument(f"--{package}", type=Path, help=f"a git clone of {package}")
        parser.add_argument(f"--{package}-refs", default=refs, help="comma-separated refs")
    parser.add_argument(
        "--site",
        type=Path,
        action="append",
        default=[],
        help="a site-packages folder whose installed jax, haiku and flax are read (repeatable)",
    )
    parser.add_argument(
        "--since",
        action="store_true",
        help="print, per name, the first release tag of each clone that has it",
    )
    options = parser.parse_args(argv)
    names = listed()
    failed = False
    for package, prefix in _PACKAGES.items():
        git_dir = getattr(options, package)
        ours = sorted(name for name in names if name.split(".")[0] == prefix)
        for site in options.site:
            if version := installed_version(site, package):
                missing = check(site_source(site), ours)
                failed |= bool(missing)
                print(_verdict(package, f"{version} (installed in {site})", ours, missing))
        if git_dir is None:
            if ours:
                print(f"{package}: no clone (no --{package}); {len(ours)} names")
            continue
        for ref in getattr(options, f"{package}_refs").split(","):
            missing = check(git_source(git_dir, ref), ours)
            failed |= bool(missing)
            print(_verdict(package, ref, ours, missing))
        if options.since:
            for dotted, history in since(git_dir, package, ours).items():
                print(f"  {dotted}: since {history}")
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
