"""Every exception class that jaxoverride and its adapters raise prints a public path
(issue 31 item 13): ``jaxoverride.errors.MissingAdapterError``, never
``jaxoverride._detect.MissingAdapterError``. A traceback's last line is the class's
``__module__`` and ``__qualname__``; a user can only import and catch it from there if that
module is public and holds it under that name."""

from __future__ import annotations

import importlib
import types

import jax.numpy as jnp
import pytest
from flax import nnx

import jaxoverride as jo
from jaxoverride._own_frames import ADAPTERS

PUBLIC = (
    "jaxoverride",
    "jaxoverride.errors",
    "jaxoverride.lax",
    "jaxoverride.adapter_kit",
    *ADAPTERS,
)


def _ours(cls: type) -> bool:
    return cls.__module__.partition(".")[0].startswith("jaxoverride")


def _raised_to_users(cls: type) -> bool:
    """Whether an exception of ``cls`` may reach a user. An ``adapter_kit.TraceAbort``
    subclass does not: an adapter raises it inside JAX's traces to trace again, and the
    same adapter catches it (``NeedsState``: a probe was used)."""
    return cls is jo.adapter_kit.TraceAbort or not issubclass(cls, jo.adapter_kit.TraceAbort)


def _reachable() -> set[type[BaseException]]:
    """The exception classes the public modules name, and every subclass of them that
    jaxoverride or an adapter defines (raised ones included, made on the fly or not)."""
    pending = [
        value
        for name in PUBLIC
        for value in vars(importlib.import_module(name)).values()
        if isinstance(value, type) and issubclass(value, BaseException)
    ]
    found: set[type[BaseException]] = set()
    while pending:
        cls = pending.pop()
        if cls in found:
            continue
        found.add(cls)
        pending += cls.__subclasses__()
    return {cls for cls in found if _ours(cls) and _raised_to_users(cls)}


def _public_path(cls: type) -> bool:
    module = cls.__module__
    if any(part.startswith("_") for part in module.split(".")):
        return False
    return getattr(importlib.import_module(module), cls.__qualname__, None) is not None


def _nnx_write_error() -> jo.errors.MissingAdapterError:
    """The error of a write to a captured NNX Variable with no adapter: its class is made at
    the first such error, combined with Flax's ``TraceContextError``."""
    counter = nnx.Variable(jnp.array(0))

    def step(carry, _):
        counter[...] += 1
        return carry, None

    with pytest.raises(jo.errors.MissingAdapterError) as info:
        jo.lax.scan(step, 0.0, length=2)
    return info.value


def test_every_exception_class_of_the_public_modules_prints_a_public_path():
    error = _nnx_write_error()
    assert type(error) is not jo.errors.MissingAdapterError  # the combined class
    classes = _reachable()
    assert type(error) in classes
    assert len(classes) > 20
    private = sorted(
        f"{cls.__module__}.{cls.__qualname__}" for cls in classes if not _public_path(cls)
    )
    assert private == []


def test_missing_adapter_error_combined_with_flax_prints_its_public_name():
    error = _nnx_write_error()
    cls = type(error)
    assert f"{cls.__module__}.{cls.__qualname__}" == "jaxoverride.errors.MissingAdapterError"
    assert isinstance(error, importlib.import_module("flax.errors").TraceContextError)


def test_no_public_module_is_a_private_one():
    assert all(isinstance(importlib.import_module(name), types.ModuleType) for name in PUBLIC)
