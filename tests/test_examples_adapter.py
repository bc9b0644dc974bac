"""``examples/call_counter.py``: a complete adapter written only against the public core and
``jaxoverride.adapter_kit``, keeping the contract, and leaving JAX's results unchanged."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

import jaxoverride as jo
from jaxoverride import adapter_kit as kit

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))

import call_counter  # noqa: E402


def test_it_imports_only_the_core_and_the_kit():
    tree = ast.parse((EXAMPLES / "call_counter.py").read_text())
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module is not None
    }
    ours = {name for name in imported if name.startswith("jaxoverride")}
    assert ours == {"jaxoverride"}, ours
    names = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "jaxoverride"
        for alias in node.names
    }
    assert names <= {"adapter_kit", "lax", "errors"}, names


def test_it_keeps_the_contract():
    assert kit.declared_adapters()["call_counter"] is call_counter.TABLE
    assert not kit.unhandled_names(call_counter.TABLE)


def test_it_counts_per_name_and_changes_no_result(capsys):
    counts = call_counter.main()
    assert counts == {"jit": 3, "lax.while_loop": 1, "jacfwd": 1}
    assert "calls per name" in capsys.readouterr().out
    assert jo.resolve("jit") is jax.jit  # nothing left active


def test_counts_are_private_to_each_block():
    with call_counter.counting() as outer:
        jo.lax.scan(lambda c, x: (c + x, c), 0.0, jnp.arange(3.0))
        with call_counter.counting() as inner:
            jo.vmap(jnp.sin)(jnp.ones(2))
    assert outer == {"lax.scan": 1} and inner == {"vmap": 1}


def test_the_jitted_api_is_kept():
    with call_counter.counting() as counts:
        f = jo.jit(lambda x: x * 2)
        text = f.lower(1.0).as_text()
        assert float(f(1.0)) == 2.0
    assert "stablehlo" in text and counts == {"jit": 1}


def test_it_runs_as_a_script():
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "call_counter.py")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "'lax.while_loop': 1" in result.stdout
