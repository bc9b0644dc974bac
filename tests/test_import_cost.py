"""``import jaxoverride`` loads only the neutral API; the rest comes at first use.

``benchmarks/bench_core.py`` times it (target <= 30 ms on top of ``import jax``); these
tests pin down what keeps it there without timing anything: the modules that the import
does not load, and the public names that still work, loaded on first use. Fresh
interpreters: what is imported is the point.
"""

from __future__ import annotations

from _fresh import run_source

# Loaded only when used: each costs import time that a program using only the neutral API
# (``jo.jit``, ``jo.lax.scan``) would pay for nothing. ``jax.extend``'s ``__init__``
# imports Pallas.
DEFERRED = (
    "jax.extend",
    "jaxoverride._first_call",
    "jaxoverride._interpose",
    "jaxoverride._import_hook",
    "jaxoverride._introspect",
    "jaxoverride._selfcheck",
    "jaxoverride.adapter_kit",
    "importlib.metadata",
)


def test_import_loads_only_the_neutral_api_and_public_names_load_at_first_use():
    result = run_source(
        f"""
        import sys
        import jax
        already = set(sys.modules)
        import jaxoverride as jo
        deferred = [m for m in {DEFERRED!r} if m not in already]
        loaded = [m for m in deferred if m in sys.modules]
        assert loaded == [], loaded

        # The neutral API runs, with nothing active, without loading them either. What
        # JAX's own first computation loads (older JAX finds its backend plugins through
        # importlib.metadata) is JAX's: raw JAX runs first.
        import jax.numpy as jnp
        jax.lax.scan(lambda c, _: (c + 1, None), 0, length=2)
        assert float(jax.jit(lambda x: x * 2)(jnp.float32(2))) == 4.0
        deferred = [m for m in deferred if m not in sys.modules]
        assert float(jo.jit(lambda x: x * 2)(jnp.float32(2))) == 4.0
        with jo.override_context({{"lax.map": jax.lax.map}}):
            jo.lax.scan(lambda c, _: (c + 1, None), 0, length=2)
        loaded = [m for m in deferred if m in sys.modules and m != "jax.extend"]
        assert loaded == [], loaded

        # Every public name is there, and is the object its module defines.
        from jaxoverride import _import_hook, _interpose, _introspect, _selfcheck
        assert jo.interpose is _interpose.interpose
        assert jo.Interposition is _interpose.Interposition
        assert jo.interpose_on_import is _import_hook.interpose_on_import
        assert jo.ImportInterposition is _import_hook.ImportInterposition
        assert jo.current_stack is _introspect.current_stack and jo.Stack is _introspect.Stack
        assert jo.self_check is _selfcheck.self_check
        assert jo.adapter_kit is sys.modules["jaxoverride.adapter_kit"]
        assert jo.errors.MissingAdapterError and jo.lax.scan
        assert isinstance(jo.__version__, str) and jo.__version__
        assert set(jo.__all__) <= set(dir(jo))
        from jaxoverride import adapter_kit, interpose_on_import  # from-imports too
        try:
            jo.no_such_name
        except AttributeError as error:
            assert "no_such_name" in str(error)
        else:
            raise AssertionError("an unknown attribute was found")
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip() == "ok"


def test_the_first_context_entry_with_a_framework_imported_loads_the_first_call_check():
    result = run_source(
        """
        import sys
        import jaxoverride as jo, jaxoverride_plain
        with jaxoverride_plain.context():  # no framework imported: nothing to check
            pass
        assert "jaxoverride._first_call" not in sys.modules
        import haiku, jaxoverride_haiku
        with jaxoverride_haiku.context():
            pass
        from jaxoverride import _first_call, _stack
        assert _stack.on_new_modules is _first_call.refresh
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip() == "ok"
