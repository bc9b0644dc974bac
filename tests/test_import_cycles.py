"""``ci/import_cycles.py``: imports point one way, function-level imports included.

The script reads the source (it imports nothing of the project): every import counts,
inside a function too (a lazy import runs, later), and the core's layers, the kit and the
adapters are ordered, so an import to a higher layer fails however it is written.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys

from _fresh import ROOT

SCRIPT = ROOT / "ci" / "import_cycles.py"
_spec = importlib.util.spec_from_file_location("import_cycles", SCRIPT)
assert _spec is not None and _spec.loader is not None
import_cycles = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_cycles)


def test_the_project_has_no_import_cycle_and_no_upward_import():
    result = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout
    assert result.stdout.strip() == "0 import cycles, 0 upward imports"


def _tree(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for name, text in files.items():
        path = root / "src" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (root / "adapters").mkdir(exist_ok=True)
    return root


def test_a_function_level_import_closes_a_cycle(tmp_path):
    root = _tree(
        tmp_path,
        {
            "jaxoverride/__init__.py": "",
            "jaxoverride/_stack.py": "def f():\n    from jaxoverride import _detect\n",
            "jaxoverride/_detect.py": "from jaxoverride import _stack\n",
        },
    )
    graph = import_cycles.module_graph(root)
    assert graph["jaxoverride._stack"] == {"jaxoverride._detect"}
    assert import_cycles.cycles(graph) == {("jaxoverride._detect", "jaxoverride._stack")}
    [problem] = import_cycles.upward(graph)
    assert re.fullmatch(
        r"jaxoverride\._stack \(layer \d+\) imports jaxoverride\._detect \(layer \d+\)", problem
    )


def test_import_module_and_relative_imports_count_and_type_checking_ones_do_not(tmp_path):
    root = _tree(
        tmp_path,
        {
            "jaxoverride/__init__.py": "",
            "jaxoverride/_names.py": (
                "import importlib\n"
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n"
                "    from jaxoverride import _api\n"
                "def g():\n"
                "    return importlib.import_module('jaxoverride._neutral')\n"
            ),
            "jaxoverride/_api.py": "",
            "jaxoverride/_neutral.py": "from . import _names\n",
        },
    )
    graph = import_cycles.module_graph(root)
    assert graph["jaxoverride._names"] == {"jaxoverride._neutral"}
    assert graph["jaxoverride._neutral"] == {"jaxoverride._names"}
    assert import_cycles.cycles(graph) == {("jaxoverride._names", "jaxoverride._neutral")}


def test_a_new_core_module_must_be_given_a_layer_and_the_kit_and_adapters_stay_above(tmp_path):
    root = _tree(
        tmp_path,
        {
            "jaxoverride/__init__.py": "",
            "jaxoverride/_new.py": "",
            "jaxoverride/_stack.py": "import jaxoverride.adapter_kit\n",
            "jaxoverride/adapter_kit/__init__.py": "import jaxoverride_toy\n",
            "jaxoverride_toy/__init__.py": "from jaxoverride import adapter_kit\n",
        },
    )
    problems = import_cycles.upward(import_cycles.module_graph(root))
    assert "jaxoverride._new has no layer: add it to LAYERS in ci/import_cycles.py" in problems
    assert any(
        re.match(r"jaxoverride\._stack \(layer \d+\) imports jaxoverride\.adapter_kit ", p)
        for p in problems
    )
    assert any(
        re.match(r"jaxoverride\.adapter_kit \(layer \d+\) imports jaxoverride_toy ", p)
        for p in problems
    )
