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
