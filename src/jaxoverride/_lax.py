"""The neutral control-flow functions of ``jaxoverride.lax``.

Each is named here for static analysis; the JAX function behind it comes from the one
table of overridable names (``_names``).
"""

from __future__ import annotations

from jaxoverride._names import CALLS
from jaxoverride._neutral import neutral_call

scan = neutral_call("lax.scan", CALLS["lax.scan"])
while_loop = neutral_call("lax.while_loop", CALLS["lax.while_loop"])
fori_loop = neutral_call("lax.fori_loop", CALLS["lax.fori_loop"])
cond = neutral_call("lax.cond", CALLS["lax.cond"])
switch = neutral_call("lax.switch", CALLS["lax.switch"])
map = neutral_call("lax.map", CALLS["lax.map"])
custom_root = neutral_call("lax.custom_root", CALLS["lax.custom_root"])
custom_linear_solve = neutral_call("lax.custom_linear_solve", CALLS["lax.custom_linear_solve"])
