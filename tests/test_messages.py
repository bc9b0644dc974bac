"""The texts of the errors a first mistake meets (issue 31 item 13): each names what the
program wrote, counts in the right number, and gives the whole fix."""

from __future__ import annotations

import textwrap

import haiku as hk
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jaxoverride as jo
import jaxoverride_haiku
import jaxoverride_nnx
from _fresh import run_source
from jaxoverride import lax as jlax
from test_errors_shared import haiku_pure_write_model

# The one list of solver packages every message names (optimistix imports lineax and equinox).
EQUINOX_FIX = "jaxoverride.interpose_on_import('equinox', 'lineax', 'optimistix')"


def _haiku_error(with_bias: bool) -> str:
    def forward(x):
        return jlax.fori_loop(0, 2, lambda _, h: hk.Linear(2, with_bias=with_bias)(h), x)

    # No jax.checking_leaks(): the error is raised where the leak happens, inside the trace.
    with pytest.raises(jo.errors.MissingAdapterError) as info:
        hk.transform(forward).init(jax.random.PRNGKey(0), jnp.ones((1, 2)))
    return str(info.value)


def test_haiku_count_leaves_out_its_own_rng_state():
    # `w` and `b`: Haiku's rng key sequence, a tracer too, is not a parameter.
    assert "so 2 of them would be tracers" in _haiku_error(with_bias=True)


def test_one_tracer_is_counted_in_the_singular():
    message = _haiku_error(with_bias=False)
    assert "so 1 of them would be a tracer " in message
    assert "1 of them would be tracers" not in message


def test_wrong_track_names_the_tracked_module_as_the_program_does():
    encoder = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    decoder = nnx.Linear(2, 2, rngs=nnx.Rngs(1))
    with jaxoverride_nnx.track(encoder), pytest.raises(jo.errors.MissingAdapterError) as info:
        jo.jit(lambda x: decoder(x))(jnp.ones(2))
    message = str(info.value)
    assert "`with jaxoverride_nnx.track(encoder, decoder):`" in message
    assert "model" not in message


def test_nnx_closure_convert_refusal_names_the_variable_and_the_key_through_arguments():
    dropout = nnx.Dropout(0.5, rngs=nnx.Rngs(0))
    with (
        jax.checking_leaks(),
        jaxoverride_nnx.track(dropout),
        pytest.raises(jo.errors.PureFunctionWriteError) as info,
    ):
        jo.closure_convert(lambda z: dropout(z), jnp.ones(2))
    message = str(info.value)
    assert "the RngCount `dropout.rngs" in message
    assert "draw the key before the call and pass it in through the solver's arguments" in message
    assert "fpsolve's implicit=False" in message


def test_haiku_pure_function_refusal_suggests_fpsolve_implicit_false_as_linen_does():
    with (
        jax.checking_leaks(),
        jaxoverride_haiku.context(),
        pytest.raises(jo.errors.PureFunctionWriteError) as info,
    ):
        haiku_pure_write_model().init(None, jnp.ones(2))
    assert "fpsolve's implicit=False, jaxopt's implicit_diff=False" in str(info.value)


_NEVER_INTERPOSED = """
    import haiku as hk, jax, jax.numpy as jnp
    import optimistix as optx  # before any interpose_on_import
    import jaxoverride as jo
    import jaxoverride_haiku

    solver = optx.FixedPointIteration(rtol=1e-6, atol=1e-6)

    def forward(x):
        layer = hk.Linear(2, w_init=hk.initializers.RandomNormal(0.1))
        return optx.fixed_point(lambda z, _: jnp.tanh(layer(z) + x), solver, jnp.zeros(2),
                                throw=False).value

    jaxoverride_haiku.install()
    try:
        hk.transform(forward).init(jax.random.PRNGKey(0), jnp.ones(2))
    except jo.errors.MissingAdapterError as error:
        print("FIRST CALL:", error)
    jaxoverride_haiku.uninstall()
    try:
        jo.interpose_on_import("optimistix")
    except jo.ImportOrderError as error:
        print("IMPORT ORDER:", error)
    print("SELF CHECK:", " ".join(jo.self_check().split()))
"""


@pytest.mark.slow
def test_every_never_interposed_message_names_the_same_packages():
    out = run_source(_NEVER_INTERPOSED)
    assert out.returncode == 0, out.stderr
    lines = {line.split(":", 1)[0]: line for line in out.stdout.splitlines() if ":" in line}
    assert set(lines) >= {"FIRST CALL", "IMPORT ORDER", "SELF CHECK"}, out.stdout
    for where in ("FIRST CALL", "IMPORT ORDER", "SELF CHECK"):
        assert EQUINOX_FIX in lines[where], lines[where]


_INSTALL_FORGOTTEN = """
    import jaxoverride as jo
    jo.interpose_on_import("equinox", "lineax", "optimistix")  # done right
    import haiku as hk, jax, jax.numpy as jnp
    import optimistix as optx

    solver = optx.FixedPointIteration(rtol=1e-6, atol=1e-6)

    def forward(x):
        layer = hk.Linear(2, w_init=hk.initializers.RandomNormal(0.1))
        step = lambda z, _: jnp.tanh(layer(z) + x)
        return optx.fixed_point(step, solver, jnp.zeros(2), throw=False).value

    try:  # but jaxoverride_haiku.install() forgotten
        hk.transform(forward).init(jax.random.PRNGKey(0), jnp.ones(2))
    except jo.errors.MissingAdapterError as error:
        print(error)
"""


@pytest.mark.slow
def test_install_forgotten_under_interposition_names_the_call_the_program_made(tmp_path):
    program = tmp_path / "program.py"
    program.write_text(textwrap.dedent(_INSTALL_FORGOTTEN))
    out = run_source(f"import runpy; runpy.run_path({str(program)!r})")
    assert out.returncode == 0, out.stderr
    message = out.stdout
    assert message.startswith("optx.fixed_point (called in forward, at "), message
    assert f"{program} line " in message
    assert "jaxoverride_haiku.install()" in message
    assert not message.startswith("jaxoverride.make_jaxpr")
