"""``pytest --jax-next``: JAX's next flags on for a session, and the record of which exist.

The parity suites run under JAX's next custom rules and remat with
``pytest --jax-next=all tests/test_parity_*.py`` (``make test-next``); see
``tests/_next_flags.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

import _next_flags

ROOT = Path(__file__).resolve().parent.parent


def _version() -> tuple[int, ...]:
    return tuple(int(part) for part in jax.__version__.split(".")[:3] if part.isdigit())


def test_the_record_names_the_flags_this_jax_has_and_those_it_lacks():
    flags = _next_flags.available()
    # Read in JAX's jax/_src/config.py at each tag: custom_vjp3 from 0.9.1, remat3 from
    # 0.10.2, custom_jvp3 after 0.11.0.
    assert ("jax_custom_vjp3" in flags) == (_version() >= (0, 9, 1))
    assert ("jax_remat3" in flags) == (_version() >= (0, 10, 2))
    if _version() <= (0, 11, 0):
        assert "jax_custom_jvp3" not in flags
    line = _next_flags.record()
    assert all(f"{flag}=" in line for flag in flags), line
    absent = [flag for flag in _next_flags.NEXT_FLAGS if flag not in flags]
    if absent:
        assert line.endswith(f"; absent: {', '.join(absent)}"), line
    else:
        assert "absent" not in line, line


def test_the_option_is_read_and_wrong_names_are_refused():
    assert _next_flags.selected("none") == ()
    assert _next_flags.selected("all") == _next_flags.available()
    with pytest.raises(ValueError, match="unknown flags \\['jax_custom_vjp4'\\]"):
        _next_flags.selected("jax_custom_vjp3,jax_custom_vjp4")
    for flag in set(_next_flags.NEXT_FLAGS) - set(_next_flags.available()):
        with pytest.raises(ValueError, match=f"has no {flag}"):
            _next_flags.selected(flag)


def test_turned_on_puts_every_value_back_even_on_failure():
    flags = _next_flags.available()
    before = {flag: jax.config.values[flag] for flag in flags}
    seen = []

    def fails_inside() -> None:
        with _next_flags.turned_on(flags):
            seen.extend(jax.config.values[flag] for flag in flags)
            raise RuntimeError

    with pytest.raises(RuntimeError):
        fails_inside()
    assert seen == [True] * len(flags)
    assert {flag: jax.config.values[flag] for flag in flags} == before


def test_the_session_s_flags_are_what_the_option_asked(request):
    """In a default session every flag is off here (a module that turned one on put it
    back); under ``--jax-next=all`` every flag this JAX has is on."""
    on = _next_flags.selected(request.config.getoption("--jax-next"))
    for flag in _next_flags.available():
        if f"JAX_{flag[4:].upper()}" not in os.environ:  # an explicit choice of the caller
            assert jax.config.values[flag] == (flag in on), flag


@pytest.mark.slow
def test_the_option_turns_the_flags_on_before_the_tests_are_imported():
    """A fresh session with ``--jax-next=all``: its header records the flags on, and the
    check above passes there too."""
    if not _next_flags.available():
        pytest.skip(f"jax {jax.__version__} has none of {_next_flags.NEXT_FLAGS}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    test = f"{Path(__file__).name}::test_the_session_s_flags_are_what_the_option_asked"
    command = [sys.executable, "-m", "pytest", "-p", "no:randomly", "--jax-next=all"]
    result = subprocess.run(
        [*command, "-p", "no:cacheprovider", f"tests/{test}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert all(f"{flag}=on" in result.stdout for flag in _next_flags.available()), result.stdout
    refused = subprocess.run(
        [*command[:-1], "--jax-next=jax_custom_vjp4", "--co", "-q", f"tests/{test}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert refused.returncode == pytest.ExitCode.USAGE_ERROR
    assert "unknown flags ['jax_custom_vjp4']" in refused.stderr
