"""``jo.interpose_on_import``: packages neutral from their first line on, and undone cleanly.

Packages written here into a temporary directory are fresh in this process, so most tests
run in-process. Where the real import order matters (optimistix, equinox), a fresh
interpreter runs the scenario and reports back as JSON.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import importlib.abc
import importlib.machinery
import json
import re
import subprocess
import sys
import textwrap
import threading
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest

import jaxoverride as jo
from jaxoverride import _api, _import_hook, _interpose, lax as jlax

# Every import style a library uses, and transforms built while the module is imported.
MODULE_SOURCE = """
import jax
import jax.lax as lax
import jax.numpy as jnp
from jax import jit, custom_vjp
from jax.lax import scan
import jax.lax

compiled_at_import = jax.jit(lambda x: x * 2.0)
also_compiled = jit(lambda x: x + 1.0)

@custom_vjp
def rule(x):
    return jnp.sin(x)

rule.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (g * jnp.cos(x),))

def total(xs):
    return scan(lambda c, x: (c + x, c), 0.0, xs)[0]

def lazy():
    import jax
    return jax
"""


@pytest.fixture
def make_package(tmp_path, monkeypatch):
    """Writes a fresh package (``pkg/__init__.py`` and ``pkg/sub.py``) under a unique name."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names = []

    def make(name: str, sub_source: str = MODULE_SOURCE) -> str:
        package = tmp_path / name
        package.mkdir()
        (package / "__init__.py").write_text("import jax\n")
        (package / "sub.py").write_text(textwrap.dedent(sub_source))
        names.append(name)
        importlib.invalidate_caches()
        return name

    yield make
    for name in names:
        for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[module]


@pytest.fixture(autouse=True)
def _hooks_left_as_found():
    before = (builtins.__import__, list(sys.meta_path), dict(_interpose._bindings))
    yield
    assert not _import_hook._handles, "a test left interpose_on_import active"
    assert builtins.__import__ is before[0]
    assert sys.meta_path == before[1]
    assert _interpose._bindings == before[2]


def test_import_time_transforms_and_every_import_style_are_neutral(make_package):
    name = make_package("ioi_styles")
    with jo.interpose_on_import(name) as handle:
        sub = importlib.import_module(f"{name}.sub")
        assert sub.jax is _interpose.neutral_jax
        assert sub.lax is jlax
        assert sub.jit is _api.jit
        assert sub.custom_vjp is _api.custom_vjp
        assert sub.scan is jlax.scan
        assert sub.jnp is jnp  # not overridable: jax's own
        assert isinstance(sub.compiled_at_import, jo.Transformed)
        assert isinstance(sub.also_compiled, jo.Transformed)
        assert isinstance(sub.rule, jo.NeutralRule)
        assert sub.lazy() is _interpose.neutral_jax  # an import inside a function, later
        assert sorted(handle.rebound[f"{name}.sub"]) == sorted(
            ["jax", "lax", "jit", "custom_vjp", "scan"]
        )
        assert handle.rebound[name] == ["jax"]
        # Built neutral, they compute what JAX computes.
        x = jnp.arange(3.0)
        np.testing.assert_array_equal(sub.compiled_at_import(x), x * 2.0)
        np.testing.assert_allclose(jax.grad(lambda v: sub.rule(v).sum())(x), jnp.cos(x))
        np.testing.assert_array_equal(sub.total(x), 3.0)
    # Restored: the module's references are jax's own again; what it built stays neutral.
    assert sub.jax is jax
    assert sub.lax is jax.lax
    assert sub.jit is jax.jit
    assert sub.scan is jax.lax.scan
    assert sub.lazy() is jax
    assert isinstance(sub.compiled_at_import, jo.Transformed)


def test_overrides_reach_transforms_built_at_import(make_package):
    name = make_package("ioi_overrides")
    calls = []

    def logging_jit(fun, *args, **kwargs):
        calls.append(getattr(fun, "__name__", "?"))
        return jo.next_impl("jit")(fun, *args, **kwargs)

    with jo.interpose_on_import(name):
        sub = importlib.import_module(f"{name}.sub")
    with jo.override_context({"jit": logging_jit}):
        sub.compiled_at_import(jnp.ones(2))
    assert calls == ["<lambda>"]


def test_already_imported_modules_are_interposed_at_once(make_package):
    name = make_package("ioi_late", "import jax\n\ndef f(x):\n    return jax.lax.scan\n")
    sub = importlib.import_module(f"{name}.sub")
    with jo.interpose_on_import(name) as handle:
        assert sub.jax is _interpose.neutral_jax
        assert handle.rebound == {name: ["jax"], f"{name}.sub": ["jax"]}
    assert sub.jax is jax


def test_already_imported_with_raw_import_time_transforms_is_refused(make_package):
    name = make_package("ioi_raw")
    importlib.import_module(f"{name}.sub")
    with pytest.raises(jo.ImportOrderError) as info:
        jo.interpose_on_import(name)
    message = str(info.value)
    assert f"{name}.sub.compiled_at_import" in message
    assert f"{name}.sub.rule" in message
    assert f"interpose_on_import('{name}') before their first import" in message
    assert "Nothing was changed" in message
    # The escape hatch named in the docs still rebinds what can be reached.
    with jo.interpose(sys.modules[f"{name}.sub"]) as handle:
        assert "jax" in handle.rebound[f"{name}.sub"]
        assert f"{name}.sub.compiled_at_import" in handle.precompiled


@pytest.mark.parametrize(
    ("bad", "error", "words"),
    [
        ("no_such_package_xyz", ModuleNotFoundError, "no package named 'no_such_package_xyz'"),
        ("jax", ValueError, "refuses 'jax'"),
        ("jax.numpy", ValueError, "refuses 'jax.numpy'"),
        ("jaxlib", ValueError, "refuses 'jaxlib'"),
        ("jaxoverride", ValueError, "refuses 'jaxoverride'"),
        (".relative", ValueError, "not an absolute module name"),
        (3, TypeError, "expects package names as strings"),
    ],
)
def test_bad_names_are_refused_and_change_nothing(make_package, bad, error, words):
    good = make_package(f"ioi_bad_{abs(hash(str(bad))) % 10**6}")
    with pytest.raises(error, match=words):
        jo.interpose_on_import(good, bad)
    assert good not in _import_hook._watched


def test_no_name_is_refused():
    with pytest.raises(TypeError, match="at least one package name"):
        jo.interpose_on_import()


def test_idempotent_and_nested_handles(make_package):
    name = make_package("ioi_nested")
    first = jo.interpose_on_import(name, name)
    assert first.packages == (name,)
    second = jo.interpose_on_import(name)
    sub = importlib.import_module(f"{name}.sub")
    first.restore()
    first.restore()  # twice: nothing more
    assert sub.jax is _interpose.neutral_jax, "the second handle still holds the package"
    assert builtins.__import__ is _import_hook._neutral_import
    before = _import_hook._below_import
    second.restore()
    assert sub.jax is jax
    assert builtins.__import__ is before


def test_interpose_and_interpose_on_import_share_bindings(make_package):
    name = make_package("ioi_shared")
    with jo.interpose_on_import(name):
        sub = importlib.import_module(f"{name}.sub")
        with jo.interpose(sub) as handle:
            assert "jax" in handle.rebound[f"{name}.sub"]
        assert sub.jax is _interpose.neutral_jax, "the on-import handle still holds it"
    assert sub.jax is jax


def test_thread_safe(make_package):
    names = [make_package(f"ioi_thread_{i}") for i in range(4)]
    errors = []
    barrier = threading.Barrier(len(names))

    def work(name):
        try:
            barrier.wait()
            for _ in range(5):
                with jo.interpose_on_import(name):
                    sub = importlib.import_module(f"{name}.sub")
                    assert sub.jax is _interpose.neutral_jax
                    assert isinstance(sub.compiled_at_import, jo.Transformed)
                del sys.modules[f"{name}.sub"]
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors


def test_other_modules_imports_are_untouched(make_package):
    name = make_package("ioi_other")
    other = make_package("ioi_unwatched")
    with jo.interpose_on_import(name):
        unwatched = importlib.import_module(f"{other}.sub")
        assert unwatched.jax is jax
        assert not isinstance(unwatched.compiled_at_import, jo.Transformed)


def _fresh_interpreter(script: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).parent,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_optimistix_in_haiku_needs_the_import_order():
    """The real case: optimistix inside ``hk.transform``, read-only model, at init."""
    script = """
    import json, sys
    import jaxoverride as jo
    if sys.argv[-1] == "first":
        jo.interpose_on_import("equinox", "optimistix")
    import haiku as hk, jax, jax.numpy as jnp, optimistix as optx
    import jaxoverride_haiku
    jaxoverride_haiku.install()

    def f(x):
        lin = hk.Linear(3, w_init=hk.initializers.Constant(0.1))
        solver = optx.FixedPointIteration(rtol=1e-6, atol=1e-6)
        return optx.fixed_point(lambda z, a: jnp.tanh(lin(z) + a), solver, jnp.zeros(3), x).value

    t = hk.transform(f)
    x = jnp.ones(3)
    try:
        params = t.init(jax.random.PRNGKey(0), x)
        out = {"ok": True, "value": t.apply(params, None, x).tolist()}
    except Exception as exc:
        out = {"ok": False, "error": type(exc).__name__}
    if sys.argv[-1] == "late":
        try:
            jo.interpose_on_import("equinox", "optimistix")
        except jo.ImportOrderError as exc:
            out["late"] = str(exc)
    print(json.dumps(out))
    """
    first = _fresh_interpreter(script.replace("sys.argv[-1]", "'first'"))
    late = _fresh_interpreter(script.replace("sys.argv[-1]", "'late'"))
    assert first["ok"], first
    z = np.zeros(3)
    for _ in range(200):
        z = np.tanh(np.full((3, 3), 0.1).T @ z + 1.0)  # bias starts at zero
    np.testing.assert_allclose(first["value"], z, rtol=1e-5)
    assert not late["ok"], "raw optimistix inside hk.transform was expected to fail at init"
    # Caught at init, naming interpose_on_import (issue 20), not Haiku's misleading error.
    assert late["error"] == "MissingAdapterError"
    assert re.search(r"'optimistix' \d+ \(optimistix\._fixed_point\.fixed_point", late["late"])


def test_an_import_hook_installed_after_jaxoverride_keeps_running_and_is_put_back(
    make_package,
):
    """A hook installed after ``import jaxoverride`` (a profiler, a lazy importer) stays in
    the chain while the packages are watched, and is exactly what ``restore()`` leaves."""
    name = make_package("ioi_chained")
    seen: list[str] = []
    original = builtins.__import__

    def profiler_import(module_name, *args, **kwargs):
        seen.append(module_name)
        return original(module_name, *args, **kwargs)

    builtins.__import__ = profiler_import
    try:
        with jo.interpose_on_import(name):
            sub = importlib.import_module(f"{name}.sub")
            assert sub.jit is jo.jit, "the module body was still handed the neutral names"
            seen.clear()
            import json as _  # noqa: F401  (any import goes through the whole chain)

            assert "json" in seen, "the hook installed before interpose_on_import was skipped"
        assert builtins.__import__ is profiler_import, "restore() did not put back the hook"
    finally:
        builtins.__import__ = original


def test_a_hook_installed_over_ours_is_left_and_ours_is_reused(make_package):
    """A hook installed while interposing stays where it is on ``restore()``; ours, still
    below it, passes through, and a later ``interpose_on_import`` reuses it (no cycle)."""
    first, second = make_package("ioi_over_a"), make_package("ioi_over_b")
    original = builtins.__import__
    try:
        with jo.interpose_on_import(first):
            below = builtins.__import__

            def later_hook(module_name, *args, **kwargs):
                return below(module_name, *args, **kwargs)

            builtins.__import__ = later_hook
        assert builtins.__import__ is later_hook
        with jo.interpose_on_import(second):
            assert builtins.__import__ is later_hook
            sub = importlib.import_module(f"{second}.sub")
            assert sub.jit is jo.jit
        assert importlib.import_module("json") is json
    finally:
        builtins.__import__ = original
        _import_hook._in_chain = False


class _LoaderOfItsOwn(importlib.machinery.SourceFileLoader):
    """Loads source as Python does, and notes the modules it loaded."""

    loaded: list[str] = []

    def exec_module(self, module: types.ModuleType) -> None:
        self.loaded.append(module.__name__)
        super().exec_module(module)


class _FinderOfItsOwn(importlib.abc.MetaPathFinder):
    """Another import hook, for the modules of one package: it finds them with Python's
    path finder and loads them with a loader of its own (as jaxtyping's hook does)."""

    def __init__(self, package: str):
        self.package = package

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.package and not fullname.startswith(self.package + "."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.origin is not None:
            spec.loader = _LoaderOfItsOwn(fullname, spec.origin)
        return spec


@contextlib.contextmanager
def _own_finder_first(package: str):
    sys.meta_path.insert(0, _FinderOfItsOwn(package))
    try:
        yield
    finally:
        del sys.meta_path[0]


FIRST_FINDERS = {
    "jaxtyping_hook": lambda package: jaxtyping.install_import_hook(package, None),
    "finder_of_its_own": _own_finder_first,
}


@pytest.mark.parametrize("finder", list(FIRST_FINDERS))
def test_modules_loaded_by_a_finder_ahead_of_ours_are_recorded_and_restored(make_package, finder):
    """A later import hook first in ``sys.meta_path`` loads the modules with its own
    loader: they are still served the neutral ``jax``, listed in ``rebound`` and given
    JAX's own back by ``restore()``, with no other import in between."""
    name = make_package(f"ioi_behind_{finder}")
    _LoaderOfItsOwn.loaded = []
    handle = jo.interpose_on_import(name)
    try:
        with FIRST_FINDERS[finder](name):
            assert sys.meta_path[0] is not _import_hook._finder
            sub = importlib.import_module(f"{name}.sub")
        if finder == "finder_of_its_own":
            assert _LoaderOfItsOwn.loaded == [name, f"{name}.sub"]
        else:
            assert type(getattr(sub.__spec__, "loader", None)).__name__ == "_JaxtypingLoader"
        assert sub.jax is _interpose.neutral_jax
        assert isinstance(sub.compiled_at_import, jo.Transformed)
        assert sorted(handle.rebound[f"{name}.sub"]) == sorted(
            ["jax", "lax", "jit", "custom_vjp", "scan"]
        )
        assert handle.rebound[name] == ["jax"]
    finally:
        handle.restore()
    package = sys.modules[name]
    assert package.jax is jax
    assert (sub.jax, sub.lax, sub.jit, sub.scan) == (jax, jax.lax, jax.jit, jax.lax.scan)
    assert sub.custom_vjp is jax.custom_vjp
    assert sub.lazy() is jax


@pytest.mark.parametrize("finder", list(FIRST_FINDERS))
def test_restore_right_after_an_import_by_a_finder_ahead_of_ours(make_package, finder):
    """``restore()`` as the very next call after the import (nothing else recorded it)."""
    name = make_package(f"ioi_restored_{finder}")
    handle = jo.interpose_on_import(name)
    try:
        with FIRST_FINDERS[finder](name):
            sub = importlib.import_module(f"{name}.sub")
    finally:
        handle.restore()
    assert (sub.jax, sub.jit, sys.modules[name].jax) == (jax, jax.jit, jax)
