"""The neutral transforms and calls of the top-level namespace."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import jax

if TYPE_CHECKING:
    from jaxoverride._signatures import (
        EvalShape,
        JitTransform,
        SameParametersTransform,
        SameTypeTransform,
        ValueAndGradTransform,
    )
from jaxoverride._neutral import (
    NeutralRule,
    ReturnValue,
    _check_rule_function,
    neutral_call,
    neutral_transform,
)

# Each keeps the signature of the function it takes, for type checkers (``_signatures``).
jit = cast("JitTransform", neutral_transform("jit", jax.jit))
vmap = cast("SameTypeTransform", neutral_transform("vmap", jax.vmap))
pmap = cast("SameParametersTransform", neutral_transform("pmap", jax.pmap))
grad = cast("SameParametersTransform", neutral_transform("grad", jax.grad))
value_and_grad = cast(
    "ValueAndGradTransform", neutral_transform("value_and_grad", jax.value_and_grad)
)
jacfwd = cast("SameParametersTransform", neutral_transform("jacfwd", jax.jacfwd))
jacrev = cast("SameParametersTransform", neutral_transform("jacrev", jax.jacrev))
hessian = cast("SameParametersTransform", neutral_transform("hessian", jax.hessian))
checkpoint = cast("SameTypeTransform", neutral_transform("checkpoint", jax.checkpoint))
remat = cast("SameTypeTransform", neutral_transform("remat", jax.remat))
shard_map = neutral_transform("shard_map", jax.shard_map)
make_jaxpr = cast("SameParametersTransform", neutral_transform("make_jaxpr", jax.make_jaxpr))

jvp = neutral_call("jvp", jax.jvp)
vjp = neutral_call("vjp", jax.vjp)
linearize = neutral_call("linearize", jax.linearize)
eval_shape = cast("EvalShape", neutral_call("eval_shape", jax.eval_shape))
closure_convert = neutral_call("closure_convert", jax.closure_convert)


class custom_vjp(NeutralRule[ReturnValue], jax_class=jax.custom_vjp):  # noqa: N801  (JAX's name)
    def defvjp(
        self,
        fwd: Callable[..., tuple[ReturnValue, Any]],
        bwd: Callable[..., tuple[Any, ...]],
        symbolic_zeros: bool = False,
        optimize_remat: bool = False,
    ) -> Any:
        """Defines the forward and backward rules, as ``jax.custom_vjp.defvjp``.

        Returns what JAX's returns, with JAX's object replaced by this one: ``None``, or
        under ``jax_custom_vjp3`` in JAX 0.8.1 to 0.11.0 the rule itself (for chaining;
        ``custom_vjp3.defvjp`` returns ``None`` again in 0.11.2).
        """
        for rule, role in ((fwd, "fwd (the forward rule)"), (bwd, "bwd (the backward rule)")):
            _check_rule_function(
                rule, role, "jaxoverride.custom_vjp.defvjp", "f.defvjp(my_fwd, my_bwd)"
            )
        options = {"symbolic_zeros": symbolic_zeros, "optimize_remat": optimize_remat}
        return self._define("defvjp", (fwd, bwd), options)

    # JAX's own signature (annotated ``-> None``): what ``inspect.signature`` shows is JAX's,
    # although under ``jax_custom_vjp3`` some releases return the rule.
    defvjp.__signature__ = inspect.signature(jax.custom_vjp.defvjp)  # type: ignore[attr-defined]


class custom_jvp(NeutralRule[ReturnValue], jax_class=jax.custom_jvp):  # noqa: N801  (JAX's name)
    def defjvp(
        self,
        jvp: Callable[..., tuple[ReturnValue, ReturnValue]],
        symbolic_zeros: bool = False,
    ) -> Callable[..., tuple[ReturnValue, ReturnValue]]:
        """Defines the JVP rule, as ``jax.custom_jvp.defjvp``; usable as a decorator."""
        _check_rule_function(
            jvp, "jvp (the JVP rule)", "jaxoverride.custom_jvp.defjvp", "f.defjvp(my_jvp)"
        )
        self._define("defjvp", (jvp,), {"symbolic_zeros": symbolic_zeros})
        return jvp

    def defjvps(self, *jvps: Callable[..., ReturnValue] | None) -> None:
        """Defines one JVP per argument, as ``jax.custom_jvp.defjvps``."""
        for jvp in jvps:
            if jvp is not None:
                where, example = "jaxoverride.custom_jvp.defjvps", "f.defjvps(my_jvp_of_x, None)"
                _check_rule_function(jvp, "each jvp (or None)", where, example)
        self._define("defjvps", jvps, {})
