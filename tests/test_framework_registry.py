"""The framework registry: frameworks register themselves; the core names none.

A framework reaches the missing-adapter check through a ``Framework`` record, registered
with ``adapter_kit.register_framework`` or declared in the entry-point group
``jaxoverride.frameworks`` of an installed distribution. The entry-point tests run in
fresh interpreters (what is imported, and when, is the point), with a distribution made on
the fly: a ``*.dist-info`` folder whose ``entry_points.txt`` names a record module.
"""

from __future__ import annotations

import ast
import pathlib
import re
import textwrap

import pytest

from _fresh import ROOT, run_source
from jaxoverride import _frameworks, adapter_kit
from jaxoverride.errors import MissingAdapterError

# A framework of one module: ``depth`` counts the running scopes, ``params`` is its state.
TOY_CORE = """
depth = 0
params = []
"""
# Its record: imports only the kit, reads the framework from sys.modules.
TOY_RECORD = """
import sys
from jaxoverride import _frameworks, adapter_kit

class Toy(adapter_kit.Framework):
    key = "toy"
    module = "toy_core"
    title = "Toy (a neutral function ran inside toy.transform)"
    fix = "toy_adapter.install() at the start of the program"
    label = "toy_adapter"

    def running(self):
        core = sys.modules.get(self.module)
        return core is not None and core.depth > 0

    def leaked_state(self):
        core = sys.modules.get(self.module)
        return [] if core is None else list(core.params)

TOY = Toy()
"""
# Its adapter, which the check must not need: importing it fails the test.
TOY_ADAPTER = """
raise AssertionError("the toy adapter was imported")
"""


def _toy_distribution(where: pathlib.Path) -> pathlib.Path:
    """A folder to put on ``sys.path``: the toy framework, its record and adapter, and an
    installed distribution whose entry point declares the record."""
    (where / "toy_core.py").write_text(TOY_CORE)
    (where / "toy_record.py").write_text(TOY_RECORD)
    (where / "toy_adapter.py").write_text(TOY_ADAPTER)
    info = where / "toy_adapter-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-adapter\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[jaxoverride.frameworks]\ntoy_core = toy_record:TOY\n")
    return where


def test_an_entry_point_framework_is_checked_without_its_adapter_being_imported(tmp_path):
    folder = _toy_distribution(tmp_path)
    result = run_source(
        f"""
        import sys
        sys.path.insert(0, {str(folder)!r})
        import jax.numpy as jnp
        import jaxoverride as jo
        from jaxoverride import lax as jlax

        step = lambda c, _: (c + 1, None)
        # Before the framework is imported, its record is not loaded.
        jlax.scan(step, jnp.float32(0), length=2)
        assert "toy_record" not in sys.modules

        import toy_core
        jlax.scan(step, jnp.float32(0), length=2)  # imported, no scope running: JAX's
        assert "toy_record" in sys.modules

        def writes(c, _):
            toy_core.params.append(c)  # framework state written under the scan's trace
            return c + 1, None

        toy_core.depth = 1
        try:
            jlax.scan(writes, jnp.float32(0), length=2)
        except jo.errors.MissingAdapterError as error:
            print(error)
        else:
            print("silent")
        assert "toy_adapter" not in sys.modules
        """
    )
    assert result.returncode == 0, result.stderr[-4000:]
    message = result.stdout.strip()
    assert message.startswith("jaxoverride.lax.scan met Toy (a neutral function ran inside")
    assert "no adapter that handles toy is active" in message
    assert "Fix: toy_adapter.install() at the start of the program" in message


def test_an_entry_point_framework_is_handled_by_its_label_and_declared_labels(tmp_path):
    folder = _toy_distribution(tmp_path)
    result = run_source(
        f"""
        import sys
        sys.path.insert(0, {str(folder)!r})
        import jax, jax.numpy as jnp
        import jaxoverride as jo
        from jaxoverride import adapter_kit, lax as jlax
        import toy_core

        def writes(c, _):
            toy_core.params.append(c)
            return c + 1, None

        toy_core.depth = 1
        # A layer labelled with the record's label, or one declared for the key, handles it.
        adapter_kit.declare_handler("toy", "another_toy_adapter")
        for label in ("toy_adapter", "another_toy_adapter"):
            with jo.override_context({{"lax.scan": jax.lax.scan}}, name=label):
                jlax.scan(writes, jnp.float32(0), length=2)
        print("handled")
        """
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip() == "handled"


def test_a_broken_entry_point_warns_and_the_others_still_load(tmp_path):
    folder = _toy_distribution(tmp_path)
    info = folder / "broken-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[jaxoverride.frameworks]\njson = no_such_module:X\n")
    result = run_source(
        f"""
        import sys, warnings
        sys.path.insert(0, {str(folder)!r})
        import json, jax.numpy as jnp
        import jaxoverride as jo
        from jaxoverride import _detect, lax as jlax
        import toy_core
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            jlax.scan(lambda c, _: (c + 1, None), jnp.float32(0), length=2)
        print(sorted(k for k in _detect.frameworks() if k == "toy"))
        print(" | ".join(str(w.message) for w in caught))
        """
    )
    assert result.returncode == 0, result.stderr[-4000:]
    keys, warned = result.stdout.strip().split("\n")
    assert keys == "['toy']"
    assert "json = 'no_such_module:X'" in warned and "ModuleNotFoundError" in warned


BUILT_IN = {
    "haiku": """
        import jax, jax.numpy as jnp, haiku as hk
        from jaxoverride import lax as jlax
        def f(x):
            body = lambda c: (c[0] + 1, hk.Linear(2)(c[1]))
            return jlax.while_loop(lambda c: c[0] < 2, body, (0, x))[1]
        run = lambda: hk.transform(f).init(jax.random.PRNGKey(0), jnp.ones((1, 2)))
        """,
    "linen": """
        import jax, jax.numpy as jnp, flax.linen as nn
        from jaxoverride import lax as jlax
        class Loop(nn.Module):
            @nn.compact
            def __call__(self, x):
                dense = nn.Dense(2)
                return jlax.scan(lambda c, _: (dense(c), None), x, length=2)[0]
        run = lambda: Loop().init(jax.random.PRNGKey(0), jnp.ones((1, 2)))
        """,
    "nnx": """
        import jax.numpy as jnp
        from flax import nnx
        import jaxoverride as jo
        model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        run = lambda: jo.jit(lambda x: model(x))(jnp.ones((1, 2)))
        """,
}
FIXES = {
    "haiku": "jaxoverride_haiku.install()",
    "linen": "jaxoverride_linen.install()",
    "nnx": "jaxoverride_nnx.track(model)",
}


@pytest.mark.parametrize("key", sorted(BUILT_IN))
def test_the_built_in_frameworks_are_checked_with_the_adapter_never_imported(key):
    """A fresh program that imports the framework and jaxoverride, never the adapter."""
    source = textwrap.dedent(BUILT_IN[key]) + textwrap.dedent(
        """
        import sys
        import jaxoverride as jo
        assert not [m for m in sys.modules if m.startswith("jaxoverride_")]
        try:
            run()
        except jo.errors.MissingAdapterError as error:
            print(error)
        else:
            print("silent")
        # The check knew the framework from the adapter's entry point, which loaded its
        # record module (importing the module imports its package: it activates nothing).
        print(RECORD_MODULE in sys.modules)
        """
    ).replace("RECORD_MODULE", repr(f"jaxoverride_{key}._framework"))
    result = run_source(source)
    assert result.returncode == 0, result.stderr[-4000:]
    message, loaded = result.stdout.strip().rsplit("\n", 1)
    assert FIXES[key] in message and loaded == "True", result.stdout


@pytest.fixture
def registry():
    """The registry as it was, back after the test: records registered here go."""
    saved = [
        (table, dict(table))
        for table in (_frameworks.registered, _frameworks.labels, _frameworks.covers)
    ]
    labels = {key: set(value) for key, value in _frameworks.labels.items()}
    yield
    for table, before in saved:
        table.clear()
        table.update(before)
    _frameworks.labels.update(labels)
    with _frameworks._lock:
        _frameworks._set_live_locked()


class _Unwatched(adapter_kit.Framework):
    key = "registry_test_unwatched"
    module = "registry_test_module_never_imported"
    title = "Unwatched (a test framework)"
    fix = "nothing"
    label = "registry_test_adapter"


def test_declare_handler_accepts_a_registered_key_and_lists_them_for_an_unknown_one(registry):
    adapter_kit.register_framework(_Unwatched())
    adapter_kit.register_framework(_Unwatched())  # idempotent per key
    adapter_kit.declare_handler("registry_test_unwatched", "registry_test_other_label")
    with pytest.raises(ValueError, match="unknown framework 'tinystat'") as info:
        adapter_kit.declare_handler("tinystat", "label")
    listed = re.search(r"the registered ones are (\[.*?\])", str(info.value))
    assert listed is not None
    assert {"haiku", "linen", "nnx", "registry_test_unwatched"} <= set(eval(listed.group(1)))
    assert "register_framework" in str(info.value) and "jaxoverride.frameworks" in str(info.value)


def test_register_framework_refuses_an_incomplete_record_or_a_taken_key(registry):
    class Incomplete(adapter_kit.Framework):
        key = "registry_test_incomplete"

    with pytest.raises(TypeError, match="needs a non-empty string 'module'"):
        adapter_kit.register_framework(Incomplete())
    with pytest.raises(TypeError, match="Framework instance"):
        adapter_kit.register_framework("haiku")  # type: ignore[arg-type]

    class Impostor(_Unwatched):
        pass

    adapter_kit.register_framework(_Unwatched())
    with pytest.raises(ValueError, match="registered already"):
        adapter_kit.register_framework(Impostor())
    with pytest.raises(ValueError, match="unknown framework 'registry_test_incomplete'"):
        adapter_kit.declare_handler("registry_test_incomplete", "label")


# Code of the core (documentation and comments aside) that may name a framework, and why:
# a pattern per module that each such word matches.
NAMED_ON_PURPOSE = {
    # this distribution's adapter packages, by import name, whose frames JAX hides
    "_own_frames.py": r"jaxoverride_(haiku|nnx|linen)",
    # ``python -m jaxoverride`` prints the versions of the optional dependencies
    "_selfcheck.py": r"flax|(dm-)?haiku",
    # an example in a message: an import name ('haiku'), not a distribution's ('dm-haiku')
    "_import_hook.py": r".*'dm-haiku'.*",
    # the private-name table's reason for hiding frames: what other libraries do
    "_compat.py": r".*as Equinox and Flax do.*",
    # a frame's line number, for messages that name the program's call: not Linen
    "_user_frames.py": r"f_lineno",
}


def _code_words(path: pathlib.Path) -> set[str]:
    """The identifiers and string constants of a module's code, documentation (a string
    standing as a statement: docstrings, and those under a name) left out."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    words: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in docstrings:
                words.add(node.value)
        elif isinstance(node, ast.Name):
            words.add(node.id)
        elif isinstance(node, ast.Attribute):
            words.add(node.attr)
        elif isinstance(node, ast.alias):
            words.add(node.name)
    return words


def test_the_core_names_no_framework():
    """Every framework is a record in its adapter: no code of the core's own modules names
    one (docstrings may, as examples), but for the uses listed with their reasons."""
    names = re.compile(r"haiku|linen|nnx|flax", re.IGNORECASE)
    found = {
        path.name: sorted(word for word in _code_words(path) if names.search(word))
        for path in sorted((ROOT / "src" / "jaxoverride").glob("*.py"))
    }
    unexplained = {
        name: [word for word in words if not re.fullmatch(NAMED_ON_PURPOSE.get(name, "^$"), word)]
        for name, words in found.items()
    }
    assert {name: words for name, words in unexplained.items() if words} == {}
    assert {name for name, words in found.items() if words} == set(NAMED_ON_PURPOSE)


def test_a_record_that_only_describes_changes_nothing():
    record = _Unwatched()
    assert not record.running() and record.leaked_state() == [] and not record.is_state(1)
    assert record.fix_for(["model"]) == "nothing" and record.write_error() is None
    assert issubclass(MissingAdapterError, Exception)
