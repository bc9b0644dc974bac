"""``self_check()`` and ``python -m jaxoverride``: what is installed, active and interposed.

The supported versions are jaxoverride's own requirements, read from its installed
distribution's metadata (``Requires-Dist``), so that ``pyproject.toml`` stays the one place
that states them.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

from jaxoverride import (
    _detect,
    _frameworks,
    _import_hook,
    _interpose,
    _introspect,
    _raw,
)
from jaxoverride._own_frames import ADAPTERS
from jaxoverride._words import counted, listed

# (distribution, import name) of what the report shows the versions of.
DISTRIBUTIONS = (
    ("jaxoverride", "jaxoverride"),
    ("jax", "jax"),
    ("jaxlib", "jaxlib"),
    ("flax", "flax"),
    ("dm-haiku", "haiku"),
    ("equinox", "equinox"),
    ("optimistix", "optimistix"),
    ("lineax", "lineax"),
    ("diffrax", "diffrax"),
    ("jaxopt", "jaxopt"),
    ("optax", "optax"),
)


_REQUIREMENT = re.compile(
    r"^\s*(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(?P<specifiers>[^;]*)"
    r"(?:;\s*(?P<marker>.*))?$"
)
_EXTRA = re.compile(r"""extra\s*==\s*['"](?P<extra>[^'"]+)['"]""")
_SPECIFIER = re.compile(r"^\s*(?P<op>~=|==|!=|<=|>=|<|>)\s*(?P<version>\S+)\s*$")
# The orders (-1, 0, 1 for below, equal, above) each comparison accepts.
_ORDERS = {"==": (0,), "!=": (-1, 1), "<=": (-1, 0), ">=": (0, 1), "<": (-1,), ">": (1,)}


class Requirement(NamedTuple):
    """One ``Requires-Dist`` entry: a distribution, its range, and the extra that asks for
    it (None for a requirement of the core)."""

    distribution: str
    specifiers: str  # as written: ">=0.8.1,<0.12"
    extra: str | None


def parse(line: str) -> Requirement | None:
    """A ``Requires-Dist`` line as a ``Requirement``; None for one this reader does not
    understand (a URL, a marker other than an extra).

    Example:
      >>> parse("dm-haiku<0.1,>=0.0.15; extra == 'haiku'")
      Requirement(distribution='dm-haiku', specifiers='<0.1,>=0.0.15', extra='haiku')
    """
    match = _REQUIREMENT.match(line)
    if match is None or "@" in match["specifiers"]:
        return None
    marker = (match["marker"] or "").strip()
    extra = _EXTRA.fullmatch(marker)
    if marker and extra is None:
        return None
    specifiers = match["specifiers"].strip().strip("()").replace(" ", "")
    return Requirement(match["name"], specifiers, extra["extra"] if extra else None)


def requirements(distribution: str = "jaxoverride") -> list[Requirement] | None:
    """The requirements of the installed ``distribution``; None where it is not installed
    (run from a source tree)."""
    import importlib.metadata

    try:
        lines = importlib.metadata.requires(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    return [found for found in map(parse, lines) if found is not None]


def _release(version: str) -> tuple[int, ...]:
    match = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(part) for part in match[0].split(".")) if match else ()


def _compare(left: tuple[int, ...], right: tuple[int, ...]) -> int:
    width = max(len(left), len(right))
    left, right = left + (0,) * (width - len(left)), right + (0,) * (width - len(right))
    return (left > right) - (left < right)


def satisfies(version: str, specifiers: str) -> bool:
    """Whether ``version`` is inside ``specifiers`` (``">=0.8.1,<0.12"``), comparing
    release numbers.

    Example:
      >>> satisfies("0.10.2", ">=0.8.1,<0.12"), satisfies("0.12.0", ">=0.8.1,<0.12")
      (True, False)
    """
    installed = _release(version)
    for specifier in filter(None, specifiers.split(",")):
        match = _SPECIFIER.match(specifier)
        if match is None:
            continue
        bound = _release(match["version"])
        order = _compare(installed, bound)
        if match["op"] == "~=":  # at least ``bound``, and the same release but its last part
            ok = order >= 0 and installed[: len(bound) - 1] == bound[:-1]
        else:
            ok = order in _ORDERS[match["op"]]
        if not ok:
            return False
    return True


def _version(distribution: str) -> str:
    import importlib.metadata  # here, not at import: it costs ``import jaxoverride`` time

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _findable(module: str) -> bool:
    if module in sys.modules:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _versions() -> list[str]:
    import platform

    lines = [f"  python {platform.python_version()}"]
    for distribution, module in DISTRIBUTIONS:
        imported = " (imported)" if module in sys.modules else ""
        lines.append(f"  {distribution} {_version(distribution)}{imported}")
    return lines


def _framework_missing(adapter: str) -> str | None:
    """The framework package ``adapter`` handles, where it cannot be imported here: read
    from the framework records the installed distributions declare (nothing is loaded)."""
    for module, value in _frameworks.declared():
        package = module.partition(".")[0]
        if value.partition(".")[0].partition(":")[0] == adapter and not _findable(package):
            return package
    return None


def _adapters() -> list[str]:
    stack = _introspect.current_stack()
    extras = {r.extra for r in requirements() or []}
    lines = []
    for adapter in ADAPTERS:
        if adapter in sys.modules:
            state = "imported"
        elif not _findable(adapter):
            state = "not found"
        elif (missing := _framework_missing(adapter)) is not None:
            extra = adapter.removeprefix("jaxoverride_")
            hint = f": pip install 'jaxoverride[{extra}]'" if extra in extras else ""
            state = f"not available, {missing} is not installed{hint}"
        else:
            state = "available, not imported"
        layers = [layer for layer in stack.layers if layer.label == adapter]
        if layers:
            state += "; " + ", ".join(layer.source for layer in layers)
        lines.append(f"  {adapter}: {state}")
    others = [layer for layer in stack.layers if layer.label not in ADAPTERS]
    lines += [f"  {layer.label}: {layer.source}" for layer in others]
    return lines


def _supported() -> list[str]:
    """Each installed distribution that jaxoverride or an adapter's extra requires, and
    whether it is inside the range its metadata states."""
    found = requirements()
    if found is None:
        return ["  unknown: jaxoverride's distribution metadata is not installed"]
    extras = {adapter.removeprefix("jaxoverride_") for adapter in ADAPTERS}
    ranges: dict[str, tuple[str, list[str]]] = {}  # distribution -> (range, extras)
    for requirement in found:
        if requirement.extra is not None and requirement.extra not in extras:
            continue
        if requirement.specifiers:
            _, wanted_by = ranges.setdefault(requirement.distribution, (requirement.specifiers, []))
            if requirement.extra is not None:
                wanted_by.append(repr(requirement.extra))
    lines = []
    for distribution, (specifiers, wanted_by) in ranges.items():
        version = _version(distribution)
        where = f"supported: {specifiers}"
        if wanted_by:
            where += f", for the {' and '.join(wanted_by)} extra{'s' * (len(wanted_by) > 1)}"
        if version == "not installed":
            lines.append(f"  {distribution}: not installed ({where})")
        elif satisfies(version, specifiers):
            lines.append(f"  {distribution} {version}: inside the range ({where})")
        else:
            lines.append(
                f"  {distribution} {version}: OUTSIDE the supported range ({where}); the "
                "adapters use its private internals, so expect errors"
            )
    return lines


def _interposed() -> list[str]:
    with _interpose._lock:
        modules = sorted({binding.module.__name__ for binding in _interpose._bindings.values()})
        watched = sorted(_import_hook._watched)
    lines = [f"  interpose_on_import watches: {', '.join(watched) or 'nothing'}"]
    packages = Counter(name.partition(".")[0] for name in modules)
    lines += [f"  {p}: {counted(n, 'module')} rebound" for p, n in sorted(packages.items())]
    return lines if packages else [*lines, "  no module is rebound"]


def _raw_transforms(packages: Sequence[str]) -> list[str]:
    held = _raw.held_by_imported(tuple(packages))
    if not held:
        imported = [p for p in packages if p in sys.modules]
        if imported:
            return [f"  none: {', '.join(imported)} hold no raw import-time transform"]
        return ["  none of the solver libraries is imported in this process"]
    lines = [f"  {package}: {len(names)} ({listed(names)})" for package, names in held.items()]
    builders = _raw.builders([name for names in held.values() for name in names])
    lines.append(
        "  These keep calling raw JAX: adapters do not apply inside them. Fix: call "
        f"{_raw.fix_for([*held, *builders])}, at the top of the program."
    )
    guarded = sum(_guarded(name) for names in held.values() for name in names)
    if guarded:
        lines.append(
            f"  {counted(guarded, 'of them is', 'of them are')} checked at each call while an "
            "adapter is active: one that runs framework code raises MissingAdapterError."
        )
    return lines


def _guarded(dotted: str) -> bool:
    module_name, _, attribute = dotted.rpartition(".")
    module = sys.modules.get(module_name)
    return type(getattr(module, attribute, None)) is _raw.RawGuard


def self_check(packages: Sequence[str] | None = None) -> str:
    """A report of this process: versions, adapters, interposition, raw transforms.

    ``python -m jaxoverride`` prints it for a fresh process; call this from a program to
    see the program's own state at that point. Versions come from package metadata, so
    nothing is imported to report them.

    Args:
      packages: the solver libraries to look for raw import-time transforms in (only
        those already imported are looked at); by default equinox, optimistix, lineax,
        diffrax, jaxopt and optax.

    Returns:
      The report, one section per heading.

    Example:
      >>> import jaxoverride as jo
      >>> report = jo.self_check()
      >>> report.splitlines()[0]
      'jaxoverride self-check'
      >>> "Adapters" in report and "Missing-adapter check" in report
      True
    """
    names = _raw.SOLVER_LIBRARIES if packages is None else tuple(packages)
    turn_off = f"(jaxoverride.set_adapter_check(...), or {_detect.ENV_VAR}=0 to turn it off)"
    sections = [
        ("Versions (from package metadata)", _versions()),
        ("Supported versions (jaxoverride's requirements)", _supported()),
        ("Adapters", _adapters()),
        ("Missing-adapter check", [f"  {'on' if _detect.enabled else 'off'} {turn_off}"]),
        ("Interposed packages", _interposed()),
        ("Raw import-time transforms in imported solver libraries", _raw_transforms(names)),
    ]
    lines = ["jaxoverride self-check"]
    for title, body in sections:
        lines += ["", title + ":", *body]
    return "\n".join(lines)


HELP = """usage: python -m jaxoverride [--import PACKAGE ...]

Prints jaxoverride's self-check: versions and supported ranges, the adapters, the
missing-adapter check, interposed packages and raw transforms of imported solver libraries.

options:
  -h, --help        show this message and exit
  --import PACKAGE  import PACKAGE first, as a program would, to see what it holds
                    (repeatable)"""


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m jaxoverride [--import PACKAGE ...]``: prints ``self_check()`` (see ``HELP``)."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    to_import: list[str] = []
    while arguments:
        argument = arguments.pop(0)
        if argument in ("-h", "--help"):
            print(HELP)
            return 0
        if argument == "--import" and arguments:
            to_import.append(arguments.pop(0))
            continue
        print(f"python -m jaxoverride: unknown argument {argument!r}; see --help.")
        return 2
    for name in to_import:
        importlib.import_module(name)
    print(self_check())
    return 0
