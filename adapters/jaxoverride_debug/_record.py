"""``Call``: one line of the trace log."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["call", "build", "run"]


@dataclass(frozen=True)
class Call:
    """A neutral call seen by ``trace``: what was called, on what, and what ran it.

    Attributes:
      name: the overridable name, such as ``"lax.scan"`` or ``"jit"``.
      kind: ``"call"`` for control flow and the other calls (``lax.scan``, ``jvp``,
        ...); for a transform, ``"build"`` when the transformed function is made (once
        per wrapper and stack) and ``"run"`` each time it is called.
      shapes: the arguments as shapes and dtypes, e.g. ``"f32[], f32[5]"``; options
        that differ from JAX's defaults as ``name=value``. For a build, the options
        given to the transform, such as ``static_argnums=(1,)``.
      impl: the qualified name of the implementation below the trace, the one it
        delegates to: ``"jax.lax.scan"``, or an adapter's, such as
        ``"jaxoverride_haiku._control.scan"``.
      depth: how many traced calls enclose this one (a scan in a while body: 1).
      function: the transformed function's name (``"build"``/``"run"``), or the body's
        for a loop; None where there is none.
      above: implementations of the same name in layers above the trace that ran
        first and handed the call down (empty when the trace is the innermost layer).
      progress: whether a progress bar was attached to this loop.

    Example:
      >>> from jaxoverride_debug import Call
      >>> print(Call("lax.scan", "call", "f32[], f32[5]", "jax.lax.scan", 1, "step"))
        lax.scan(f32[], f32[5]) -> jax.lax.scan
    """

    name: str
    kind: Kind
    shapes: str
    impl: str
    depth: int = 0
    function: str | None = None
    above: tuple[str, ...] = ()
    progress: bool = False

    def __str__(self) -> str:
        if self.kind == "build":
            text = f"{self.name}({self.function}) built"
            if self.shapes:
                text = f"{self.name}({self.function}, {self.shapes}) built"
        elif self.kind == "run":
            text = f"{self.name}({self.function})({self.shapes})"
        else:
            text = f"{self.name}({self.shapes})"
        text = f"{'  ' * self.depth}{text} -> {self.impl}"
        if self.above:
            text += f" (handed down by {', '.join(self.above)})"
        if self.progress:
            text += " [progress]"
        return text
