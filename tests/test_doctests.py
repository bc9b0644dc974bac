"""The ``>>>`` examples in the docstrings of jaxoverride and every adapter run as written.

The neutral functions (``jo.jit``, ``jaxoverride.lax.scan``, ...) carry JAX's docstrings,
whose examples assume ``jax``/``jnp`` globals and particular device counts: they are
JAX's to test, and are skipped here by their exact docstring.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import types

import pytest

import jaxoverride as jo
import jaxoverride_dag
import jaxoverride_debug
import jaxoverride_haiku
import jaxoverride_linen
import jaxoverride_nnx
import jaxoverride_plain

PACKAGES = [
    jo,
    jaxoverride_plain,
    jaxoverride_haiku,
    jaxoverride_nnx,
    jaxoverride_linen,
    jaxoverride_dag,
    jaxoverride_debug,
]


def modules() -> list[types.ModuleType]:
    found = []
    for package in PACKAGES:
        found.append(package)
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            found.append(importlib.import_module(info.name))
    return found


def _neutral_docstrings() -> set[str]:
    docs = set()
    for name in jo.OVERRIDEABLE:
        neutral = getattr(jo.lax, name[4:]) if name.startswith("lax.") else getattr(jo, name)
        docs.add(neutral.__doc__)
    return docs


JAX_DOCSTRINGS = _neutral_docstrings()


def collect() -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder(exclude_empty=True)
    tests: dict[str, doctest.DocTest] = {}
    for module in modules():
        for test in finder.find(module, module.__name__):
            if test.docstring in JAX_DOCSTRINGS or not test.examples:
                continue
            tests.setdefault(test.name, test)
    return sorted(tests.values(), key=lambda test: test.name)


DOCTESTS = collect()


def test_every_public_name_with_a_docstring_example_is_collected():
    names = {test.name for test in DOCTESTS}
    for expected in [
        "jaxoverride.override_context",
        "jaxoverride.install",
        "jaxoverride.next_impl",
        "jaxoverride.resolve",
        "jaxoverride.interpose",
        "jaxoverride.current_stack",
        "jaxoverride.Transformed",
        "jaxoverride.lax",
        "jaxoverride_plain.init_context",
        "jaxoverride_plain.init_safe_scan",
        "jaxoverride_plain.init_safe_while_loop",
        "jaxoverride_plain.init_safe_fori_loop",
        "jaxoverride_plain.init_safe_cond",
        "jaxoverride_plain.init_safe_switch",
        "jaxoverride_plain.init_safe_map",
        "jaxoverride_plain.context",
    ]:
        assert any(
            name == expected or name.endswith("." + expected.split(".")[-1]) for name in names
        ), expected
    # None of JAX's own examples slipped in.
    assert not any(test.docstring in JAX_DOCSTRINGS for test in DOCTESTS)


def test_every_public_function_has_a_runnable_example():
    """The project guide: every public function or class has a ``>>>`` example."""
    with_examples = {test.name.split(".")[-1] for test in DOCTESTS}
    missing = []
    for package in PACKAGES:
        for name in package.__all__:
            obj = getattr(package, name)
            if isinstance(obj, types.ModuleType) or obj.__doc__ in JAX_DOCSTRINGS:
                continue
            if callable(obj) and name not in with_examples:
                missing.append(f"{package.__name__}.{name}")
    assert missing == [], f"public names without a >>> example: {missing}"


@pytest.mark.parametrize("test", DOCTESTS, ids=[test.name for test in DOCTESTS])
def test_docstring_examples_run(test: doctest.DocTest):
    output: list[str] = []
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    original = test.globs
    test.globs = dict(original)  # a fresh namespace per run, as doctest's own runner does
    try:
        result = runner.run(test, out=output.append, clear_globs=False)
    finally:
        test.globs = original
    assert result.attempted == len(test.examples)
    assert result.failed == 0, "".join(output)
