"""Errors that say what went wrong in NNX terms, and how to fix it.

NNX reports a write from the wrong trace as ``TraceContextError: Cannot mutate
Variable from a different trace level``. Inside a neutral call that usually means one
of three things, each with its own fix: the module was never tracked, a tracked module
was written inside a raw ``jax.*`` transform that this adapter cannot see, or an
attribute was assigned (a structural change) inside traced code. ``explain`` reads the
failing frame to tell them apart and names the module and the path to the Variable.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
import types
from typing import TYPE_CHECKING, Any

import flax
import jax
from flax.errors import TraceContextError
from flax.nnx import Pytree, Variable

import jaxoverride
from jaxoverride import errors
from jaxoverride_nnx._graph import node_path
from jaxoverride_nnx._tracked import made_inside_a_transform

if TYPE_CHECKING:
    from jaxoverride_nnx._tracked import Tracked


class _PlainError(TraceContextError):
    # FlaxError appends a link to Flax's error page for the class; ours explain themselves.
    def __init__(self, message: str):
        Exception.__init__(self, message)


class UntrackedModuleError(_PlainError, errors.UntrackedModuleError):
    """A module that is not tracked was mutated inside a neutral call: track it.

    A subclass of Flax's ``TraceContextError``, so existing handlers still catch it, and
    of ``jaxoverride.errors.UntrackedModuleError``.

    Example:
      >>> import jax.numpy as jnp, jaxoverride as jo, jaxoverride_nnx
      >>> from flax import nnx
      >>> counter = nnx.Variable(jnp.array(0))
      >>> def bump(x):
      ...     counter[...] += 1
      ...     return x
      >>> try:
      ...     with jaxoverride_nnx.context():
      ...         jo.jit(bump)(1.0)
      ... except jaxoverride_nnx.UntrackedModuleError as error:
      ...     print(str(error)[:63])
      jaxoverride_nnx: jaxoverride.jit ran code that mutates the Vari
    """


# Traced code tried to change the structure of a tracked module: the one
# structure-change error, ``jaxoverride.errors.StructureChangeError``, under its old name.
StructureChangeError = errors.StructureChangeError


class LevelError(_PlainError, errors.JaxoverrideError):
    """A tracked Variable was mutated inside a transform that this adapter does not manage.

    Raw ``jax.*`` and ``nnx.*`` transforms called inside a neutral call start a trace
    that the tracked Variables do not belong to; use the neutral function there.

    Example:
      >>> import jax, jax.numpy as jnp, jaxoverride as jo, jaxoverride_nnx
      >>> from flax import nnx
      >>> counter = nnx.Variable(jnp.array(0))
      >>> def bump(x):
      ...     counter[...] += 1
      ...     return x
      >>> with jaxoverride_nnx.track(counter):
      ...     try:
      ...         jo.jit(lambda x: jax.jit(bump)(x))(1.0)
      ...     except jaxoverride_nnx.LevelError as error:
      ...         print(str(error)[:47])
      jaxoverride_nnx: the tracked Variable `counter`
    """


def _frames(tb: types.TracebackType | None) -> list[types.FrameType]:
    return [frame for frame, _ in traceback.walk_tb(tb)]


def _culprit(frames: list[types.FrameType]) -> tuple[Any, str | None]:
    """The object whose trace check failed, and the attribute being set if any."""
    target: Any = None
    for frame in reversed(frames):
        owner = frame.f_locals.get("self")
        name = frame.f_code.co_name
        if name == "_check_can_update" and isinstance(owner, Variable):
            target = owner
            break
        if name == "_check_valid_context" and isinstance(owner, Pytree):
            target = owner
            break
    attribute = None
    for frame in frames:
        if frame.f_code.co_name in ("_setattr", "__setattr__", "__delattr__"):
            owner = frame.f_locals.get("self")
            if owner is target and isinstance(frame.f_locals.get("name"), str):
                attribute = frame.f_locals["name"]
    return target, attribute


def _candidates(frame: types.FrameType) -> list[tuple[str, Any]]:
    """Modules a frame can name: its locals and closure cells, and the globals it uses."""
    kinds = (Pytree, Variable)
    found = [(k, v) for k, v in frame.f_locals.items() if isinstance(v, kinds)]
    names = frame.f_code.co_names
    found += [
        (n, frame.f_globals[n])
        for n in names
        if n in frame.f_globals and isinstance(frame.f_globals[n], kinds)
    ]
    return [(k, v) for k, v in found if not k.startswith(".")]


_LIBRARIES = tuple(
    os.path.dirname(module.__file__ or "") + os.sep
    for module in (flax, jax, jaxoverride, sys.modules[__name__.rsplit(".", 1)[0]])
)


def _user_frames(frames: list[types.FrameType]) -> list[types.FrameType]:
    """The frames of user code: Flax, JAX and jaxoverride name things users never wrote."""
    return [f for f in frames if not f.f_code.co_filename.startswith(_LIBRARIES)]


def _name(target: Any, frames: list[types.FrameType]) -> str:
    """``model.layers[0].count``: the outermost name in the traceback that reaches it.

    ``self`` is used only when no other name does, and then as the module's type name.
    """
    fallback = None
    for frame in _user_frames(frames):
        for name, value in _candidates(frame):
            path = "" if value is target else node_path(value, target)
            if path is None:
                continue
            if name != "self":
                return name + path
            if fallback is None:
                fallback = type(value).__name__ + path
    return fallback or f"<{type(target).__name__} at {id(target):#x}>"


def _root(name: str) -> str:
    """The top-level name in a path such as ``model.layers[0].count``."""
    root = re.split(r"[.\[]", name, maxsplit=1)[0]
    return root if root.isidentifier() and root[0].islower() else "model"


def _owner(target: Any, frames: list[types.FrameType]) -> Any:
    """The innermost module in the traceback that holds ``target`` directly."""
    for frame in reversed(frames):
        owner = frame.f_locals.get("self")
        if (
            isinstance(owner, Pytree)
            and owner is not target
            and any(value is target for value in vars(owner).values())
        ):
            return owner
    return None


def written_variable(error: BaseException) -> str | None:
    """``the RngCount `model.rngs.default.count` `` for the Variable whose write raised
    ``error`` (or the error it was raised from), as the program names it; None if unknown."""
    seen: BaseException | None = error
    while seen is not None:
        frames = _frames(seen.__traceback__)
        target, _ = _culprit(frames)
        if isinstance(target, Variable):
            return f"the {type(target).__name__} `{_name(target, frames)}`"
        seen = seen.__cause__ or seen.__context__
    return None


def explain(error: TraceContextError, tracked: Tracked, where: str) -> BaseException:
    """A clearer error for a ``TraceContextError`` raised by code run inside ``where``."""
    if isinstance(error, (UntrackedModuleError, LevelError)):
        return error
    frames = _frames(error.__traceback__)
    target, attribute = _culprit(frames)
    if target is None:
        return error
    name = _name(target, frames)
    if isinstance(target, Variable):
        owner = _owner(target, frames)
        kind = type(target).__name__
        of = f" of {type(owner).__name__}" if owner is not None else ""
        if tracked.var_index(target) is not None:
            return LevelError(
                f"jaxoverride_nnx: the tracked {kind} `{name}`{of} was mutated inside a JAX "
                f"transform that runs within {where} but is not a jaxoverride neutral "
                "function (a raw jax.* or nnx.* transform). Only neutral calls thread "
                "tracked state: use jaxoverride.jit, jaxoverride.lax.scan and so on there. "
                f"{TROUBLESHOOTING}"
            )
        if made_inside_a_transform(target):
            return UntrackedModuleError(
                f"jaxoverride_nnx: {where} ran code that mutates the {kind} `{name}`{of}, "
                "which was created inside a transform running within the track scope: an "
                "NNX transform (nnx.grad, nnx.jit, nnx.vmap, ...) passes its function a "
                "copy of the module it is given, so the tracked module is not the one "
                "written here. Track the copy where it exists, inside the function: "
                f"`with jaxoverride_nnx.track({_root(name)}): ...` around the neutral call; "
                "or use the neutral transforms (jaxoverride.jit, jaxoverride.grad), which "
                f"pass the tracked module itself. {TROUBLESHOOTING}"
            )
        return UntrackedModuleError(
            f"jaxoverride_nnx: {where} ran code that mutates the {kind} `{name}`{of}, but "
            f"that module is not tracked, so its Variables cannot be updated from inside "
            f"the trace. Track it: `with jaxoverride_nnx.track({_root(name)}): ...` "
            "(track the top-level module; every submodule and Variable it holds is "
            f"tracked with it). {TROUBLESHOOTING}"
        )
    kind = type(target).__name__
    what = f"set attribute {attribute!r} of" if attribute else "mutate"
    if tracked.node_index(target) is not None:
        return StructureChangeError(
            f"jaxoverride_nnx: code inside {where} tried to {what} the tracked {kind} "
            f"`{name}`. Inside a trace, tracked modules can only update the values of "
            "existing Variables (`variable[...] = value`); adding or replacing attributes, "
            "submodules or Variables changes the module's structure, which a trace cannot "
            "carry out. Create them before the call, outside any neutral function."
        )
    return UntrackedModuleError(
        f"jaxoverride_nnx: code inside {where} tried to {what} the {kind} `{name}`, which "
        f"is not tracked. Track it: `with jaxoverride_nnx.track({_root(name)}): ...`; "
        "note that even then attributes cannot be assigned inside traced code, only "
        "Variable values updated."
    )


TROUBLESHOOTING = (
    'Raw errors and their fixes: the "Troubleshooting" page of the jaxoverride documentation.'
)


def structure_changed(path: str, before: Any, after: Any, where: str) -> StructureChangeError:
    return StructureChangeError(
        f"jaxoverride_nnx: inside {where} the Variable `{path}` changed from {before} to "
        f"{after}. A tracked Variable keeps its shape, dtype and structure inside traced "
        "code (a trace has fixed types); assign a value of the same shape and dtype, or "
        "resize the Variable outside the neutral call."
    )


def untracked_static(
    where: str, name: str, found: Any, tracked: bool
) -> errors.MissingAdapterError:
    """The error for NNX state that a static argument of a ``jit`` reaches, untracked.

    JAX caches a trace by its static arguments: the Variables such an argument reaches
    are read as constants of the trace, and a later call with the same argument (the
    same function object, a bound method, the module) returns results for the old
    values, silently.
    """
    label = name if name.isidentifier() else "model"
    fix = (
        f"track it too: add `{label}` to the modules given to jaxoverride_nnx.track"
        if tracked
        else f"`with jaxoverride_nnx.track({label}): ...` around the call"
    )
    scope = "the active track scope does not hold" if tracked else "no track scope holds"
    what = (
        f"the {type(found).__name__} `{name}`"
        if name.isidentifier()
        else f"a {type(found).__name__}"
    )
    return errors.MissingAdapterError(
        f"jaxoverride_nnx: a static argument of {where} reaches {what}, which {scope}. "
        "jax.jit caches its trace by the static arguments, so the weights read there "
        "would be baked in as constants, and a later call with the same argument would "
        f"silently return results for the old ones. Fix: {fix} (track the top-level "
        "module; everything it holds is tracked with it)."
    )
