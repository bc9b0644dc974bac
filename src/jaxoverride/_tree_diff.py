"""How two pytrees differ, in words, for errors: where two large ``PyTreeDef`` reprs
would differ somewhere in hundreds of characters."""

from __future__ import annotations

from typing import Any

import jax

_SHOWN = 6  # differences listed before "... and N more"


def _leaf(value: Any) -> str:
    """A leaf as JAX's avals print (``float32[2,3]``), or its type's name."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return f"{dtype}[{','.join(map(str, shape))}]"
    return type(value).__name__


def _flat(tree: Any) -> dict[str, str]:
    pairs = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path) or "(the whole state)": _leaf(leaf) for path, leaf in pairs}


def _children(tree: Any) -> list[tuple[str, Any]]:
    pairs = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda node: node is not tree)[0]
    return [(jax.tree_util.keystr(path), child) for path, child in pairs]


def _first_container_change(before: Any, after: Any, where: str = "") -> str:
    """Where the first container differs, for trees of the same paths and leaves."""
    kids_before, kids_after = _children(before), _children(after)
    keys_before, keys_after = [k for k, _ in kids_before], [k for k, _ in kids_after]
    here = where or "(the whole state)"
    if type(before) is not type(after):
        return f"{here}: a {type(before).__name__} became a {type(after).__name__}"
    if keys_before != keys_after:
        removed = [key for key in keys_before if key not in keys_after]
        added = [key for key in keys_after if key not in keys_before]
        return f"{here}: entries {' '.join(removed) or '(none)'} removed, " + (
            f"{' '.join(added) or '(none)'} added (empty subtrees, such as None)"
        )
    for (key, one), (_, other) in zip(kids_before, kids_after, strict=True):
        if jax.tree_util.tree_structure(one) != jax.tree_util.tree_structure(other):
            return _first_container_change(one, other, where + key)
    # What paths do not show (a None added, metadata): this container's two structures.
    shown = [_short(jax.tree_util.tree_structure(tree)) for tree in (before, after)]
    return f"{here}: {shown[0]} -> {shown[1]}"


def _short(treedef: Any, limit: int = 80) -> str:
    text = str(treedef).removeprefix("PyTreeDef(").removesuffix(")")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe(before: Any, after: Any) -> str:
    """How pytree ``after`` differs from ``before``, ``"; "``-separated (six at most, then a
    count): paths removed or added (with their leaves), leaves that changed shape or
    dtype, else the first container that changed.

    Example:
      >>> import jax.numpy as jnp
      >>> describe({"w": jnp.ones(2)}, {"w": jnp.ones(3), "b": jnp.ones(())})
      "['b'] added (float32[]); ['w'] float32[2] -> float32[3]"
    """
    old, new = _flat(before), _flat(after)
    lines = [f"{path} removed (was {leaf})" for path, leaf in old.items() if path not in new]
    lines += [f"{path} added ({leaf})" for path, leaf in new.items() if path not in old]
    lines += [
        f"{path} {leaf} -> {new[path]}"
        for path, leaf in old.items()
        if path in new and new[path] != leaf
    ]
    if not lines:
        lines = [_first_container_change(before, after)]
    more = len(lines) - _SHOWN
    return "; ".join(lines[:_SHOWN] + ([f"... and {more} more"] if more > 0 else []))
