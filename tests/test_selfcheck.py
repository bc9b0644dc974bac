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


# A fresh interpreter in which the named top-level packages cannot be imported, as if their
# distributions were not installed: a meta-path finder placed first refuses them.
_BLOCKED = """
import importlib.abc, sys

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, Blocker())
from jaxoverride._selfcheck import main
main([])
"""


def test_command_does_not_list_an_adapter_whose_framework_is_absent_as_available():
    from _fresh import run_source

    result = run_source(_BLOCKED.format(blocked={"haiku"}))
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "jaxoverride_haiku: available" not in out
    assert (
        "jaxoverride_haiku: not available, haiku is not installed: "
        "pip install 'jaxoverride[haiku]'" in out
    )
    assert "jaxoverride_nnx: available, not imported" in out  # flax is still there
    assert "jaxoverride_dag: available, not imported" in out  # it needs nothing more

    result = run_source(_BLOCKED.format(blocked={"flax"}))
    assert result.returncode == 0, result.stderr[-3000:]
    for adapter in ("jaxoverride_nnx", "jaxoverride_linen"):
        assert f"{adapter}: not available, flax is not installed" in result.stdout


def test_help_is_plain_text():
    result = _command("--help")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "``" not in result.stdout and "`" not in result.stdout
    assert result.stdout.startswith("usage: python -m jaxoverride [--import PACKAGE ...]")
    assert "--import PACKAGE" in result.stdout


def _declared_range(distribution: str) -> str:
    """The range jaxoverride's installed metadata states for ``distribution``."""
    for line in importlib.metadata.requires("jaxoverride") or []:
        name = re.match(r"[A-Za-z0-9._-]+", line)
        if name and name[0] == distribution:
            return line[len(distribution) :].split(";")[0].strip().replace(" ", "")
    raise AssertionError(f"jaxoverride does not require {distribution}")


def test_self_check_says_whether_jax_flax_and_haiku_are_inside_the_supported_range():
    report = jo.self_check()
    assert "Supported versions (jaxoverride's requirements):" in report
    for distribution in ("jax", "flax", "dm-haiku"):
        version = importlib.metadata.version(distribution)
        line = f"  {distribution} {version}: inside the range (supported: "
        line += _declared_range(distribution)
        assert line in report, report


def test_self_check_flags_a_version_outside_the_range(monkeypatch):
    from jaxoverride import _selfcheck

    real = _selfcheck._version
    monkeypatch.setattr(
        _selfcheck, "_version", lambda name: "0.99.0" if name == "flax" else real(name)
    )
    report = jo.self_check()
    assert "  flax 0.99.0: OUTSIDE the supported range (supported: " in report
    assert "for the 'linen' and 'nnx' extras" in report
