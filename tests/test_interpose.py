"""``jo.interpose`` on real, unmodified installed libraries.

optax calls ``jax.lax.while_loop`` inside its functions: ``optax._src.linesearch`` via
``import jax`` and ``optax._src.linear_algebra`` via ``from jax import lax``. equinox's
``equinox.internal._misc`` does ``import jax.lax as lax`` (``lax.scan``/``lax.switch``) and
``flax.linen.linear`` does ``from jax import eval_shape, lax``. No installed library does
``from jax.lax import scan`` or ``from jax import jit``, so a tiny module written here
covers those two import styles, and only those.
"""

from __future__ import annotations

import importlib
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax._src.linear_algebra as linear_algebra
import optax._src.linesearch as linesearch
import optax.tree_utils._tree_math as tree_math
import pytest

import jaxoverride as jo
from _parity import (
    LOG,
    PASSTHROUGH_CONTEXT,
    assert_same,
    fresh_jax_caches_per_module,  # noqa: F401 - an autouse fixture
)
from jaxoverride import _interpose, _raw

SPD = np.array([[4.0, 1.0, 0.5], [1.0, 3.0, 0.2], [0.5, 0.2, 2.0]], np.float32)


def bindings(module):
    """Identity of every global of ``module``."""
    return {name: id(value) for name, value in vars(module).items()}


def changed(before, module):
    after = bindings(module)
    assert after.keys() == before.keys()
    return sorted(name for name in before if before[name] != after[name])


def power_iteration():
    return linear_algebra.power_iteration(jnp.asarray(SPD), num_iters=50)


def inverse_root():
    return linear_algebra.matrix_inverse_pth_root(jnp.asarray(SPD), 2, num_iters=20)


def quadratic(params):
    return jnp.sum((params - jnp.arange(3.0)) ** 2 * jnp.array([1.0, 3.0, 10.0]))


def linesearch_step(kind: str):
    """One optimiser step with a line search, as optax's documentation spells it."""
    search = (
        optax.scale_by_backtracking_linesearch(max_backtracking_steps=15)
        if kind == "backtracking"
        else optax.scale_by_zoom_linesearch(max_linesearch_steps=10)
    )
    solver = optax.chain(optax.sgd(learning_rate=1.0), search)
    params = jnp.array([1.0, -2.0, 0.5])
    state = solver.init(params)
    value, grad = jax.value_and_grad(quadratic)(params)
    updates, _ = solver.update(grad, state, params, value=value, grad=grad, value_fn=quadratic)
    return optax.apply_updates(params, updates)


def logged(thunk):
    """Runs ``thunk`` inside the pass-through context; returns (result, names it reached)."""
    with PASSTHROUGH_CONTEXT:
        LOG.clear()
        result = thunk()
        seen = list(LOG)
    LOG.clear()
    return result, seen


@pytest.mark.parametrize(
    ("module", "thunk", "expected"),
    [
        (linear_algebra, power_iteration, {"lax.while_loop"}),  # jax.lax.while_loop
        (linear_algebra, inverse_root, {"lax.while_loop"}),  # from jax import lax
        (linesearch, lambda: linesearch_step("backtracking"), {"lax.while_loop"}),
        (
            linesearch,
            lambda: linesearch_step("zoom"),
            {"lax.while_loop", "lax.cond", "value_and_grad"},
        ),
    ],
    ids=["power_iteration", "matrix_inverse_pth_root", "backtracking", "zoom"],
)
def test_override_sees_library_calls_only_while_interposed(module, thunk, expected):
    raw = thunk()
    before_result, before_seen = logged(thunk)
    with jo.interpose(module) as handle:
        during_result, during_seen = logged(thunk)
        idle_result = thunk()  # interposed but nothing active: still JAX's result
    after_result, after_seen = logged(thunk)

    assert before_seen == [] and after_seen == []  # raw jax: the override never sees it
    assert expected <= set(during_seen), during_seen
    for result in (before_result, during_result, idle_result, after_result):
        assert_same(result, raw)
    assert handle.rebound == {
        module.__name__: ["jax", "lax"] if module is linear_algebra else ["jax"]
    }


def test_interposed_jax_is_jax_with_neutral_transforms():
    with jo.interpose(linesearch):
        seen = linesearch.jax
        assert seen is not jax and seen.__name__ == "jax"
        assert seen.lax is jo.lax and seen.lax.while_loop is jo.lax.while_loop
        for name in ("jit", "vmap", "grad", "value_and_grad", "jvp", "eval_shape", "shard_map"):
            assert getattr(seen, name) is getattr(jo, name), name
        # Everything else is jax's own object, so isinstance checks and submodules work.
        assert seen.numpy is jax.numpy and seen.tree_util is jax.tree_util
        assert seen.Array is jax.Array and seen.random is jax.random
        assert seen.lax.add is jax.lax.add
        assert set(dir(jax)) <= set(dir(seen))
    assert linesearch.jax is jax


def test_only_jax_references_change():
    for module, expected in [(linesearch, ["jax"]), (linear_algebra, ["jax", "lax"])]:
        before = bindings(module)
        with jo.interpose(module):
            assert changed(before, module) == expected
            assert module.jnp is jax.numpy  # jax.numpy is not a neutral namespace
            assert module.functools is sys.modules["functools"]
        assert bindings(module) == before


def test_reversible_as_a_context_manager_and_on_exception():
    before = bindings(linear_algebra)

    def fail_inside():
        with jo.interpose(linear_algebra):
            assert linear_algebra.lax is jo.lax
            raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        fail_inside()
    assert bindings(linear_algebra) == before
    assert linear_algebra.lax is jax.lax and linear_algebra.jax is jax


@pytest.mark.parametrize("order", ["fifo", "lifo"])
def test_idempotent_and_nesting(order):
    before = bindings(linear_algebra)
    first = jo.interpose(linear_algebra)
    interposed = bindings(linear_algebra)
    second = jo.interpose(linear_algebra)
    assert bindings(linear_algebra) == interposed  # interposing again changes nothing
    assert second.rebound == first.rebound
    handles = [first, second] if order == "fifo" else [second, first]
    handles[0].restore()
    assert bindings(linear_algebra) == interposed  # the other handle still holds it
    _, seen = logged(power_iteration)
    assert "lax.while_loop" in seen
    handles[1].restore()
    assert bindings(linear_algebra) == before
    assert _interpose._bindings == {}


def test_restore_leaves_a_binding_the_user_changed_since():
    """If someone rebinds the global while interposed, restore does not clobber it."""
    with jo.interpose(linesearch):
        replacement = object()
        linesearch.jax = replacement
    try:
        assert linesearch.jax is replacement
    finally:
        linesearch.jax = jax


def optax_modules():
    return {
        name: module
        for name, module in sys.modules.items()
        if name == "optax" or name.startswith("optax.")
    }


def test_recursive_on_a_package():
    before = {name: bindings(module) for name, module in optax_modules().items()}
    with jo.interpose(optax, recursive=True) as handle:
        assert handle.rebound["optax._src.linesearch"] == ["jax"]
        assert handle.rebound["optax._src.linear_algebra"] == ["jax", "lax"]
        assert len(handle.rebound) > 20
        _, seen = logged(lambda: linesearch_step("zoom"))
        assert {"lax.while_loop", "lax.cond", "value_and_grad"} <= set(seen)
        for name, module in optax_modules().items():
            if name in before:
                assert sorted(handle.rebound.get(name, [])) == changed(before[name], module)
    assert {
        name: bindings(module) for name, module in optax_modules().items() if name in before
    } == before


def test_non_recursive_on_a_package_points_to_recursive():
    """optax's ``__init__`` holds no jax reference itself: refused, with the fix named."""
    before = {name: bindings(module) for name, module in optax_modules().items()}
    with pytest.raises(ValueError, match="pass recursive=True for a package"):
        jo.interpose(optax)
    assert {name: bindings(module) for name, module in optax_modules().items()} == before


def test_precompiled_functions_are_reported_and_stay_raw():
    with jo.interpose(tree_math) as handle:
        assert "optax.tree_utils._tree_math.tree_bias_correction" in handle.precompiled
        assert tree_math.tree_bias_correction is optax.tree_utils.tree_bias_correction
        # Still JAX's own jit object; once an adapter was entered, behind a first-call guard.
        raw = _raw.unguarded(tree_math.tree_bias_correction)
        assert type(raw).__name__ == "PjitFunction"
        assert handle.rebound == {"optax.tree_utils._tree_math": ["jax"]}


def test_import_jax_lax_as_lax_style_equinox():
    import equinox.internal._misc as misc

    intermediates = [lambda x: x * 2.0, lambda x: x + 1.0]

    def run():
        return misc.scan_trick(jnp.sin, intermediates, jnp.float32(0.3))

    raw = run()
    with jo.interpose(misc) as handle:
        assert misc.lax is jo.lax
        result, seen = logged(run)
    assert handle.rebound == {"equinox.internal._misc": ["lax"]}
    assert {"lax.scan", "lax.switch"} <= set(seen)
    assert_same(result, raw)
    assert misc.lax is jax.lax


def test_from_jax_import_function_style_flax():
    import flax.linen as nn
    import flax.linen.linear as linear

    layer = nn.ConvLocal(features=2, kernel_size=(2,))
    x = jnp.ones((1, 5, 3))

    def init():
        return layer.init(jax.random.key(0), x)

    raw = init()
    before = bindings(linear)
    with jo.interpose(linear) as handle:
        assert linear.eval_shape is jo.eval_shape and linear.lax is jo.lax
        assert changed(before, linear) == ["eval_shape", "jax", "lax"]
        result, seen = logged(init)
    assert "eval_shape" in seen
    assert_same(result, raw)
    assert sorted(handle.rebound["flax.linen.linear"]) == ["eval_shape", "jax", "lax"]
    assert bindings(linear) == before


TINY = '''
"""Written by the test: the import styles no installed library uses."""
from jax import jit, vmap
from jax.lax import scan, while_loop
import jax.numpy as jnp

ANSWER = 42


def cumulative(xs):
    return scan(lambda c, x: (c + x, c + x), 0.0, xs)[1]


def countdown(n):
    return while_loop(lambda v: v > 0, lambda v: v - 1, n)


def doubled(x):
    return jit(vmap(lambda v: v * 2))(x)


PRECOMPILED = jit(lambda v: v + 1)
'''


@pytest.fixture
def tiny(tmp_path):
    (tmp_path / "jo_tiny_styles.py").write_text(textwrap.dedent(TINY))
    sys.path.insert(0, str(tmp_path))
    try:
        yield importlib.import_module("jo_tiny_styles")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("jo_tiny_styles", None)


def test_from_jax_lax_import_and_from_jax_import_styles(tiny):
    xs = jnp.arange(4.0)
    raw = (tiny.cumulative(xs), tiny.countdown(3), tiny.doubled(xs))
    before = bindings(tiny)
    with jo.interpose(tiny) as handle:
        assert tiny.scan is jo.lax.scan and tiny.while_loop is jo.lax.while_loop
        assert tiny.jit is jo.jit and tiny.vmap is jo.vmap
        assert changed(before, tiny) == ["jit", "scan", "vmap", "while_loop"]
        results, seen = logged(lambda: (tiny.cumulative(xs), tiny.countdown(3), tiny.doubled(xs)))
    assert sorted(handle.rebound["jo_tiny_styles"]) == ["jit", "scan", "vmap", "while_loop"]
    assert handle.precompiled == ["jo_tiny_styles.PRECOMPILED"]
    assert {"lax.scan", "lax.while_loop", "jit", "vmap"} <= set(seen)
    assert_same(results, raw)
    assert bindings(tiny) == before
    assert tiny.ANSWER == 42 and tiny.jnp is jax.numpy
