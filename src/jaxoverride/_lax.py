"""The neutral control-flow functions of ``jaxoverride.lax``."""

from __future__ import annotations

import jax

from jaxoverride._neutral import neutral_call

scan = neutral_call("lax.scan", jax.lax.scan)
while_loop = neutral_call("lax.while_loop", jax.lax.while_loop)
fori_loop = neutral_call("lax.fori_loop", jax.lax.fori_loop)
cond = neutral_call("lax.cond", jax.lax.cond)
switch = neutral_call("lax.switch", jax.lax.switch)
map = neutral_call("lax.map", jax.lax.map)
custom_root = neutral_call("lax.custom_root", jax.lax.custom_root)
custom_linear_solve = neutral_call("lax.custom_linear_solve", jax.lax.custom_linear_solve)
