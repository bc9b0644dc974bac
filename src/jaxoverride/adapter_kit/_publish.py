"""Error classes that print under the public module that exports them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def publish_errors(namespace: Mapping[str, Any]) -> None:
    """Makes the exception classes a public module exports print under its name.

    A class prints (in a traceback, in ``repr``) as its ``__module__`` and
    ``__qualname__``: ``jaxoverride_nnx._errors.LevelError`` names a private module that
    a program should not import from. Each exception or warning class listed in the
    module's ``__all__`` and defined in a private module (a component starting with
    ``_``) gets the public module's name instead, where a program imports and catches it.
    Adapters call it at the end of their ``__init__``:
    ``adapter_kit.publish_errors(globals())``.

    Args:
      namespace: the public module's ``globals()``; its ``__name__`` and ``__all__`` are read.

    Returns:
      None.

    Example:
      >>> import jaxoverride_dag
      >>> jaxoverride_dag.SharingError.__module__
      'jaxoverride_dag'
    """
    name = namespace["__name__"]
    for exported in namespace.get("__all__", ()):
        value = namespace.get(exported)
        if not (isinstance(value, type) and issubclass(value, BaseException)):
            continue
        if any(part.startswith("_") for part in value.__module__.split(".")):
            value.__module__ = name
