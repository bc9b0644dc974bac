"""The adapter contract: every adapter decides on every overridable name.

Each adapter package under ``adapters/`` (found by its ``jaxoverride_`` prefix, so a new
adapter is checked without editing this file) declares an
``jaxoverride.adapter_kit.OverrideTable`` when imported. A name of ``OVERRIDEABLE`` that
a table neither overrides nor explicitly passes through would silently fall through to
JAX: that fails here. Adapters import no private core module.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import jaxoverride as jo
from jaxoverride import adapter_kit as kit

ROOT = Path(__file__).resolve().parent.parent
ADAPTERS = sorted(
    path.name
    for path in (ROOT / "adapters").iterdir()
    if path.name.startswith("jaxoverride_") and (path / "__init__.py").exists()
)


def test_the_adapters_are_found():
    assert {"jaxoverride_dag", "jaxoverride_haiku", "jaxoverride_nnx"} <= set(ADAPTERS)


@pytest.mark.parametrize("package", ADAPTERS)
def test_each_adapter_declares_an_override_table(package: str):
    importlib.import_module(package)
    tables = kit.declared_adapters()
    assert package in tables, (
        f"{package} declares no jaxoverride.adapter_kit.OverrideTable named {package!r}"
    )
    assert isinstance(tables[package], kit.Adapter)


@pytest.mark.parametrize("package", ADAPTERS)
def test_each_table_handles_or_passes_through_every_name(package: str):
    importlib.import_module(package)
    table = kit.declared_adapters()[package]
    missing = kit.unhandled_names(table)
    assert not missing, (
        f"{package} neither overrides nor passes through {sorted(missing)}: add each to its "
        "OverrideTable's overrides or to passes_through with the reason"
    )
    assert set(table.overrides) | set(table.passes_through) == jo.OVERRIDEABLE
    assert all(reason.strip() for reason in table.passes_through.values())


@pytest.mark.parametrize("package", ADAPTERS)
def test_the_context_is_the_table(package: str):
    module = importlib.import_module(package)
    table = kit.declared_adapters()[package]
    context = getattr(module, "context", None)
    if context is None or package == "jaxoverride_debug":  # debug: one layer per trace
        pytest.skip(f"{package} has no single context()")
    assert dict(context()) == dict(table.overrides)


@pytest.mark.parametrize("package", ADAPTERS)
def test_no_adapter_imports_a_private_core_module(package: str):
    private = re.compile(r"jaxoverride\._|from jaxoverride import _")
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sorted((ROOT / "adapters" / package).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if private.search(line)
    ]
    assert not offenders, f"private core imports (use jaxoverride.adapter_kit): {offenders}"


def test_a_forgotten_name_is_reported():
    table = kit.OverrideTable(
        "test_contract_forgets", {"lax.scan": jo.lax.scan}, passes_through={"jit": "why not"}
    )
    assert kit.unhandled_names(table) == jo.OVERRIDEABLE - {"lax.scan", "jit"}


def test_a_table_rejects_bad_declarations():
    with pytest.raises(ValueError, match=r"Did you mean 'lax\.scan'"):
        kit.OverrideTable("test_contract_bad", {"scan": jo.lax.scan})
    with pytest.raises(ValueError, match=r"Did you mean 'lax\.scan'"):
        kit.OverrideTable("test_contract_bad", {}, passes_through={"scan": "x"})
    with pytest.raises(ValueError, match="both overridden and passed through"):
        kit.OverrideTable("test_contract_bad", {"jit": jo.jit}, passes_through={"jit": "JAX's own"})
    with pytest.raises(TypeError, match="must be callable"):
        kit.OverrideTable("test_contract_bad", {"jit": 3})
    with pytest.raises(TypeError, match="reason"):
        kit.OverrideTable("test_contract_bad", {}, passes_through={"jit": True})
    assert "test_contract_bad" not in kit.declared_adapters()


def test_the_neutral_names_are_the_overridable_names():
    top = {name for name in jo.OVERRIDEABLE if not name.startswith("lax.")}
    assert all(callable(getattr(jo, name)) for name in top)
    assert {f"lax.{name}" for name in jo.lax._NEUTRAL} == jo.OVERRIDEABLE - top
    assert kit.OVERRIDEABLE is jo.OVERRIDEABLE
