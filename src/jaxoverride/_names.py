"""The overridable names, the JAX function behind each, and name validation."""

from __future__ import annotations

import difflib
import operator
from collections.abc import Callable, Mapping
from typing import Any

import jax


def _from_jax(names: str) -> dict[str, Callable[..., Any]]:
    return {name: operator.attrgetter(name)(jax) for name in names.split()}


TRANSFORMS: Mapping[str, Callable[..., Any]] = _from_jax(
    "jit vmap pmap grad value_and_grad jacfwd jacrev hessian checkpoint remat shard_map make_jaxpr"
)
"""The transforms, ``{name: JAX function}``: each takes a function and returns one.

The override of a transform is called once per (wrapper, active stack) to build that
function, and the result is cached.
"""

RULES: Mapping[str, Callable[..., Any]] = _from_jax("custom_vjp custom_jvp")
"""The custom derivative rules, ``{name: JAX class}``: decorator classes.

A rule's override is called with JAX's constructor arguments once per (decorated
function, active stack), must return an object with JAX's ``defvjp`` / ``defjvp`` /
``defjvps`` and ``__call__``, and the rules defined on the neutral object are replayed
onto it.
"""

CALLS: Mapping[str, Callable[..., Any]] = _from_jax(
    "jvp vjp linearize eval_shape closure_convert lax.scan lax.while_loop lax.fori_loop lax.cond "
    "lax.switch lax.map lax.custom_root lax.custom_linear_solve"
)
"""The calls, ``{name: JAX function}``: each runs at once; its override is resolved and
called on every call."""

JAX_IMPLS: Mapping[str, Callable[..., Any]] = {**TRANSFORMS, **RULES, **CALLS}
"""Every overridable name with the JAX function or class it stands for: the one list of
the overridable names, from which ``OVERRIDEABLE`` and the neutral modules derive."""

OVERRIDEABLE: frozenset[str] = frozenset(JAX_IMPLS)
"""Every name that ``override_context`` and ``install`` accept, such as ``"jit"`` and
``"lax.scan"``."""


def check_name(name: object, *, where: str) -> str:
    """Returns ``name`` if it is overridable, or raises an error that names the closest match."""
    if not isinstance(name, str):
        raise TypeError(
            f"{where}: override names are strings such as 'lax.scan' or 'jit', "
            f"got {type(name).__name__} {name!r}."
        )
    if name in OVERRIDEABLE:
        return name
    candidates = sorted(OVERRIDEABLE)
    hint = ""
    if f"lax.{name}" in OVERRIDEABLE:
        hint = f" Did you mean 'lax.{name}'? Control flow lives under the 'lax.' prefix."
    elif close := difflib.get_close_matches(name, candidates, n=1, cutoff=0.5):
        hint = f" Did you mean {close[0]!r}?"
    raise ValueError(
        f"{where}: unknown override name {name!r}.{hint} "
        f"Overridable names are: {', '.join(candidates)}."
    )


def check_mapping(mapping: object, *, where: str) -> dict[str, Callable[..., Any]]:
    """Validates a ``{name: implementation}`` mapping and returns it as a fresh dict."""
    if not isinstance(mapping, Mapping):
        raise TypeError(
            f"{where} expects a mapping from overridable names to implementations, such as "
            f"{{'lax.scan': my_scan}}; got {type(mapping).__name__}. "
            "Build one with dict(...) or pass an adapter's context()."
        )
    impls: dict[str, Callable[..., Any]] = {}
    for name, impl in mapping.items():
        check_name(name, where=where)
        if not callable(impl):
            raise TypeError(
                f"{where}: the override for {name!r} must be callable with the signature of "
                f"jax.{name}, got {type(impl).__name__} {impl!r}."
            )
        impls[name] = impl
    return impls
