"""The built wheel: what it contains, and that it installs and imports in a new venv.

The wheel is built once per session with ``pip wheel --no-deps`` (the pyproject's
hatchling backend; the only download is hatchling from the package index, and none when
hatchling is already installed). The install test makes a fresh venv, installs the wheel
with its ``haiku`` and ``nnx`` extras pinned to the versions of this test environment (so
pip takes them from its cache), and imports the three packages from there.
"""

from __future__ import annotations

import email.parser
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
# Every top-level package of the source tree: the core and each adapter.
PACKAGES = sorted(
    p.name
    for base in ("src", "adapters")
    for p in (ROOT / base).iterdir()
    if (p / "__init__.py").is_file()
)


def _pip(python: str | Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    # PYTHONPATH is dropped so that the source tree can never stand in for the installed wheel.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return subprocess.run(
        [str(python), "-m", "pip", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    isolation = [] if importlib.util.find_spec("hatchling") is None else ["--no-build-isolation"]
    result = _pip(sys.executable, "wheel", "--no-deps", "-q", *isolation, str(ROOT), "-w", str(out))
    assert result.returncode == 0, result.stderr[-4000:]
    (built,) = out.glob("jaxoverride-*.whl")
    return built


def test_packages_are_found():
    assert {"jaxoverride", "jaxoverride_haiku", "jaxoverride_nnx", "jaxoverride_plain"} <= set(
        PACKAGES
    )


def test_wheel_holds_license_and_every_package_typed(wheel: Path):
    names = set(zipfile.ZipFile(wheel).namelist())
    dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
    license_file = f"{dist_info}/licenses/LICENSE"
    assert license_file in names, sorted(n for n in names if n.startswith(dist_info))
    assert zipfile.ZipFile(wheel).read(license_file) == (ROOT / "LICENSE").read_bytes()
    for package in PACKAGES:
        source = next(
            (ROOT / b / package) for b in ("src", "adapters") if (ROOT / b / package).is_dir()
        )
        assert f"{package}/py.typed" in names, f"{package} ships without py.typed"
        modules = {f"{package}/{p.relative_to(source).as_posix()}" for p in source.rglob("*.py")}
        missing = modules - names
        assert not missing, f"{package}: modules missing from the wheel: {sorted(missing)}"
    # Nothing but the packages and the metadata: no tests, docs or benchmarks.
    tops = {n.split("/")[0] for n in names}
    assert tops == {*PACKAGES, dist_info}, tops - {*PACKAGES, dist_info}


def _pins(constraints: Path) -> dict[str, str]:
    """The ``name==version`` lines of a pip constraints file."""
    return dict(
        line.split("==")
        for line in constraints.read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )


def test_wheel_metadata_states_the_supported_range(wheel: Path):
    archive = zipfile.ZipFile(wheel)
    metadata = email.parser.Parser().parsestr(
        archive.read(
            next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        ).decode()
    )
    assert metadata["License-Expression"] == "Apache-2.0"
    lower = {}
    for line in metadata.get_all("Requires-Dist") or []:
        requirement = Requirement(line)
        lower.setdefault(requirement.name, set()).update(
            s.version for s in requirement.specifier if s.operator == ">="
        )
    oldest = _pins(ROOT / "ci" / "oldest.txt")
    # The oldest set that CI tests is exactly the lower bound that the wheel declares.
    for name in ("jax", "jaxlib", "flax", "dm-haiku"):
        assert lower[name] == {oldest[name]}, (name, lower[name], oldest[name])
    # The newest set that CI tests (make test-newest) is inside the declared range.
    newest = _pins(ROOT / "ci" / "newest.txt")
    for line in metadata.get_all("Requires-Dist") or []:
        requirement = Requirement(line)
        if requirement.name in newest:
            assert requirement.specifier.contains(newest[requirement.name]), (line, newest)
    assert {"jax", "jaxlib", "flax", "dm-haiku"} <= newest.keys()


@pytest.mark.slow
def test_wheel_installs_and_imports_in_a_new_venv(wheel: Path, tmp_path: Path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    # The dependencies at this environment's versions: pip resolves them from its cache.
    pins = tmp_path / "pins.txt"
    pins.write_text(
        "".join(
            f"{d.metadata['Name']}=={d.version}\n"
            for d in importlib.metadata.distributions()
            if d.metadata["Name"] and d.metadata["Name"].lower() != "jaxoverride"
        )
    )
    result = _pip(
        python, "install", "-q", "-c", str(pins), f"jaxoverride[haiku,nnx] @ {wheel.as_uri()}"
    )
    assert result.returncode == 0, result.stderr[-4000:]
    script = (
        "import jaxoverride, jaxoverride_haiku, jaxoverride_nnx\n"
        "import jax.numpy as jnp\n"
        "print(jaxoverride.__file__)\n"
        "print(float(jaxoverride.jit(lambda x: 2 * x)(jnp.float32(3.0))))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run(
        [str(python), "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    where, value = run.stdout.split()
    assert Path(where).is_relative_to(env_dir), f"imported {where}, not the installed wheel"
    assert value == "6.0"
