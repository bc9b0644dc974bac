"""Arguments named static by position or name (``static_argnums`` and friends).

They are taken out of the call before it is encoded and handed to JAX as static
arguments, exactly as the plain transform would hash them; the rest is encoded.
"""

from __future__ import annotations

from typing import Any

Layout = tuple[int, tuple[int, ...], tuple[str, ...]]  # (len(args), static positions, names)


class StaticArgs:
    """Splits static arguments off a call and puts them back inside the transform."""

    __slots__ = ("names", "nums")

    def __init__(self, nums: tuple[int, ...], names: tuple[str, ...]):
        self.nums = nums
        self.names = names

    def __bool__(self) -> bool:
        return bool(self.nums or self.names)

    def split(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Layout, tuple[Any, ...], tuple[Any, ...], dict[str, Any]]:
        """``(layout, static values, remaining args, remaining kwargs)``."""
        count = len(args)
        positions = tuple(sorted({i % count for i in self.nums if -count <= i < count}))
        names = tuple(name for name in self.names if name in kwargs)
        values = tuple(args[i] for i in positions) + tuple(kwargs[name] for name in names)
        rest = tuple(a for i, a in enumerate(args) if i not in positions) if positions else args
        rest_kwargs = {k: v for k, v in kwargs.items() if k not in names} if names else kwargs
        return (count, positions, names), values, rest, rest_kwargs

    @staticmethod
    def merge(
        layout: Layout, values: tuple[Any, ...], rest: tuple[Any, ...], rest_kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The inverse of ``split``."""
        count, positions, names = layout
        if not positions and not names:
            return rest, rest_kwargs
        args: list[Any] = []
        remaining = iter(rest)
        static = iter(values)
        for i in range(count):
            args.append(next(static) if i in positions else next(remaining))
        kwargs = dict(rest_kwargs)
        for name in names:
            kwargs[name] = next(static)
        return tuple(args), kwargs
