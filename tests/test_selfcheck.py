"""``python -m jaxoverride`` and ``jaxoverride.self_check()``."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import jaxoverride as jo

ROOT = Path(__file__).resolve().parents[1]


def _command(*arguments: str) -> subprocess.CompletedProcess[str]:
    environment = {
        **os.environ,
        # The checkout first; what the caller's PYTHONPATH adds (frameworks outside
        # site-packages) stays reachable.
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "src"), str(ROOT / "adapters"), os.environ.get("PYTHONPATH", "")]
        ),
    }
    return subprocess.run(
        [sys.executable, "-m", "jaxoverride", *arguments],
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
        cwd=ROOT,
    )


def test_command_prints_versions_without_importing_the_frameworks():
    result = _command()
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    for distribution in ("jax", "jaxlib", "flax", "dm-haiku", "optimistix", "diffrax", "optax"):
        version = importlib.metadata.version(distribution)
        assert f"  {distribution} {version}\n" in out or f"  {distribution} {version} (" in out
    # Versions come from metadata: the frameworks are reported, not imported.
    assert "  flax " + importlib.metadata.version("flax") + "\n" in out
    assert "  dm-haiku " + importlib.metadata.version("dm-haiku") + "\n" in out
    assert "jaxoverride_haiku: available, not imported" in out
    assert "Missing-adapter check:\n  on" in out
    assert "none of the solver libraries is imported" in out


def test_command_names_raw_import_time_transforms_and_the_fix():
    result = _command("--import", "optimistix")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert re.search(r"\n  optimistix: [1-9]\d* \(optimistix\.", out), out
    assert "Fix: call jaxoverride.interpose_on_import(" in out
    assert "'equinox'" in out and "'optimistix'" in out


def test_command_rejects_unknown_arguments():
    result = _command("--bogus")
    assert result.returncode == 2 and "unknown argument '--bogus'" in result.stdout


def test_self_check_reports_this_process_adapters_and_interposition():
    import jaxoverride_haiku

    handle = jaxoverride_haiku.install()
    try:
        report = jo.self_check(packages=["no_such_solver"])
    finally:
        handle.uninstall()
        jaxoverride_haiku.uninstall()
    assert "jaxoverride_haiku: imported; installed" in report
    assert "interpose_on_import watches:" in report
    assert "Raw import-time transforms" in report
