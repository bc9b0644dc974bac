"""Interposition tells the truth about the import-time transforms it cannot reach.

``precompiled`` lists what ``ImportOrderError`` finds; ``interpose`` and
``interpose_on_import`` warn (``ImportOrderWarning``) with the fix; ``jaxoverride_debug.trace()``
warns too. Each case runs in a fresh interpreter: import order is the point.
"""

from __future__ import annotations

import pytest

from _fresh import run_source


def _run(source: str) -> str:
    result = run_source(source)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


@pytest.mark.parametrize("package", ["optimistix", "equinox"])
def test_precompiled_lists_what_import_order_error_finds_and_warns(package: str):
    out = _run(
        f"""
        import importlib, re, warnings
        import jaxoverride as jo
        from jaxoverride.errors import ImportOrderWarning
        module = importlib.import_module({package!r})
        try:
            jo.interpose_on_import({package!r})
        except jo.ImportOrderError as error:
            count = int(re.search(r"'{package}' (\\d+)", str(error)).group(1))
        else:
            raise AssertionError("no ImportOrderError")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            handle = jo.interpose(module, recursive=True)
        handle.restore()
        assert count > 0 and len(handle.precompiled) == count, (count, handle.precompiled)
        [warning] = [w for w in caught if issubclass(w.category, ImportOrderWarning)]
        text = str(warning.message)
        noun = "transform" if count == 1 else "transforms"
        assert f"holds {{count}} {{noun}} built" in text, text
        assert "interpose_on_import(" in text and {package!r} in text, text
        print(count)
        """
    )
    assert int(out.strip()) > 0


def test_interpose_on_import_warns_about_transforms_an_unwatched_package_builds():
    out = _run(
        """
        import warnings
        import jaxoverride as jo
        from jaxoverride.errors import ImportOrderWarning
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            handle = jo.interpose_on_import("optimistix")  # equinox not named
            import optimistix
        texts = [str(w.message) for w in caught if issubclass(w.category, ImportOrderWarning)]
        assert texts and all("'equinox'" in t for t in texts), texts
        assert handle.precompiled, "the handle lists what it could not reach"
        handle.restore()
        print(len(handle.precompiled))
        """
    )
    assert int(out.strip()) > 0


def test_interpose_on_import_of_the_whole_family_reaches_everything():
    out = _run(
        """
        import warnings
        import jaxoverride as jo
        from jaxoverride.errors import ImportOrderWarning
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            handle = jo.interpose_on_import("equinox", "lineax", "optimistix")
            import optimistix
        assert not [w for w in caught if issubclass(w.category, ImportOrderWarning)]
        assert handle.precompiled == []
        assert type(optimistix.fixed_point).__name__ != "PjitFunction"
        print("ok")
        """
    )
    assert out.strip() == "ok"


def test_debug_trace_warns_about_raw_import_time_transforms():
    out = _run(
        """
        import warnings
        import jax.numpy as jnp
        import optimistix  # imported without interpose_on_import
        import jaxoverride as jo, jaxoverride_debug
        from jaxoverride.errors import ImportOrderWarning
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with jaxoverride_debug.trace(log=lambda call: None):
                jo.eval_shape(lambda x: x + 1, jnp.ones(2))
        texts = [str(w.message) for w in caught if issubclass(w.category, ImportOrderWarning)]
        assert len(texts) == 1, texts
        assert "'optimistix'" in texts[0] and "interpose_on_import(" in texts[0], texts[0]
        print("ok")
        """
    )
    assert out.strip() == "ok"


def test_never_interposed_solver_under_haiku_install_is_caught_with_the_fix():
    """optimistix never interposed, jaxoverride_haiku.install() active: its import-time
    eqx.filter_jit creates the parameters under a raw trace. Init now raises, naming the
    packages and interpose_on_import, instead of returning tracers as parameters."""
    out = _run(
        """
        import jax, jax.numpy as jnp, haiku as hk
        import optimistix as optx
        import jaxoverride as jo, jaxoverride_haiku
        from jaxoverride import _stack

        def forward(x):
            layer = hk.Linear(2, w_init=hk.initializers.RandomNormal(0.1), name="cell")
            solver = optx.FixedPointIteration(rtol=1e-6, atol=1e-6)
            fun = lambda z, _: jnp.tanh(layer(z) + x)
            return optx.fixed_point(fun, solver, jnp.zeros(2), max_steps=200, throw=False).value

        model = hk.transform(forward)
        jaxoverride_haiku.install()
        try:
            model.init(jax.random.PRNGKey(0), jnp.ones(2))
        except jo.errors.MissingAdapterError as error:
            message = str(error)
        else:
            raise AssertionError("tracers leaked out of init silently")
        assert "interpose_on_import(" in message and "'optimistix'" in message, message
        assert "'equinox'" in message, message
        assert _stack.context_snapshot() is _stack.ROOT  # the scope was left
        # What raw JAX gets right under install() still runs: a plain model, jit of apply.
        plain = hk.transform(lambda x: hk.Linear(2)(x))
        params = plain.init(jax.random.PRNGKey(0), jnp.ones(2))
        jax.jit(lambda p, xs: jax.vmap(lambda x: plain.apply(p, None, x))(xs))(
            params, jnp.ones((3, 2))
        )
        jaxoverride_haiku.uninstall()
        print("ok")
        """
    )
    assert out.strip() == "ok"
