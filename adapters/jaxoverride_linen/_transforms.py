"""Overrides of the neutral transforms inside bound Linen modules.

Each transformed function runs with the threaded state installed and returns the state
it left as an auxiliary output JAX does not map or differentiate; at init a creation
pass first calls it outside JAX. ``jit`` calls its function inline: the enclosing
computation is what JAX compiles, so Linen's state never crosses a separate trace.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jaxoverride as jo
from jaxoverride import adapter_kit as kit
from jaxoverride_linen._source import in_bound_module, source

# A function under vmap, grad, vjp or jvp may sow: its call records what it sows first
# (stacked along vmap's axis, as nn.vmap's variable_axes={collection: 0}), and runs again.
_STATE = kit.source_transform_state(
    in_bound_module, source, lambda where: source(where, allow_fresh=True)
)


# -- vmap and pmap ---------------------------------------------------------------------


def _batched_state_error(where: str, err: Exception) -> ValueError:
    return ValueError(
        f"{where}: a Linen variable or rng key written inside the mapped function depends "
        "on the mapped axis. Linen state is shared across the batch (as nn.vmap with "
        "variable_axes={} does): reduce state updates over the batch first (an axis_name "
        f"and lax.pmean), or return per-example values as outputs. JAX said: {err}"
    )


# -- jit -------------------------------------------------------------------------------


def jit(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
    plain = jo.next_impl("jit")(fun, *args, **kwargs)

    @kit.wraps(fun)
    def inline(*call_args: Any, **call_kwargs: Any) -> Any:
        # Inline: the enclosing computation is what JAX compiles, Linen's state one trace.
        if not in_bound_module():
            return plain(*call_args, **call_kwargs)
        return fun(*call_args, **call_kwargs)

    for attribute in ("lower", "trace", "eval_shape", "clear_cache"):
        if hasattr(plain, attribute):
            setattr(inline, attribute, getattr(plain, attribute))
    return inline


OVERRIDES: dict[str, Callable[..., Any]] = {
    **kit.stateful_transforms(
        _STATE, _batched_state_error, mapped=("vmap", "pmap", "shard_map"), module=__name__
    ),
    "jit": jit,
}
"""Neutral name -> Linen override, for the transforms."""
