"""The examples that run unmodified third-party libraries: jaxopt inside Haiku, and
jaxopt plus optax under ``jaxoverride_debug.trace``. Each checks its own results against
the library run on explicit arrays and raises if they differ."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import debug_trace
import library_jaxopt_haiku


def test_jaxopt_inside_haiku_example(capsys):
    library_jaxopt_haiku.main()
    out = capsys.readouterr().out
    assert "leaked" in out  # the raw library fails first
    calls = int(out.rsplit("counted in Haiku state:", 1)[1])
    assert calls > 2


def test_debug_trace_example(capsys):
    debug_trace.main()
    out = capsys.readouterr().out
    assert "results unchanged" in out
    assert "lax.scan" in out and "lax.while_loop" in out
