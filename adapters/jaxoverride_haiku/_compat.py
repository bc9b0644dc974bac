"""The private Haiku names the Haiku adapter uses, each with the reason.

The JAX names it needed (``resolve_argnums``, ``_batch_and_remainder``) are the kit's now
(``jaxoverride.adapter_kit``), listed in the core's ``PRIVATE_SYMBOLS``.
"""

from __future__ import annotations

try:
    from jax.extend.core import (
        set_current_trace as set_current_trace,
        take_current_trace as take_current_trace,
    )
except ImportError:  # JAX 0.8: the same functions, public under jax.core only.
    from jax.core import (  # type: ignore[no-redef]
        set_current_trace as set_current_trace,  # type: ignore[attr-defined]
        take_current_trace as take_current_trace,  # type: ignore[attr-defined]
    )

_STATE = "Haiku's state threading (what hk.transform does inside), which has no public API"
_STACK = "a stack that a jitted call must replay (hk.custom_creator/getter/setter push onto it)"

PRIVATE_SYMBOLS: dict[str, str] = {
    "haiku._src.config.get_config": (
        "the size of the rng block that PRNGSequence.__next__ splits (hk.config sets it, "
        "with no getter): a salted creation key is computed in one call, as Haiku splits"
    ),
    "haiku._src.base.Frame": "the type of the frame holding a transform's params, state, rng",
    "haiku._src.base.HaikuContext": "the object hk.transform enters; install() hooks its entry",
    "haiku._src.base.StatePair": "the (initial, current) record of a state entry, put back",
    "haiku._src.base.current_frame": "the frame of the innermost transform",
    "haiku._src.base.custom_creator_unsafe": "salts the rng of creators it must run again",
    "haiku._src.base.frame_stack": "whether a transform is active (cheaper than running_init)",
    "haiku._src.base.param_names": "the parameters a loop body created, to refuse new ones",
    "haiku._src.base.push_jax_trace_level": "lets Haiku modules run under the adapter's trace",
    "haiku._src.base.param_creator_stack": _STACK,
    "haiku._src.base.param_getter_stack": _STACK,
    "haiku._src.base.state_creator_stack": _STACK,
    "haiku._src.base.state_getter_stack": _STACK,
    "haiku._src.base.state_setter_stack": _STACK,
    "haiku._src.module.interceptor_stack": _STACK,
    "haiku._src.data_structures.Stack": "the type of those stacks, pushed onto in a rule",
    "haiku._src.stateful.InternalState": _STATE,
    "haiku._src.stateful.copy_structure": _STATE,
    "haiku._src.stateful.difference": _STATE,
    "haiku._src.stateful.internal_state": _STATE,
    "haiku._src.stateful.temporary_internal_state": _STATE,
    "haiku._src.stateful.update_internal_state": _STATE,
}
"""Every private upstream name the Haiku adapter uses, with why no public name serves.

Read, with the same signatures, in Haiku 0.0.13, 0.0.15, 0.0.16, 0.0.17 (tested) and main at
0.0.17.dev (2026-07-09), and for the JAX names in JAX 0.8.1 and 0.10.2 (tested), 0.11.0 and
main at 0.11.1.dev (2026-08-08). ``ci/private_symbols.py`` re-checks them against git
checkouts; ``tests/test_private_symbols.py`` fails when the adapter uses a private name not
listed here, or one that has a public name.
"""


__all__ = ["PRIVATE_SYMBOLS", "set_current_trace", "take_current_trace"]
