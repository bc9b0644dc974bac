"""The neutral transforms and calls of the top-level namespace."""

from __future__ import annotations

import jax

from jaxoverride._neutral import neutral_call, neutral_transform

jit = neutral_transform("jit", jax.jit)
vmap = neutral_transform("vmap", jax.vmap)
pmap = neutral_transform("pmap", jax.pmap)
grad = neutral_transform("grad", jax.grad)
value_and_grad = neutral_transform("value_and_grad", jax.value_and_grad)
jacfwd = neutral_transform("jacfwd", jax.jacfwd)
jacrev = neutral_transform("jacrev", jax.jacrev)
hessian = neutral_transform("hessian", jax.hessian)
checkpoint = neutral_transform("checkpoint", jax.checkpoint)
remat = neutral_transform("remat", jax.remat)
shard_map = neutral_transform("shard_map", jax.shard_map)

jvp = neutral_call("jvp", jax.jvp)
vjp = neutral_call("vjp", jax.vjp)
linearize = neutral_call("linearize", jax.linearize)
eval_shape = neutral_call("eval_shape", jax.eval_shape)
