"""The adapter contract: every overridable name is handled or explicitly passed through.

An adapter that forgets a name does not fail: the neutral call falls through to the layer
below (in the end, to JAX), which is a silent wrong result for a stateful framework. So
each adapter declares its table as an ``OverrideTable``: the names it overrides, and
the names it deliberately leaves to the layer below, each with the reason. The test suite
checks every declared table against ``jaxoverride.OVERRIDEABLE`` with
``unhandled_names``, so a name added to the core fails until each adapter decides.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

import jaxoverride as jo
from jaxoverride._names import OVERRIDEABLE, check_mapping, check_name


@runtime_checkable
class Adapter(Protocol):
    """What an adapter declares: which names it overrides, and which it passes through.

    The protocol (as optax's ``GradientTransformation`` is one for optimisers) that
    ``OverrideTable`` implements and the contract test checks. Every name of
    ``jaxoverride.OVERRIDEABLE`` is in exactly one of ``overrides`` and
    ``passes_through``.

    Attributes:
      name: the adapter's name, as its layer appears in ``jaxoverride.current_stack()``.
      overrides: ``{name: implementation}``; each implementation has the signature of the
        JAX function it stands for, and reaches the layer below with
        ``jaxoverride.next_impl``.
      passes_through: ``{name: reason}`` for the names the adapter leaves to the layer
        below, on purpose.
    """

    @property
    def name(self) -> str: ...

    @property
    def overrides(self) -> Mapping[str, Callable[..., Any]]: ...

    @property
    def passes_through(self) -> Mapping[str, str]: ...


_lock = threading.Lock()
_declared: dict[str, OverrideTable] = {}


class OverrideTable:
    """An adapter's override table: its overrides, its pass-throughs, and its layer.

    Building one checks the names and implementations (as ``override_context`` does) and
    that no name is both overridden and passed through, and records the table for
    ``declared_adapters`` under ``name`` (a later table of the same name replaces
    it). ``context()`` is the adapter's ``OverrideContext``, made once.

    Args:
      name: the adapter's name (its distribution's import name, such as
        ``"jaxoverride_haiku"``).
      overrides: ``{name: implementation}``.
      passes_through: ``{name: reason}`` for names left to the layer below.
      label: the layer's label in ``current_stack()``; ``name`` when omitted.

    Raises:
      ValueError: for an unknown name (with the closest match) or a name in both.
      TypeError: for a non-callable implementation or a non-string reason.

    Example:
      >>> import jaxoverride as jo
      >>> from jaxoverride import adapter_kit as kit
      >>> def scan(*args, **kwargs):
      ...     return jo.next_impl("lax.scan")(*args, **kwargs)
      >>> table = kit.OverrideTable(
      ...     "example_scan_only",
      ...     {"lax.scan": scan},
      ...     passes_through={"jit": "nothing to do"},
      ... )
      >>> sorted(kit.unhandled_names(table))[:2]
      ['checkpoint', 'closure_convert']
      >>> with table.context():
      ...     jo.resolve("lax.scan") is scan
      True
    """

    __slots__ = ("_context", "label", "name", "overrides", "passes_through")

    def __init__(
        self,
        name: str,
        overrides: Mapping[str, Callable[..., Any]],
        *,
        passes_through: Mapping[str, str] | None = None,
        label: str | None = None,
    ):
        where = f"OverrideTable({name!r})"
        self.name = name
        self.label = name if label is None else label
        self.overrides: Mapping[str, Callable[..., Any]] = check_mapping(overrides, where=where)
        reasons: dict[str, str] = {}
        for key, reason in (passes_through or {}).items():
            check_name(key, where=f"{where}, passes_through")
            if not isinstance(reason, str):
                raise TypeError(
                    f"{where}: passes_through maps each name to the reason it is left to the "
                    f"layer below, as a string; got {type(reason).__name__} for {key!r}."
                )
            reasons[key] = reason
        both = sorted(set(reasons) & set(self.overrides))
        if both:
            raise ValueError(
                f"{where}: {', '.join(map(repr, both))} both overridden and passed through; "
                "remove each from one of the two."
            )
        self.passes_through: Mapping[str, str] = reasons
        self._context: jo.OverrideContext | None = None
        with _lock:
            _declared[name] = self

    def context(self) -> jo.OverrideContext:
        """The adapter's layer: one ``OverrideContext`` of ``overrides``, made on first use.

        Returns:
          The same reusable, reentrant context on every call, so that re-entering it finds
          the builds cached for it.
        """
        context = self._context
        if context is None:
            context = self._context = jo.override_context(self.overrides, name=self.label)
        return context

    def __repr__(self) -> str:
        return (
            f"OverrideTable({self.name!r}: {len(self.overrides)} overridden, "
            f"{len(self.passes_through)} passed through)"
        )


def overrides_in(module: ModuleType, *names: str) -> dict[str, Callable[..., Any]]:
    """``{name: implementation}`` for overrides named after their names in ``module``.

    An adapter that keeps one module per kind of name (control flow, transforms, rules)
    writes its table as one line per module: ``"lax.scan"`` is ``module.scan``,
    ``"jit"`` is ``module.jit``.

    Args:
      module: the module that defines the implementations.
      names: overridable names.

    Returns:
      A new dict, for ``OverrideTable``'s ``overrides``.

    Raises:
      ValueError: for a name that is not overridable.
      AttributeError: for a name whose function ``module`` lacks.

    Example:
      >>> import types
      >>> from jaxoverride import adapter_kit as kit
      >>> control = types.ModuleType("control")
      >>> control.scan = control.cond = print
      >>> sorted(kit.overrides_in(control, "lax.scan", "lax.cond"))
      ['lax.cond', 'lax.scan']
    """
    table: dict[str, Callable[..., Any]] = {}
    for name in names:
        attribute = check_name(name, where="overrides_in").removeprefix("lax.")
        if not hasattr(module, attribute):
            raise AttributeError(
                f"overrides_in: {module.__name__} has no {attribute!r}, the override of "
                f"{name!r}; define it there, or give the entry {{{name!r}: ...}} explicitly."
            )
        table[name] = getattr(module, attribute)
    return table


def unhandled_names(adapter: Adapter) -> frozenset[str]:
    """The overridable names that ``adapter`` neither overrides nor passes through.

    Args:
      adapter: an ``Adapter``, such as an ``OverrideTable``.

    Returns:
      The names the adapter has not decided on; empty when it keeps the contract.

    Example:
      >>> from jaxoverride import adapter_kit as kit
      >>> table = kit.OverrideTable(
      ...     "example_everything_passes", {}, passes_through=dict.fromkeys(kit.OVERRIDEABLE, "")
      ... )
      >>> kit.unhandled_names(table)
      frozenset()
    """
    return OVERRIDEABLE - set(adapter.overrides) - set(adapter.passes_through)


def declared_adapters() -> dict[str, OverrideTable]:
    """The override tables declared in this process so far, by adapter name.

    An adapter declares its table when it is imported; import an adapter before asking.

    Returns:
      A new dict ``{name: table}``.

    Example:
      >>> import jaxoverride_dag
      >>> from jaxoverride import adapter_kit as kit
      >>> sorted(kit.declared_adapters()["jaxoverride_dag"].passes_through)[:2]
      ['closure_convert', 'custom_jvp']
    """
    with _lock:
        return dict(_declared)
