"""Overrides of the neutral control flow: Haiku state threaded through, and init-exact.

Each override is the kit's threaded combinator (``jaxoverride.adapter_kit.threaded_scan``
& co.) over a ``_source.HaikuSource``: the Haiku state and rng in the carry, exactly as
``hk.scan`` & co. carry them. Outside a transform, or where Haiku state is unusable, each
override is the implementation below it, untouched.

At init the loop is traced once, as at apply, and a parameter that a body or branch
creates is made at the call's site (``_site``): outside the trace, under the name Haiku
gives it there, so that init returns what apply returns and a loop that runs zero times
has still created its parameters. Only where a body creates Haiku *state* (which would
change the carry) does init fall back to the kit's creation pass first.

At apply the functions handed to JAX are reused across calls (the source's
``reuse_key``) and params ride in the carry instead of being closed over, so that an
identical eager call hits JAX's caches and compiles once.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import jaxoverride as jo
from jaxoverride import adapter_kit as kit, lax as jlax
from jaxoverride_haiku._frames import state_usable
from jaxoverride_haiku._source import HaikuSource


def _through(combinator: Callable[..., Any], where: str) -> Callable[..., Any]:
    def threaded(lower: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return combinator(HaikuSource(where), lower, *args, **kwargs)

    return threaded


# -- map -------------------------------------------------------------------------------


_map_steps: weakref.WeakKeyDictionary[Any, dict[bool, Callable[..., Any]]] = (
    weakref.WeakKeyDictionary()
)


def _map_step(f: Callable[..., Any], batched: bool) -> Callable[..., Any]:
    """The scan body of ``map(f)``, one per function (held weakly), so scan can reuse it."""

    def step_of(get: Callable[[], Any]) -> Callable[..., Any]:
        def step(_: Any, x: Any) -> Any:
            function = get()
            return (), (jo.vmap(function) if batched else function)(x)

        return step

    try:
        steps = _map_steps.setdefault(f, {})
        ref = weakref.ref(f)
    except TypeError:
        return step_of(lambda: f)
    step = steps.get(batched)
    if step is None:
        step = steps[batched] = step_of(ref)
    return step


def _lax_map(
    lower: Callable[..., Any], f: Callable[..., Any], xs: Any, *, batch_size: int | None
) -> Any:
    """``lax.map`` as JAX writes it, in terms of the neutral ``scan`` and ``vmap``.

    JAX's map has no carry to thread state through; like ``hk.map``, this one is a scan
    (each element sees the state the previous one left), and with ``batch_size`` a scan
    of ``vmap``s (state is shared across a batch, as in ``jaxoverride.vmap``).
    """
    del lower
    if batch_size is None:
        _, ys = jlax.scan(_map_step(f, batched=False), (), xs)
        return ys
    blocks = lambda xs: jlax.scan(_map_step(f, batched=True), (), xs)[1]
    return kit.batched_map(blocks, jo.vmap(f), xs, batch_size)


OVERRIDES: dict[str, Callable[..., Any]] = kit.control_flow_overrides(
    state_usable,
    scan=_through(kit.threaded_scan, "jaxoverride.lax.scan"),
    while_loop=_through(kit.threaded_while_loop, "jaxoverride.lax.while_loop"),
    fori_loop=_through(kit.threaded_fori_loop, "jaxoverride.lax.fori_loop"),
    cond=_through(kit.threaded_cond, "jaxoverride.lax.cond"),
    switch=_through(kit.threaded_switch, "jaxoverride.lax.switch"),
    lax_map=_lax_map,
    module=__name__,
)
"""Neutral name -> Haiku override, for the control flow."""
