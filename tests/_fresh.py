"""Python source run in a fresh interpreter, for the tests where import order is the point."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_source(source: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Runs the dedented ``source`` with ``python -c`` in a fresh interpreter.

    It runs from the repository root, with this checkout's ``src`` and ``adapters`` first
    on its path, in this process's environment plus ``env``; it may take 300 s.

    Example:
      >>> run_source("print(6 * 7)").stdout
      '42\\n'
    """
    environment = {
        **os.environ,
        # The checkout first; what the caller's PYTHONPATH adds (frameworks outside
        # site-packages) stays reachable.
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "src"), str(ROOT / "adapters"), os.environ.get("PYTHONPATH", "")]
        ),
        **env,
    }
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source)],
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
        cwd=ROOT,
    )


# Source for a fresh interpreter: the check that a run raises jaxoverride's
# MissingAdapterError, shared by the tests that must see that error in a process of its own.
MISSING_ADAPTER_MESSAGE = """
import jaxoverride as _jo


def missing_adapter_message(run, silently):
    '''The text of the MissingAdapterError that ``run()`` raises; ``silently`` says what
    went wrong where it raises none.'''
    try:
        run()
    except _jo.errors.MissingAdapterError as error:
        return str(error)
    raise AssertionError(silently)
"""

# A library of the program's own: a transform built with raw JAX while it is imported, so
# that no guard reaches it once its caller binds ``step`` by name.
RAW_JIT_LIBRARY = """
import functools

import jax


@functools.partial(jax.jit, static_argnums=0)
def step(fun, x):
    return fun(x)
"""

# Source for a fresh interpreter that imports RAW_JIT_LIBRARY as ``mylib``: the checks of
# the error that names the fix for it (``interpose_on_import('mylib')``).
RAW_JIT_CHECKS = (
    MISSING_ADAPTER_MESSAGE
    + """

def tracers(tree):
    return [l for l in jax.tree_util.tree_leaves(tree) if isinstance(l, jax.core.Tracer)]


def raw_jit_error(run, silently):
    '''The MissingAdapterError's text that ``run()`` raises, checked to name mylib's fix.'''
    message = missing_adapter_message(run, silently)
    assert "'mylib' (1)" in message, message
    assert "jaxoverride.interpose_on_import('mylib')" in message, message
    assert "jaxoverride.set_adapter_check(False)" in message, message
    return message
"""
)


def run_with_raw_jit_library(tmp_path: Path, prelude: str, body: str) -> str:
    """Runs ``prelude`` (formatted with ``path``), RAW_JIT_CHECKS and then ``body`` in a fresh
    interpreter that imports RAW_JIT_LIBRARY from ``tmp_path`` as ``mylib``.

    Args:
      tmp_path: a folder of the test's own, where ``mylib.py`` is written.
      prelude: source that puts ``{path}`` on ``sys.path`` and imports ``jax`` and mylib.
      body: the test's source; it may be indented, as a triple-quoted string is.

    Returns:
      What the interpreter printed; it must exit with 0.

    Example:
      >>> run_with_raw_jit_library(tmp_path, "import sys, jax; sys.path.insert(0, {path!r})",
      ...                          "from mylib import step; print(step(abs, -1))")
      '1\\n'
    """
    (tmp_path / "mylib.py").write_text(RAW_JIT_LIBRARY)
    source = (
        textwrap.dedent(prelude).format(path=str(tmp_path)) + RAW_JIT_CHECKS + textwrap.dedent(body)
    )
    result = run_source(source)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout
