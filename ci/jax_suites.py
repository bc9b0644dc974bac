"""Runs JAX's own custom-derivative test suites through jaxoverride's neutral names.

Usage::

    python ci/jax_suites.py PATH_TO_JAX_CHECKOUT [--modes idle,plain,...] [--next both]
        [--suites custom_api_test,...] [--reports DIR] [--show-failures] [-- pytest arguments]

``PATH_TO_JAX_CHECKOUT`` is a checkout of JAX at the release that is installed (for JAX
0.10.2: ``git clone -b jax-v0.10.2 https://github.com/jax-ml/jax``), or the newest tag the
source has where the release has none yet; only its ``tests/`` folder is read. Each suite
(``tests/lax_control_flow_test.py``, ``custom_api_test.py``, ``custom_root_test.py`` and
``custom_linear_solve_test.py`` by default) is copied into a temporary folder, with one
line added after its imports that rebinds the module's ``jax``, ``lax``, ``grad``, ``jit``,
``checkpoint``, JAX's private ``api`` and ``custom_derivatives`` modules to the neutral API
(``jo.custom_vjp``, ``jo.custom_jvp``, ``jo.closure_convert``, ``jaxoverride.lax.custom_root``,
``jo.jit``, ...; every other attribute stays JAX's). Then pytest runs the copies once per
mode, each adapter active with nothing to do:

- ``idle``: nothing active;
- ``plain``: ``jaxoverride_plain.context()``;
- ``haiku``: ``jaxoverride_haiku.install()`` (outside any ``hk.transform``);
- ``nnx``: ``jaxoverride_nnx.track(m)`` of a module that no test uses;
- ``linen``: ``jaxoverride_linen.context()`` (outside any Linen module);
- ``dag``: ``jaxoverride_dag.context()``;
- ``debug``: ``jaxoverride_debug.trace()``.

``--next on`` runs with each of JAX's next flags that this JAX has turned on
(``JAX_CUSTOM_VJP3=1``, ``JAX_CUSTOM_JVP3=1``, ``JAX_REMAT3=1``: JAX's next ``custom_vjp``,
``custom_jvp`` and ``checkpoint``; ``tests/_next_flags.py``), ``--next both`` runs every mode
both ways; the first line printed names the JAX, its flags, and how the runs set them. The
table printed at the end counts passed, failed and skipped tests per mode and suite;
``--reports DIR`` keeps each run's junit XML (with the tracebacks); ``--show-failures``
lists the failing test ids with their first error line. Nothing from JAX's repository is
kept.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import subprocess
import sys
import tempfile
import types
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SUITES = (
    "lax_control_flow_test",
    "custom_api_test",
    "custom_root_test",
    "custom_linear_solve_test",
)
MODES = ("idle", "plain", "haiku", "nnx", "linen", "dag", "debug")
_MODE_VARIABLE = "JAXOVERRIDE_SUITE_MODE"
_REBIND_LINE = "import jax_suites as _jaxoverride_suites; _jaxoverride_suites.rebind(globals())\n"
_CONFTEST = '''"""Written by jaxoverride's ci/jax_suites.py: activates the mode per test."""
from jax_suites import adapter_mode, haiku_installed  # noqa: F401  (autouse fixtures)
'''


# ---------------------------------------------------------------------------------------
# Inside the pytest process: the rebinding and the mode fixtures


class _Namespace(types.ModuleType):
    """A module seen with some attributes replaced; every other attribute is the module's."""

    def __init__(self, base: types.ModuleType, replaced: dict[str, Any]):
        super().__init__(base.__name__, base.__doc__)
        self.__dict__.update(replaced)
        self._base = base

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)


def rebind(namespace: dict[str, Any]) -> None:
    """Rebinds a JAX test module's global names to jaxoverride's neutral API.

    Args:
      namespace: the test module's ``globals()``, right after its imports.
    """
    import jax
    import jax.custom_derivatives
    from jax._src import api, custom_derivatives as private_custom_derivatives

    import jaxoverride as jo
    from jaxoverride import lax as jlax

    rules = {
        "custom_vjp": jo.custom_vjp,
        "custom_jvp": jo.custom_jvp,
        "closure_convert": jo.closure_convert,
    }
    top_level = {name: getattr(jo, name) for name in jo.OVERRIDEABLE if "." not in name}
    public_rules = _Namespace(jax.custom_derivatives, rules)
    neutral_jax = _Namespace(jax, {**top_level, "lax": jlax, "custom_derivatives": public_rules})
    replacements: dict[str, Any] = {
        "jax": neutral_jax,
        "lax": jlax,
        "api": _Namespace(api, {n: v for n, v in top_level.items() if hasattr(api, n)}),
        "custom_derivatives": _Namespace(private_custom_derivatives, rules),
    }
    for name in ("grad", "jit", "checkpoint", "vmap", "jvp", "vjp", "remat"):
        replacements[name] = top_level[name]
    for name, value in replacements.items():
        if name in namespace:
            namespace[name] = value


def _activated(mode: str) -> Any:
    import contextlib

    if mode in ("idle", "haiku"):  # haiku: installed once per session
        return contextlib.nullcontext()
    if mode == "plain":
        import jaxoverride_plain

        return jaxoverride_plain.context()
    if mode == "nnx":
        import jaxoverride_nnx

        return jaxoverride_nnx.track(_unused_nnx_module())
    if mode == "linen":
        import jaxoverride_linen

        return jaxoverride_linen.context()
    if mode == "dag":
        import jaxoverride_dag

        return jaxoverride_dag.context()
    if mode == "debug":
        import jaxoverride_debug

        return jaxoverride_debug.trace()
    raise ValueError(f"unknown mode {mode!r}; the modes are {', '.join(MODES)}")


_UNUSED: list[Any] = []


def _unused_nnx_module() -> Any:
    if not _UNUSED:
        import jax.numpy as jnp
        from flax import nnx

        class Unused(nnx.Module):
            def __init__(self) -> None:
                self.w = nnx.Param(jnp.ones(2))
                self.calls = nnx.Variable(jnp.array(0))

        _UNUSED.append(Unused())
    return _UNUSED[0]


def _pytest_fixtures() -> tuple[Any, Any]:
    import pytest

    @pytest.fixture(autouse=True, scope="session")
    def haiku_installed() -> Iterator[None]:
        if os.environ.get(_MODE_VARIABLE) != "haiku":
            yield
            return
        import jaxoverride_haiku

        jaxoverride_haiku.install()
        try:
            yield
        finally:
            jaxoverride_haiku.uninstall()

    @pytest.fixture(autouse=True)
    def adapter_mode() -> Iterator[None]:
        with _activated(os.environ.get(_MODE_VARIABLE, "idle")):
            yield

    return haiku_installed, adapter_mode


if os.environ.get(_MODE_VARIABLE):  # imported by the generated conftest
    haiku_installed, adapter_mode = _pytest_fixtures()


# ---------------------------------------------------------------------------------------
# The runner


def next_flags() -> types.ModuleType:
    """``tests/_next_flags.py``: JAX's next flags, which this JAX has, and their record."""
    spec = importlib.util.spec_from_file_location("_next_flags", ROOT / "tests" / "_next_flags.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def flag_environment(flags: list[str], on: bool) -> dict[str, str]:
    """The environment variables that set each of ``flags`` (``jax_remat3``: ``JAX_REMAT3``)
    on or off in the pytest process, whatever the caller's environment says."""
    return {flag.upper(): "1" if on else "0" for flag in flags}


def header(record: str, flags: list[str], settings: list[bool]) -> str:
    """The first line printed: this JAX and its next flags as the runner's process has them
    (``record``), then as the runs set them (in the pytest processes, through
    ``flag_environment``)."""
    runs = " then ".join("on" if on else "off" for on in settings)
    return f"{record}; the runs set {', '.join(flags) or 'none of them'} {runs}"


def _with_rebinding(source: str) -> str:
    """The suite's source with ``_REBIND_LINE`` after its last top-level import."""
    tree = ast.parse(source)
    last = 0
    for node in tree.body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            last = node.end_lineno or node.lineno
        elif not isinstance(node, ast.Expr):  # the module docstring is an Expr
            break
    lines = source.splitlines(keepends=True)
    return "".join([*lines[:last], _REBIND_LINE, *lines[last:]])


def _prepare(checkout: Path, suites: list[str], folder: Path) -> list[Path]:
    copies = []
    for suite in suites:
        original = checkout / "tests" / f"{suite}.py"
        if not original.exists():
            raise SystemExit(f"{original} does not exist: is {checkout} a JAX checkout?")
        copy = folder / original.name
        copy.write_text(_with_rebinding(original.read_text()))
        copies.append(copy)
    (folder / "conftest.py").write_text(_CONFTEST)
    return copies


_OUTCOMES = ("passed", "failed", "skipped")


def counts(report: Path) -> tuple[dict[str, dict[str, int]], list[str]]:
    """Passed, failed and skipped per suite in a junit report, and one line per failure.

    Args:
      report: the junit XML that pytest wrote (``--junitxml``).

    Returns:
      ``({suite: {"passed": n, "failed": n, "skipped": n}}, failures)``, the suite read from
      each test's class name (``lax_control_flow_test.LaxControlFlowTest`` is
      ``lax_control_flow_test``), a failure line ``class.test: first line of the error``.
    """
    per_suite: dict[str, dict[str, int]] = {}
    failures = []
    for case in ElementTree.parse(report).iter("testcase"):
        suite = (case.get("classname") or "").split(".")[0]
        tally = per_suite.setdefault(suite, dict.fromkeys(_OUTCOMES, 0))
        outcome = next((child for child in case if child.tag in ("failure", "error")), None)
        if outcome is not None:
            tally["failed"] += 1
            message = (outcome.get("message") or "").strip().splitlines()
            first = message[0][:200] if message else ""
            failures.append(f"{case.get('classname')}.{case.get('name')}: {first}")
        elif any(child.tag == "skipped" for child in case):
            tally["skipped"] += 1
        else:
            tally["passed"] += 1
    return per_suite, failures


def _total(per_suite: dict[str, dict[str, int]]) -> dict[str, int]:
    return {key: sum(tally[key] for tally in per_suite.values()) for key in _OUTCOMES}


def run(
    checkout: Path,
    modes: list[str],
    settings: list[bool],
    suites: list[str],
    extra: list[str],
    flags: list[str],
    reports: Path | None = None,
) -> list[tuple[str, dict[str, dict[str, int]], list[str]]]:
    """Runs the suites once per mode and flag setting; returns (label, counts, failures).

    Args:
      checkout: a JAX checkout (its ``tests/`` folder is read).
      modes: names from ``MODES``.
      settings: for each, whether ``flags`` are on (``[False, True]``: every mode both ways).
      suites: test modules of ``checkout/tests``, without ``.py``.
      extra: more pytest arguments.
      flags: JAX's next flags that this JAX has (``next_flags().available()``).
      reports: a folder for each run's junit XML (``report-dag-1.xml``: ``dag +next``),
        kept after the run with the failures' tracebacks; by default a temporary folder.

    Returns:
      One ``(label, per_suite, failures)`` per run, ``label`` the mode (``"dag +next"`` with
      the flags on), ``per_suite`` passed / failed / skipped per suite (``counts``),
      ``failures`` one line per failure.
    """
    results = []
    with tempfile.TemporaryDirectory(prefix="jax_suites_") as name:
        folder = Path(name)
        copies = _prepare(checkout, suites, folder)
        for flag in settings:
            for mode in modes:
                label = f"{mode}{' +next' if flag else ''}"
                report = (reports or folder) / f"report-{mode}-{int(flag)}.xml"
                env = dict(os.environ)
                paths = [str(HERE), str(ROOT / "src"), str(ROOT / "adapters")]
                env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
                env[_MODE_VARIABLE] = mode
                env.update(flag_environment(flags, flag))
                command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
                command += [f"--junitxml={report}", "--rootdir", str(folder), *extra]
                command += [str(copy) for copy in copies]
                subprocess.run(command, env=env, cwd=folder, stdout=subprocess.DEVNULL)
                if not report.exists():
                    raise SystemExit(f"pytest wrote no report for {label}: run it by hand")
                per_suite, failures = counts(report)
                for suite, tally in sorted(per_suite.items()):
                    print(f"{label:12} {suite:26} {tally}", flush=True)
                results.append((label, per_suite, failures))
    return results


def main(argv: list[str] | None = None) -> int:
    """The command line: runs, prints the table, and fails if any test failed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        argv, extra = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", type=Path, help="a JAX checkout at the installed release")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated modes")
    parser.add_argument(
        "--next",
        choices=("off", "on", "both"),
        default="off",
        help="JAX's next flags (jax_custom_vjp3, jax_custom_jvp3, jax_remat3, those this JAX "
        "has): off, on, or every mode both ways",
    )
    parser.add_argument("--suites", default=",".join(SUITES), help="comma-separated suites")
    parser.add_argument("--show-failures", action="store_true")
    parser.add_argument(
        "--reports", type=Path, help="a folder to keep each run's junit XML in (tracebacks)"
    )
    options = parser.parse_args(argv)
    modes = options.modes.split(",")
    if unknown := sorted(set(modes) - set(MODES)):
        parser.error(f"unknown modes {unknown}; the modes are {', '.join(MODES)}")
    settings = {"off": [False], "on": [True], "both": [False, True]}[options.next]
    flags = next_flags()
    print(header(flags.record(), list(flags.available()), settings), flush=True)
    suites = options.suites.split(",")
    if options.reports:
        options.reports.mkdir(parents=True, exist_ok=True)
    results = run(
        options.checkout, modes, settings, suites, extra, list(flags.available()), options.reports
    )
    print(f"\n{'mode':12} {'suite':26} {'passed':>7} {'failed':>7} {'skipped':>7}")
    for label, per_suite, _ in results:
        for suite, tally in [*sorted(per_suite.items()), ("all", _total(per_suite))]:
            row = " ".join(f"{tally[key]:7}" for key in _OUTCOMES)
            print(f"{label:12} {suite:26} {row}")
    if options.show_failures:
        for label, _, failures in results:
            for failure in failures:
                print(f"[{label}] {failure}")
    return int(any(_total(per_suite)["failed"] for _, per_suite, _ in results))


if __name__ == "__main__":
    raise SystemExit(main())
