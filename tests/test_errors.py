"""Bad input: every misuse gets a clear error, and leaves every registry, context and module
binding exactly as it was."""

from __future__ import annotations

import json
import threading
import types

import jax
import jax.numpy as jnp
import pytest

import jaxoverride as jo
import jaxoverride_plain
from jaxoverride import _dispatch, _interpose, _stack, lax as jlax


def state():
    """Everything a failed call must leave unchanged."""
    return {
        "context": _stack.context_snapshot(),
        "effective": _stack.effective_snapshot(),
        "installed": _stack.installed,
        "jit_key": _stack._installed_key.value,
        "guards": _stack._guards,
        "idle": _stack.idle,
        "layers": len(_stack._layers),
        "position": _dispatch._position.get(),
        "bindings": dict(_interpose._bindings),
        "resolved": {name: jo.resolve(name) for name in jo.OVERRIDEABLE},
    }


@pytest.fixture
def unchanged():
    """Asserts, after the test body, that the registry is as it was before."""
    before = state()
    yield
    after = state()
    # Tests that enter valid contexts intern their layers (by design, for cache reuse);
    # validation failures must not intern anything: ``nothing_interned`` checks that.
    before.pop("layers"), after.pop("layers")
    assert after == before


@pytest.fixture
def nothing_interned(unchanged):
    """``unchanged``, and no layer was interned: validation happens before anything else."""
    before = len(_stack._layers)
    yield
    assert len(_stack._layers) == before


def passthrough_scan(*args, **kwargs):
    return jo.next_impl("lax.scan")(*args, **kwargs)


def count(n=2):
    return jlax.scan(lambda c, _: (c + 1, None), 0, length=n)[0]


# --- names -------------------------------------------------------------------------------

ENTRY_POINTS = {
    "override_context": lambda mapping: jo.override_context(mapping),
    "install": lambda mapping: jo.install(mapping),
    "install-when": lambda mapping: jo.install(mapping, when=lambda: True),
    "install-scoped": lambda mapping: jo.install(mapping, scoped=True),
}


# Each test loops over inputs instead of parametrizing: conftest collects garbage after
# every test, which costs more than these checks.
UNKNOWN_NAMES = [
    ("lax.scna", "'lax.scan'"),
    ("scan", "'lax.scan'"),  # control flow lives under "lax."
    ("while_loop", "'lax.while_loop'"),
    ("jitt", "'jit'"),
    ("jax.jit", "'jit'"),
    ("jax.lax.scan", "'lax.scan'"),
    ("shardmap", "'shard_map'"),
    ("lax.fori", "'lax.fori_loop'"),
    ("value_and_grads", "'value_and_grad'"),
]


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_unknown_name_names_the_closest_valid_one(nothing_interned, entry):
    for name, closest in UNKNOWN_NAMES:
        with pytest.raises(ValueError, match="unknown override name") as info:
            ENTRY_POINTS[entry]({"lax.map": jax.lax.map, name: passthrough_scan})
        message = str(info.value)
        assert repr(name) in message
        assert f"Did you mean {closest}?" in message, message
        assert "Overridable names are: checkpoint, closure_convert, custom_jvp" in message
        assert entry.split("-")[0] in message  # says which call rejected it


def test_hopeless_name_lists_every_valid_name(nothing_interned):
    for name in ["foo", "", "LAX.SCAN"]:
        with pytest.raises(ValueError, match="unknown override name") as info:
            jo.override_context({name: passthrough_scan})
        assert "Did you mean" not in str(info.value)
        for valid in jo.OVERRIDEABLE:
            assert valid in str(info.value)


def test_non_string_keys(nothing_interned):
    for key in [1, None, jax.lax.scan, ("lax", "scan"), b"lax.scan"]:
        for entry in ENTRY_POINTS.values():
            with pytest.raises(
                TypeError, match=r"override names are strings such as 'lax\.scan'"
            ) as e:
                entry({key: passthrough_scan})
            assert type(key).__name__ in str(e.value)


def test_non_callable_implementation(nothing_interned):
    for impl in [3, None, "jax.lax.scan", [jax.lax.scan], jnp.ones(2)]:
        for where, entry in ENTRY_POINTS.items():
            with pytest.raises(TypeError, match="must be callable") as info:
                entry({"lax.map": jax.lax.map, "lax.scan": impl})
            message = str(info.value)
            assert "'lax.scan'" in message and "jax.lax.scan" in message  # what, and signature
            assert type(impl).__name__ in message
            assert where.split("-")[0] in message


def test_wrong_mapping_type(nothing_interned):
    mappings = [
        [("lax.scan", passthrough_scan)],
        (("lax.scan", passthrough_scan),),
        None,
        "lax.scan",
        passthrough_scan,
        {"lax.scan"},
        42,
    ]
    for mapping in mappings:
        for where, entry in ENTRY_POINTS.items():
            with pytest.raises(TypeError, match="expects a mapping from overridable names") as info:
                entry(mapping)
            assert type(mapping).__name__ in str(info.value)
            assert "dict(" in str(info.value)  # the fix
            assert where.split("-")[0] in str(info.value)


def test_non_string_label(nothing_interned):
    for label in [3, b"x", ["x"]]:
        with pytest.raises(TypeError, match="name= must be a string label"):
            jo.override_context({"lax.scan": passthrough_scan}, name=label)
        with pytest.raises(TypeError, match="name= must be a string label"):
            jo.install({"lax.scan": passthrough_scan}, name=label)


def test_one_bad_entry_rejects_the_whole_mapping(nothing_interned):
    good = {"lax.scan": passthrough_scan, "jit": jax.jit}
    with pytest.raises(ValueError, match="'vmapp'"):
        jo.install({**good, "vmapp": jax.vmap})
    with pytest.raises(TypeError, match="'vmap'"):
        jo.override_context({**good, "vmap": 0})


# --- when= and scoped installations ------------------------------------------------------


def test_non_callable_when(nothing_interned):
    for when in [True, False, 1, "always", jnp.bool_(True)]:
        with pytest.raises(TypeError, match="when= must be a predicate taking no arguments") as e:
            jo.install({"lax.scan": passthrough_scan}, when=when)
        assert type(when).__name__ in str(e.value)


def test_when_and_scoped_together(nothing_interned):
    with pytest.raises(TypeError, match=r"either when=.*or scoped=True"):
        jo.install({"lax.scan": passthrough_scan}, when=lambda: True, scoped=True)


def test_scope_of_a_guarded_installation(unchanged):
    with jo.install({"lax.scan": passthrough_scan}, when=lambda: False) as installation:
        with pytest.raises(TypeError, match=r"scope\(\) is only for.*scoped=True"):
            installation.scope()


def test_when_that_takes_arguments_is_rejected_at_install(unchanged):
    handles = []
    try:
        with pytest.raises(TypeError, match="when= must be a predicate taking no arguments"):
            handles.append(jo.install({"lax.scan": passthrough_scan}, when=lambda frame: True))
    finally:
        for handle in handles:
            handle.uninstall()


def test_raising_predicate_propagates_and_leaves_the_installation_usable(unchanged):
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise LookupError("predicate failed")
        return True

    with jo.install({"lax.scan": passthrough_scan}, when=flaky, name="flaky") as installation:
        with pytest.raises(LookupError, match="predicate failed"):
            count()
        assert installation.installed
        assert int(count(3)) == 3  # the next call works, through the installation
    assert not installation.installed


def test_install_and_uninstall_that_jax_refuses_change_nothing(unchanged, monkeypatch):
    # Setting jax.jit's cache key is the one step of install/uninstall that can fail;
    # a failure must leave the installed list, the guards and the key as they were.
    def refuse(context, value):
        raise RuntimeError("JAX refused the key")

    with monkeypatch.context() as patch:
        patch.setattr(_stack, "set_user_context_global", refuse)
        with pytest.raises(RuntimeError, match="JAX refused the key"):
            jo.install({"lax.scan": passthrough_scan}, name="refused")
    assert not any(entry.layer.label == "refused" for entry in _stack.installed)

    installation = jo.install({"lax.scan": passthrough_scan}, name="kept")
    with monkeypatch.context() as patch:
        patch.setattr(_stack, "set_user_context_global", refuse)
        with pytest.raises(RuntimeError, match="JAX refused the key"):
            installation.uninstall()
        assert installation.installed and int(count(3)) == 3
    assert installation.uninstall()


def test_uninstall_wrong_type(unchanged):
    with pytest.raises(TypeError, match="expects the Installation that install"):
        jo.uninstall(jo.override_context({"lax.scan": passthrough_scan}))


# --- contexts misused --------------------------------------------------------------------


def test_exit_without_enter(unchanged):
    ctx = jo.override_context({"lax.scan": passthrough_scan}, name="never-entered")
    with pytest.raises(RuntimeError, match="reverse order of entry"):
        ctx.__exit__(None, None, None)


def test_exit_in_another_thread_is_refused(unchanged):
    ctx = jo.override_context({"lax.scan": passthrough_scan}, name="threaded")
    errors: list[BaseException] = []
    ctx.__enter__()
    try:

        def leave_elsewhere():
            try:
                ctx.__exit__(None, None, None)
            except RuntimeError as error:
                errors.append(error)

        thread = threading.Thread(target=leave_elsewhere)
        thread.start()
        thread.join()
        assert jo.resolve("lax.scan") is passthrough_scan  # still entered here
    finally:
        ctx.__exit__(None, None, None)
    assert len(errors) == 1 and "in the thread or task that entered them" in str(errors[0])


def test_decorating_a_non_callable(unchanged):
    ctx = jo.override_context({"lax.scan": passthrough_scan})
    with pytest.raises(TypeError, match="used as a decorator expects a function, got int"):
        ctx(3)


def test_context_is_read_only(unchanged):
    ctx = jo.override_context({"lax.scan": passthrough_scan})
    with pytest.raises(TypeError):
        ctx["lax.map"] = jax.lax.map  # type: ignore[index]
    assert dict(ctx) == {"lax.scan": passthrough_scan}


# --- next_impl and resolve ---------------------------------------------------------------


def test_next_impl_outside_an_override(unchanged):
    for name in ["lax.scan", "jit", "lax.switch"]:
        with pytest.raises(RuntimeError, match="no override is running") as info:
            jo.next_impl(name)
        assert "call it from inside an override function" in str(info.value)
        assert "jaxoverride.resolve" in str(info.value)  # the alternative


def test_next_impl_inside_a_context_but_outside_an_override(unchanged):
    with jo.override_context({"lax.scan": passthrough_scan}):
        with pytest.raises(RuntimeError, match="no override is running"):
            jo.next_impl("lax.scan")


def test_next_impl_after_the_override_returned(unchanged):
    """A next_impl captured by a transform override's returned callable cannot be re-asked."""
    asked_late: list[BaseException] = []

    def late_jit(fun, **kwargs):
        inner = jo.next_impl("jit")(fun, **kwargs)

        def call(*args):
            try:
                jo.next_impl("jit")
            except RuntimeError as error:
                asked_late.append(error)
            return inner(*args)

        return call

    with jo.override_context({"jit": late_jit}):
        assert int(jo.jit(lambda x: x + 1)(1)) == 2
    assert len(asked_late) == 1


def test_unknown_names_in_next_impl_and_resolve(unchanged):
    for call in [jo.next_impl, jo.resolve]:
        with pytest.raises(ValueError, match=r"Did you mean 'lax\.scan'"):
            call("lax.scna")
        with pytest.raises(TypeError, match="override names are strings"):
            call(jax.lax.scan)


# --- failures inside overrides unwind --------------------------------------------------


def test_raising_call_override_unwinds_position_and_stack(unchanged):
    def broken_scan(*args, **kwargs):
        raise FloatingPointError("inside the override")

    with pytest.raises(FloatingPointError):
        with jo.override_context({"lax.scan": broken_scan}):
            count()
    assert _dispatch._position.get() is None
    assert int(count()) == 2


def test_raising_transform_build_is_not_cached(unchanged):
    builds: list[int] = []

    def broken_jit(fun, **kwargs):
        builds.append(1)
        raise OverflowError("build failed")

    jitted = jo.jit(lambda x: x * 3)
    ctx = jo.override_context({"jit": broken_jit})
    for _ in range(2):
        with pytest.raises(OverflowError), ctx:
            jitted(1)
    assert builds == [1, 1]  # no half-built entry was kept
    assert jitted._jaxoverride_state.builds == {}
    assert int(jitted(2)) == 6


# --- interpose ---------------------------------------------------------------------------


def module_bindings(module):
    return {name: id(value) for name, value in vars(module).items()}


def test_interpose_a_non_module(unchanged):
    for target, hint in [
        ("optax", "importlib.import_module"),  # a module's name
        (jnp.sin, "__module__"),  # a function of the module
        (None, "__module__"),
        (types.SimpleNamespace(jax=jax), "__module__"),
    ]:
        with pytest.raises(TypeError, match=r"jaxoverride\.interpose expects a module") as info:
            jo.interpose(target)
        assert hint in str(info.value)
        assert type(target).__name__ in str(info.value)


def test_interpose_refuses_jax_jaxlib_and_jaxoverride(unchanged):
    import jaxlib

    for module in [jax, jax.lax, jax.numpy, jaxlib, jo, jlax, jaxoverride_plain]:
        before = module_bindings(module)
        for recursive in (False, True):
            with pytest.raises(ValueError, match="must keep calling JAX directly") as info:
                jo.interpose(module, recursive=recursive)
            assert f"refuses {module.__name__!r}" in str(info.value)
        assert module_bindings(module) == before


def test_interpose_a_module_with_nothing_to_interpose(unchanged):
    before = module_bindings(json)
    with pytest.raises(ValueError, match="holds no module-level reference to jax") as info:
        jo.interpose(json)
    assert "recursive=True" in str(info.value)  # the fix for packages
    with pytest.raises(ValueError, match="nothing to rebind in it or its submodules"):
        jo.interpose(json, recursive=True)
    empty = types.ModuleType("an_empty_module")
    with pytest.raises(ValueError, match="'an_empty_module' holds no module-level reference"):
        jo.interpose(empty)
    assert module_bindings(json) == before


def test_interpose_a_module_holding_a_lookalike(unchanged):
    """Only the real jax objects are rebound: a local ``jax`` that is not jax is left alone."""
    module = types.ModuleType("lookalike")
    module.jax = types.SimpleNamespace(lax=jax.lax)
    module.scan = lambda *args: None
    with pytest.raises(ValueError, match="holds no module-level reference"):
        jo.interpose(module)


class _FussyModule(types.ModuleType):
    """A module whose ``scan`` global cannot be rebound: interposition fails half-way."""

    def __setattr__(self, name, value):
        if name == "scan" and value is not jax.lax.scan:
            raise AttributeError("scan is read-only here")
        super().__setattr__(name, value)


def test_interpose_failing_half_way_rolls_back(unchanged):
    module = _FussyModule("fussy")
    module.jax = jax
    module.lax = jax.lax
    module.scan = jax.lax.scan
    before = module_bindings(module)
    with pytest.raises(AttributeError, match="read-only"):
        jo.interpose(module)
    assert module_bindings(module) == before
    assert module.jax is jax and module.lax is jax.lax


def test_restore_twice_is_harmless(unchanged):
    module = types.ModuleType("twice")
    module.jax = jax
    handle = jo.interpose(module)
    assert module.jax is not jax
    handle.restore()
    handle.restore()
    assert module.jax is jax
