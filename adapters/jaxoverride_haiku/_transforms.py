"""Overrides of the neutral transforms that trace their function once per call.

``vmap``, the ``grad`` family, ``checkpoint``/``remat``, ``jvp``, ``vjp``, ``linearize`` and
``eval_shape``: the function runs in a Haiku frame built from the caller's state, closed
over, and returns what changed (``stateful.difference``) as an auxiliary output JAX does
not map or differentiate: a counter increments once per call, keys are drawn as without
the transform. A new traced function per call keeps JAX's caches from replaying a stale
Haiku trace.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jaxoverride as jo
from jaxoverride import adapter_kit as kit
from jaxoverride_haiku._creation import init_safe_call
from jaxoverride_haiku._frames import (
    Threaded,
    policy_left,
    policy_received,
    policy_state,
    solve_policy,
    state_usable,
)
from jaxoverride_haiku._rng import update_state


class TracedCall(kit.StatefulCall):
    """One call of a function that a JAX transform traces once, Haiku state threaded."""

    __slots__ = ("policy", "received", "thread")

    def __init__(self, where: str):
        # Under ``jaxoverride.solve_state``: the call starts from the frozen state and
        # writes through the declaration; running no evaluation, it leaves ``received``
        # (closed over: the trace is made per call, never cached).
        self.policy = solve_policy()
        self.received = policy_received(self.policy)
        super().__init__(policy_state(self.policy))
        self.thread = Threaded(1, where, check_params=False)

    def traced(self, state: Any, thunk: Callable[[], Any]) -> tuple[Any, Any]:
        """``thunk()`` in a frame holding ``state``; returns ``(out, what_changed)``."""
        policy = self.policy
        with self.thread.frame(0, state):
            frame = None if policy is None else policy.push(state, received=self.received)
            try:
                out = thunk()
                changed = policy_left(policy, frame, state)
            finally:
                if policy is not None and frame is not None:
                    policy.pop(frame)
        return out, changed

    def finish(self, left: Any) -> None:
        update_state(left if self.policy is None else self.policy.written(left))
        self.thread.finish()
        # JAX may keep the traced function (pmap's cache of its shard_map), and with it
        # this call: it must not keep the caller's trace's values.
        self.state = self.received = None


_STATE = kit.TransformState(
    active=state_usable,
    begin=TracedCall,
    # At init a parameter created inside comes out in the difference: no creation pass.
    init_safe=lambda where, creation, apply: apply(),
)


def _batched_state_error(where: str, err: Exception) -> ValueError:
    return ValueError(
        f"{where}: a Haiku parameter, state value or rng key computed inside the "
        "mapped function depends on the mapped axis. Haiku state is shared across the batch "
        "(as with hk.vmap(split_rng=False)): parameters must be created from rng and "
        "shapes only, and state updates must not depend on mapped inputs (reduce over the "
        "batch with an axis_name first, or keep per-example values in the outputs). "
        f"JAX said: {err}"
    )


TRANSFORMS = kit.stateful_transforms(_STATE, _batched_state_error, module=__name__)
"""Neutral name -> Haiku override, for the transforms that trace once per call."""


# -- eval_shape ------------------------------------------------------------------------


def _concrete(tree: Any) -> Any:
    """What ``eval_shape`` traces ``fun`` on, made concrete for the creation pass."""
    return kit.as_jax_operands(kit.zeros_for(tree))


def eval_shape(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    below = jo.next_impl("eval_shape")
    if not state_usable():
        return below(fun, *args, **kwargs)

    def creation() -> None:
        fun(*_concrete(args), **_concrete(kwargs))

    def apply() -> Any:
        # As hk.eval_shape: state changes and rng draws are discarded; modules made
        # inside still take their names.
        call = TracedCall("jaxoverride.eval_shape")
        pure = kit.wraps(fun)(lambda *a, **k: call.run(fun, a, k)[0])
        out = below(pure, *args, **kwargs)
        call.thread.finish()
        return out

    return init_safe_call(creation, apply)
