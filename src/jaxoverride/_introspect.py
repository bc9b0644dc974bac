"""A readable view of the active stack, for people who debug."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jaxoverride import _stack
from jaxoverride._names import JAX_IMPLS


def _describe(impl: Callable[..., Any], name: str | None = None) -> str:
    if name is not None and impl is JAX_IMPLS[name]:
        return f"jax.{name}"
    module = getattr(impl, "__module__", None)
    qualname = getattr(impl, "__qualname__", None) or type(impl).__name__
    return f"{module}.{qualname}" if module else qualname


@dataclass(frozen=True)
class StackLayer:
    """One level of the stack as ``current_stack`` reports it."""

    label: str
    overrides: dict[str, Callable[..., Any]]
    source: str  # "context", "installed", "installed, scope" or "installed (inactive)"


@dataclass(frozen=True)
class Stack:
    """The layers that neutral calls see in this thread or task, top first.

    Example:
      >>> import jax, jaxoverride as jo
      >>> with jo.override_context({"lax.scan": jax.lax.scan}, name="example"):
      ...     stack = jo.current_stack()
      >>> [layer.label for layer in stack.layers], stack.resolutions()["lax.scan"]
      (['example'], 'jax.lax.scan')
    """

    layers: tuple[StackLayer, ...]

    def resolve(self, name: str) -> Callable[..., Any]:
        """The implementation of ``name`` at the top of this stack, or JAX's own."""
        for layer in self.layers:
            if layer.source != "installed (inactive)" and name in layer.overrides:
                return layer.overrides[name]
        return JAX_IMPLS[name]

    def resolutions(self) -> dict[str, str]:
        """For each overridable name, a description of the implementation it resolves to."""
        return {name: _describe(self.resolve(name), name) for name in sorted(JAX_IMPLS)}

    def __repr__(self) -> str:
        if not self.layers:
            return "<jaxoverride stack: empty, every neutral function is JAX's own>"
        lines = ["<jaxoverride stack, top first:"]
        for index, layer in enumerate(self.layers):
            names = ", ".join(
                f"{name}={_describe(impl)}" for name, impl in sorted(layer.overrides.items())
            )
            lines.append(
                f"  {len(self.layers) - 1 - index}. [{layer.source}] {layer.label}: {names}"
            )
        lines.append("  -. jax>")
        return "\n".join(lines)


def current_stack() -> Stack:
    """Describes the overrides active in this thread or task, including installed adapters.

    Returns:
      A ``Stack`` whose ``repr`` lists each layer, top first, with the implementation of
      each name it overrides; ``resolutions()`` maps every overridable name to what it
      resolves to now. Installed adapters whose predicate is false are listed as inactive.

    Example:
      >>> import jaxoverride as jo
      >>> jo.current_stack()
      <jaxoverride stack: empty, every neutral function is JAX's own>
    """
    scoped = {entry.layer for entry in _stack.installed if entry.scoped}
    layers: list[StackLayer] = [
        StackLayer(layer.label, dict(layer.impls), "installed, scope" if layer in scoped
                   else "context")
        for layer in reversed(_stack.context_snapshot().layers)
    ]  # fmt: skip
    active = set(_stack.effective_snapshot().layers)
    for entry in reversed(_stack.installed):
        if entry.scoped and entry.layer in active:
            continue  # an entered scope is part of the context snapshot listed above
        source = "installed" if entry.layer in active else "installed (inactive)"
        layers.append(StackLayer(entry.layer.label, dict(entry.layer.impls), source))
    return Stack(tuple(layers))
