"""``ci/private_symbols.py``: the audit reads installed releases and a clone's tag history.

The newest releases (jax 0.12.0.1, flax 0.12.12, dm-haiku 0.0.17) have no tag in the
clones the audit reads, so it reads their installed sources (``--site``); ``--since`` says
which release tag introduced each name at its module path.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import sysconfig
from pathlib import Path

import jax
import pytest

CI = Path(__file__).resolve().parent.parent / "ci"


def _audit():
    spec = importlib.util.spec_from_file_location("private_symbols", CI / "private_symbols.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_installed_releases_have_every_listed_name():
    audit = _audit()
    site = Path(sysconfig.get_paths()["purelib"])
    assert audit.installed_version(site, "jax") == jax.__version__
    names = sorted(audit.listed())
    missing = audit.check(audit.site_source(site), names)
    flax_version = tuple(int(part) for part in audit.installed_version(site, "flax").split(".")[:3])
    if flax_version < (0, 12, 5):
        # Flax 0.12.5 renamed flax.nnx.graph to graphlib and added DataElem/StaticElem there;
        # the NNX adapter's _compat imports the older module and falls back for those two.
        assert all(name.startswith("flax.nnx.graphlib.") for name in missing), missing
    else:
        assert missing == []
    assert audit.check(audit.site_source(site), ["jax._src.util.no_such_name"]) == [
        "jax._src.util.no_such_name"
    ]


def _git(folder: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(folder), *args], check=True, capture_output=True)


def test_since_names_the_first_release_tag_and_the_gaps(tmp_path):
    audit = _audit()
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "config", "user.email", "audit@example.com")
    _git(tmp_path, "config", "user.name", "audit")
    module = tmp_path / "haiku" / "_src" / "base.py"
    module.parent.mkdir(parents=True)
    for tag, source in [
        ("v0.0.9", "x = 1\n"),
        ("v0.0.10", "def frame_stack():\n    pass\n"),
        ("v0.0.11", "x = 1\n"),
        ("v0.0.12", "from elsewhere import frame_stack\n"),
        ("not-a-release", "x = 1\n"),
    ]:
        module.write_text(source)
        _git(tmp_path, "add", "-A")
        _git(tmp_path, "commit", "-q", "-m", tag)
        _git(tmp_path, "tag", tag)
    assert audit.release_tags(tmp_path, "haiku") == ["v0.0.9", "v0.0.10", "v0.0.11", "v0.0.12"]
    names = ["haiku._src.base.frame_stack", "haiku._src.base.gone"]
    assert audit.since(tmp_path, "haiku", names) == {
        "haiku._src.base.frame_stack": "v0.0.10; absent again at v0.0.11",
        "haiku._src.base.gone": "in no release tag",
    }


def test_a_source_newer_than_this_python_is_refused_with_the_reason(tmp_path):
    """jax 0.12's sources use Python 3.12's generic classes; under an older Python the
    audit says so instead of reporting the names missing."""
    package = tmp_path / "jax" / "_src"
    package.mkdir(parents=True)
    (package / "util.py").write_text("class fun_name[T]:\n    pass\n")
    audit = _audit()
    names = ["jax._src.util.fun_name"]
    if sys.version_info >= (3, 12):
        assert audit.check(audit.site_source(tmp_path), names) == []
        return
    with pytest.raises(SystemExit, match=r"cannot parse jax\._src\.util .* run this script"):
        audit.check(audit.site_source(tmp_path), names)
