"""``ci/jax_suites.py`` rebinds a JAX test module's names to the neutral API, and only those.

The runner itself needs a JAX checkout and runs for many minutes (see ``docs/design.md``,
"Running JAX's own suites"); this checks its rebinding on a small module
written like JAX's suites.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import jaxoverride as jo
from jaxoverride import lax as jlax

CI = pathlib.Path(__file__).resolve().parent.parent / "ci"

SUITE = '''"""A suite."""
import jax
import jax.numpy as jnp
from jax import grad, jit
from jax import lax
from jax._src import api
from jax._src import custom_derivatives

@jax.custom_vjp
def at_import(x):
    return x
'''


def _runner():
    sys.path.insert(0, str(CI))
    try:
        import jax_suites
    finally:
        sys.path.remove(str(CI))
    return jax_suites


def test_the_rebinding_line_follows_the_imports_and_rebinds_the_neutral_names(tmp_path):
    runner = _runner()
    source = runner._with_rebinding(SUITE)
    lines = source.splitlines()
    assert lines[7].startswith("import jax_suites") and lines[6].startswith("from jax._src")
    path = tmp_path / "sample_suite_test.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("sample_suite_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(CI))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(CI))
    assert module.jax.custom_vjp is jo.custom_vjp and module.jax.jit is jo.jit
    assert module.jax.lax is jlax and module.lax is jlax
    assert module.grad is jo.grad and module.jit is jo.jit
    assert module.api.vmap is jo.vmap and module.api.device_put is jax.device_put
    assert module.custom_derivatives.custom_jvp is jo.custom_jvp
    assert module.custom_derivatives.SymbolicZero is jax.custom_derivatives.SymbolicZero
    assert module.jax.custom_derivatives.closure_convert is jo.closure_convert
    assert module.jax.numpy is jnp and module.jnp is jnp
    assert isinstance(module.at_import, jo.custom_vjp), "module-level rules are neutral too"


def test_the_default_suites_include_jaxs_control_flow_suite():
    assert _runner().SUITES == (
        "lax_control_flow_test",
        "custom_api_test",
        "custom_root_test",
        "custom_linear_solve_test",
    )


def test_next_sets_each_flag_this_jax_has_through_its_environment_variable():
    """``--next on`` turns on, in the pytest process, every next flag this JAX declares, and
    ``--next off`` turns each off whatever the caller's environment says."""
    runner = _runner()
    flags = list(runner.next_flags().available())
    if not flags:  # jax_custom_vjp3, the first of them, came in jax 0.9.1
        pytest.skip(f"jax {jax.__version__} declares none of JAX's next flags (0.9.1 and later do)")
    read = f"import jax; print([jax.config.values[f] for f in {flags!r}])"
    for on in (True, False):
        env = {**os.environ, **{flag.upper(): "0" if on else "1" for flag in flags}}
        env.update(runner.flag_environment(flags, on))
        shown = subprocess.run(
            [sys.executable, "-c", read], env=env, capture_output=True, text=True, check=True
        )
        assert shown.stdout.strip() == str([on] * len(flags)), shown.stderr


def test_the_first_line_says_how_the_runs_set_the_flags():
    """The runner's own process has the flags as the caller's environment left them (off,
    usually); the line must say the runs turn them on, not only that they are off here."""
    runner = _runner()
    flags = ["jax_custom_vjp3", "jax_remat3"]
    record = "jax 0.12.0.1: next flags jax_custom_vjp3=off, jax_remat3=off"
    assert runner.header(record, flags, [True]) == (
        f"{record}; the runs set jax_custom_vjp3, jax_remat3 on"
    )
    assert runner.header(record, flags, [False, True]).endswith("jax_remat3 off then on")
    assert runner.header("jax 0.8.1: next flags none", [], [False]).endswith("none of them off")


def test_counts_are_per_suite_with_one_line_per_failure(tmp_path):
    report = tmp_path / "report.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="lax_control_flow_test.LaxControlFlowTest" name="testA"/>'
        '<testcase classname="lax_control_flow_test.LaxControlFlowTest" name="testB">'
        '<failure message="SharingError: two positions&#10;more">trace</failure></testcase>'
        '<testcase classname="custom_api_test.CustomJVPTest" name="test_c">'
        '<skipped message="tpu only"/></testcase>'
        '<testcase classname="custom_api_test.CustomVJPTest" name="test_d">'
        '<error message="">trace</error></testcase>'
        "</testsuite></testsuites>"
    )
    per_suite, failures = _runner().counts(report)
    assert per_suite == {
        "lax_control_flow_test": {"passed": 1, "failed": 1, "skipped": 0},
        "custom_api_test": {"passed": 0, "failed": 1, "skipped": 1},
    }
    assert failures == [
        "lax_control_flow_test.LaxControlFlowTest.testB: SharingError: two positions",
        "custom_api_test.CustomVJPTest.test_d: ",
    ]
