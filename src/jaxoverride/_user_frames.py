"""The program's own frames, for messages: the call it made, the names it gave.

An error raised deep inside a library names the call the program made into it
(``optx.fixed_point``, not the ``jaxoverride.make_jaxpr`` the library called) and the
variable holding a module. Only error paths read these frames.
"""

from __future__ import annotations

import inspect
import linecache
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

from jaxoverride._raw import SOLVER_LIBRARIES, framework_packages

# Packages whose frames are never the program's: JAX and jaxoverride; the registered
# frameworks' packages too (``framework_packages``).
_INTERNAL = frozenset({"jax", "jaxlib", "jaxoverride", "importlib"})


def _package(frame: types.FrameType) -> str:
    name = frame.f_globals.get("__name__")
    return name.partition(".")[0] if isinstance(name, str) else ""


def _internal(frame: types.FrameType) -> bool:
    package = _package(frame)
    return (
        package in _INTERNAL
        or package.startswith("jaxoverride_")
        or package in framework_packages()
    )


def _library(frame: types.FrameType) -> bool:
    """A solver library's frame, or one of a module that ``interpose`` rebound (its
    ``jax`` is the neutral module, named ``jax`` but not ``jax`` itself)."""
    if _package(frame) in SOLVER_LIBRARIES:
        return True
    held = frame.f_globals.get("jax")
    return (
        isinstance(held, types.ModuleType)
        and held.__name__ == "jax"
        and held is not sys.modules.get("jax")
    )


def _outward() -> Iterator[types.FrameType]:
    """The frames of this thread, innermost first (jaxoverride's own are skipped later)."""
    frame = inspect.currentframe()
    while frame is not None:
        yield frame
        frame = frame.f_back


def _callee(frame: types.FrameType) -> str | None:
    """What the frame's current call expression calls, as written (``optx.fixed_point``)."""
    positions = getattr(frame.f_code, "co_positions", None)  # Python 3.11 and later
    if positions is None:
        return None
    try:
        line, end_line, start, end = list(positions())[frame.f_lasti // 2]
    except (IndexError, ValueError):
        return None
    if line is None or line != end_line or start is None or end is None:
        return None
    text = linecache.getline(frame.f_code.co_filename, line)
    callee = text.encode()[start:end].decode(errors="replace").partition("(")[0].strip()
    return callee if callee and all(p.isidentifier() for p in callee.split(".")) else None


def call_made(neutral: str) -> str:
    """How a message names the call that reached the neutral function ``neutral``: that
    name where the program called it itself, else the call the program made into the
    library that called it, with its place (``"optx.fixed_point (called in forward, at
    model.py line 12, which reached jaxoverride.make_jaxpr)"``)."""
    through_library = False
    for frame in _outward():
        if _internal(frame):
            continue
        if _library(frame):
            through_library = True
            continue
        if not through_library:
            return neutral
        callee = _callee(frame)
        place = f"in {frame.f_code.co_name}, at {frame.f_code.co_filename} line {frame.f_lineno}"
        if callee is None:
            return f"the call {place} (which reached {neutral})"
        return f"{callee} (called {place}, which reached {neutral})"
    return neutral


def names_of(chosen: Callable[[Any], bool]) -> list[str]:
    """The program's variable names, innermost frame first, each object once, for the
    objects ``chosen`` accepts; an object held by another one's attribute is left out."""
    found: dict[int, tuple[str, Any]] = {}
    for frame in _outward():
        if _internal(frame) or _library(frame):
            continue
        for name, value in list(frame.f_locals.items()):
            if name == "self" or not name.isidentifier() or id(value) in found:
                continue
            try:
                accepted = chosen(value)
            except Exception:  # an object whose comparison or hash raises: not one
                accepted = False
            if accepted:
                found[id(value)] = (name, value)
    held = {
        id(inner)
        for _, value in found.values()
        for inner in getattr(value, "__dict__", {}).values()
    }
    return [name for key, (name, _) in found.items() if key not in held]
