"""``context()``: the identity-preserving overrides as one reusable context."""

from __future__ import annotations

import jaxoverride as jo
from jaxoverride import adapter_kit as kit
from jaxoverride_dag._checkpoint import dag_checkpoint, dag_eval_shape, dag_remat
from jaxoverride_dag._control import (
    dag_cond,
    dag_fori_loop,
    dag_map,
    dag_scan,
    dag_switch,
    dag_while_loop,
)
from jaxoverride_dag._grad import (
    dag_grad,
    dag_hessian,
    dag_jacfwd,
    dag_jacrev,
    dag_value_and_grad,
)
from jaxoverride_dag._jit import dag_jit
from jaxoverride_dag._pmap import dag_pmap
from jaxoverride_dag._shard_map import dag_shard_map
from jaxoverride_dag._vmap import dag_vmap

TABLE = kit.OverrideTable(
    "jaxoverride_dag",
    {
        "jit": dag_jit,
        "vmap": dag_vmap,
        "pmap": dag_pmap,
        "shard_map": dag_shard_map,
        "grad": dag_grad,
        "value_and_grad": dag_value_and_grad,
        "jacfwd": dag_jacfwd,
        "jacrev": dag_jacrev,
        "hessian": dag_hessian,
        "checkpoint": dag_checkpoint,
        "remat": dag_remat,
        "eval_shape": dag_eval_shape,
        "lax.scan": dag_scan,
        "lax.while_loop": dag_while_loop,
        "lax.fori_loop": dag_fori_loop,
        "lax.cond": dag_cond,
        "lax.switch": dag_switch,
        "lax.map": dag_map,
    },
    # JAX's own (the "DAG adapter" page): these hand JAX arrays and functions, not the user's trees
    # to rebuild, and the transforms around them keep identity.
    passes_through={
        "jvp": "primals and tangents reach JAX as arrays, so nothing to re-share",
        "vjp": "primals reach JAX as arrays, so nothing to re-share",
        "linearize": "primals reach JAX as arrays, so nothing to re-share",
        "make_jaxpr": "a jaxpr holds no pytree identity",
        "closure_convert": "hoists array constants; no pytree is rebuilt",
        "custom_vjp": "a rule's arguments are flattened by JAX, as in raw JAX",
        "custom_jvp": "a rule's arguments are flattened by JAX, as in raw JAX",
        "lax.custom_root": "implicit differentiation over arrays, as in raw JAX",
        "lax.custom_linear_solve": "implicit differentiation over arrays, as in raw JAX",
    },
)

_CONTEXT = TABLE.context()


def context() -> jo.OverrideContext:
    """Makes every neutral transform and control-flow call preserve relative identity.

    Inside it, the neutral transforms and control flow pass pytrees through with their
    sharing intact: positions that held one object hold one (fresh) object inside and in
    the outputs, a shared array is passed once, tied parameters get one summed gradient,
    and non-array leaves are static data. The jit cache is keyed on the sharing pattern
    and the static data, never on object ids.

    Returns:
      The adapter's ``OverrideContext``: one object, reusable and reentrant; a context
      manager, a decorator, and a mapping that ``jaxoverride.override_context`` accepts.

    Example:
      >>> import jax.numpy as jnp, jaxoverride as jo, jaxoverride_dag as dag
      >>> w = jnp.ones(3)
      >>> with dag.context():
      ...     a, b = jo.jit(lambda p: (p["in"], p["out"]))({"in": w, "out": w})
      >>> a is b
      True
    """
    return _CONTEXT
