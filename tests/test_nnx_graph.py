"""NNX graph semantics: modules passed as arguments and carries, sharing, native
Variables, and how ``track``, ``context`` and ``install`` compose.

Where Flax has the transform (``nnx.jit``, ``nnx.grad``), the adapter is compared with
it on identically built modules: same outputs, same gradients, same state afterwards.
"""

from __future__ import annotations

import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxoverride as jo
import jaxoverride_nnx
from _nnx_models import Branch, Counter, Dropped, Normed, assert_close, assert_same_state
from jaxoverride import lax as jlax

X = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)


def pair() -> tuple[Branch, Branch]:
    shared = Counter(7)
    return Branch(shared, 8), Branch(shared, 9)


def test_jit_with_module_arguments_matches_nnx_jit_and_aliases():
    def f(a, b, x):
        return a(x) + b(x), a, b

    ours_a, ours_b = pair()
    ref_a, ref_b = pair()
    traces = []

    def counted(*args):
        traces.append(1)
        return f(*args)

    with jax.checking_leaks(), jaxoverride_nnx.context():
        ours = jo.jit(counted)
        out, a, b = ours(ours_a, ours_b, X)
        out2, *_ = ours(ours_a, ours_b, X)
    expected, _, _ = nnx.jit(f)(ref_a, ref_b, X)
    expected2, _, _ = nnx.jit(f)(ref_a, ref_b, X)
    assert a is ours_a and b is ours_b  # outputs alias the inputs
    assert ours_a.shared is ours_b.shared  # sharing kept
    assert_close((out, out2), (expected, expected2))
    assert_same_state((ours_a, ours_b), (ref_a, ref_b))
    assert len(traces) == 1

    fresh_a, fresh_b = pair()  # same structure, new objects: no retrace, as nnx.jit
    with jaxoverride_nnx.context():
        _, a, _ = ours(fresh_a, fresh_b, X)
        assert a is fresh_a and len(traces) == 1
        fresh_a.own.w = nnx.Param(jnp.ones((2, 3)))  # new structure: retrace
        with pytest.raises(TypeError):  # (and the shapes no longer broadcast)
            ours(fresh_a, fresh_b, X)
    assert len(traces) == 2


def test_same_module_twice_is_one_object_inside():
    model = Counter()
    seen = []

    def f(a, b, x):
        seen.append(a is b)
        return a(x) + b(x)

    with jaxoverride_nnx.context():
        jo.jit(f)(model, model, X)
    assert seen == [True] and int(model.count[...]) == 2


def test_module_both_tracked_and_passed_is_the_same_object():
    model = Counter()
    seen = []

    def f(m, x):
        seen.append(m is model)
        return m(x) + model(x)

    with jaxoverride_nnx.track(model):
        jo.jit(f)(model, X)
        jlax.scan(lambda m, _: (m, f(m, X)), model, length=2)
    assert seen == [True, True] and int(model.count[...]) == 6


def test_grad_with_respect_to_a_module_matches_nnx_grad():
    def loss(model, x):
        return (model(x) ** 2).sum()

    def ours_step(model, x):
        value, grads = jo.value_and_grad(loss)(model, x)
        return value, grads, jo.grad(loss)(model, x)

    def reference_step(model, x):
        value, grads = nnx.value_and_grad(loss)(model, x)
        return value, grads, nnx.grad(loss)(model, x)

    for build in (Dropped, Normed):
        ours, reference = build(), build()
        with jax.checking_leaks(), jaxoverride_nnx.context():
            got = jo.jit(ours_step)(ours, X)
        expected = nnx.jit(reference_step)(reference, X)
        assert isinstance(got[1], nnx.State)
        assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(expected)
        assert_close(got, expected)
        assert_same_state(ours, reference)


def test_grad_with_module_in_a_non_differentiated_argument():
    model = Counter()
    with jaxoverride_nnx.context():
        g = jo.grad(lambda x, m: m(x).sum())(X, model)
    expected = jax.grad(lambda x: jnp.sin(x * model.w[...]).sum())(X)
    assert_close(g, expected)
    assert int(model.count[...]) == 1


def test_loop_carries_keep_module_identity_and_state():
    ours, reference = Counter(), Counter()
    with jax.checking_leaks(), jaxoverride_nnx.context():
        (m, x), _ = jlax.scan(lambda c, _: ((c[0], c[0](c[1])), c[1].sum()), (ours, X), length=3)
        m2, x2 = jlax.while_loop(
            lambda c: c[0].count[...] < 5, lambda c: (c[0], c[0](c[1])), (ours, x)
        )
        m3, x3 = jlax.fori_loop(0, 2, lambda i, c: (c[0], c[0](c[1]) * i), (ours, x2))
        m4 = jlax.cond(True, lambda mm: mm, lambda mm: mm, ours)
    assert m is m2 is m3 is m4 is ours
    expected = X
    for _ in range(3):
        expected = reference(expected)
    expected2 = expected
    while int(reference.count[...]) < 5:
        expected2 = reference(expected2)
    expected3 = expected2
    for i in range(2):
        expected3 = reference(expected3) * i
    assert_close((x, x2, x3), (expected, expected2, expected3))
    assert_same_state(ours, reference)


def test_vmap_broadcasts_module_arguments_like_closures():
    ours, closed, reference = Counter(), Counter(), Counter()
    with jaxoverride_nnx.track(closed):
        by_closure = jo.vmap(lambda x: closed(x))(X)
        by_argument = jo.vmap(lambda m, x: m(x), in_axes=(None, 0))(ours, X)
    assert_close(by_argument, by_closure)
    assert_same_state(ours, closed)
    reference(X[0])
    assert_same_state(ours, reference)


def test_checkpoint_and_eval_shape_with_module_arguments():
    ours, reference = Counter(), Counter()
    with jaxoverride_nnx.context():
        out = jo.checkpoint(lambda m, x: m(x))(ours, X)
        shapes = jo.eval_shape(lambda m, x: (m(x), m), ours, X)
    assert_close(out, reference(X))
    assert shapes[1] is ours and shapes[0].shape == X.shape
    assert_same_state(ours, reference)  # eval_shape ran nothing


def test_while_cond_that_writes_runs_as_often_as_in_python():
    model = Counter()

    def cond(x):
        model.count[...] += 100  # the test itself counts
        return x.sum() < 10.0

    def body(x):
        return x + 1.0

    with jaxoverride_nnx.track(model):
        out = jlax.while_loop(cond, body, jnp.zeros(2))
    python_count, value = 0, np.zeros(2)
    while True:
        python_count += 100
        if not value.sum() < 10.0:
            break
        value = value + 1.0
    assert_close(out, value)
    assert int(model.count[...]) == python_count == 600


def test_map_with_batch_size_and_jvp_vjp_linearize():
    ours, reference = Counter(), Counter()
    xs = jnp.linspace(0.0, 1.0, 15).reshape(5, 3)
    with jaxoverride_nnx.track(ours):
        mapped = jlax.map(lambda x: ours.w[...] * x, xs, batch_size=2)
        y, dy = jo.jvp(lambda x: ours(x), (X,), (jnp.ones_like(X),))
        y2, pullback = jo.vjp(lambda x: ours(x), X)
        (cotangent,) = pullback(jnp.ones_like(X))
        y3, linear = jo.linearize(lambda x: ours(x), X)
    assert_close(mapped, xs * reference.w[...])
    ref_y, ref_dy = jax.jvp(lambda x: jnp.sin(x * reference.w[...]), (X,), (jnp.ones_like(X),))
    assert_close(
        (y, dy, cotangent, linear(jnp.ones_like(X))), (ref_y + 0.1, ref_dy, ref_dy, ref_dy)
    )
    assert_close((y2, y3), (ref_y + 0.2, ref_y + 0.3))
    assert int(ours.count[...]) == 3


def _ref_or_hijax_counter(mode: str) -> Counter:
    old_nnx: Any = nnx  # names that only Flax releases before var_defaults have
    if hasattr(nnx, "var_defaults"):
        with nnx.var_defaults(**{mode: True}):
            return Counter()
    if mode == "hijax":  # Flax 0.12.1 has no var_defaults, only these older spellings
        with old_nnx.use_hijax(True):
            return Counter()
    return old_nnx.as_ref_vars(Counter())


def _raw_jit_writes(mode: str) -> type[Exception] | None:
    """What raw ``jax.jit`` does to such a Variable that its function writes: None if the
    write works, else Flax's error type (a non-ref hijax Variable is immutable inside every
    JAX transform from Flax 0.12.10; writable in 0.12.8)."""
    model = _ref_or_hijax_counter(mode)
    try:
        jax.jit(lambda x: model(x))(X)
    except Exception as error:
        return type(error)
    assert int(model.count[...]) == 1
    return None


@pytest.mark.parametrize("mode", ["ref", "hijax"])
def test_ref_and_hijax_variables_are_left_alone(mode):
    """The adapter tracks neither kind: they behave inside neutral transforms exactly as
    Flax makes them behave inside raw ones, whether that is a write or Flax's refusal."""
    raw = _raw_jit_writes(mode)
    model = _ref_or_hijax_counter(mode)
    plain_model = Counter()
    with jaxoverride_nnx.track(model, plain_model):
        names = [path for path, _ in jaxoverride_nnx.tracked_variables()]
        if raw is not None:
            with pytest.raises(raw):
                jo.jit(lambda x: model(x) + plain_model(x))(X)
            jo.jit(lambda x: plain_model(x))(X)  # the tracked model still works
            with pytest.raises(raw):
                jlax.scan(lambda c, _: (model(c), None), X, length=2)
        else:
            jo.jit(lambda x: model(x) + plain_model(x))(X)
            jlax.scan(lambda c, _: (model(c), None), X, length=2)
    assert names == ["Counter#2.count", "Counter#2.w"]
    assert int(plain_model.count[...]) == 1
    assert int(model.count[...]) == (0 if raw is not None else 3)


def test_nested_scopes_track_the_union_and_reenter():
    a, b = Counter(), Counter(seed=1)
    scope = jaxoverride_nnx.track(a)
    with scope:
        with jaxoverride_nnx.track(b):
            jo.jit(lambda x: a(x) + b(x))(X)
            assert len(jaxoverride_nnx.tracked_variables()) == 4
        with scope:  # re-entering the same Track object nests
            jo.jit(lambda x: a(x))(X)
        assert len(jaxoverride_nnx.tracked_variables()) == 2
    assert jaxoverride_nnx.tracked_variables() == []
    assert int(a.count[...]) == 2 and int(b.count[...]) == 1


def test_install_makes_track_use_the_installed_layer():
    model = Counter()
    handle = jaxoverride_nnx.install()
    try:
        again = jaxoverride_nnx.install()  # idempotent: still one installed layer
        assert handle.installed and again.installed
        assert [layer.source for layer in jo.current_stack().layers] == ["installed (inactive)"]
        with jaxoverride_nnx.track(model):
            sources = [layer.source for layer in jo.current_stack().layers]
            jlax.scan(lambda c, _: (model(c), None), X, length=3)
        assert sources == ["installed, scope"]  # track entered the scope, no context on top
        assert [layer.source for layer in jo.current_stack().layers] == ["installed (inactive)"]
    finally:
        assert jaxoverride_nnx.uninstall()
    assert not jaxoverride_nnx.uninstall()
    assert int(model.count[...]) == 3


def test_tracking_is_private_to_a_thread():
    model = Counter()
    seen = {}

    def other():
        seen["tracked"] = jaxoverride_nnx.tracked_variables()
        try:
            jlax.scan(lambda c, _: (model(c), None), X, length=2)
        except Exception as error:  # not tracked in this thread
            seen["error"] = type(error).__name__

    with jaxoverride_nnx.track(model):
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    # The write is refused with the fix (a MissingAdapterError that is a TraceContextError).
    assert seen == {"tracked": [], "error": "MissingAdapterError"}


def test_context_composes_with_other_overrides():
    model = Counter()
    log = []

    def logging_scan(*args, **kwargs):
        log.append("scan")
        return jo.next_impl("lax.scan")(*args, **kwargs)

    with jaxoverride_nnx.track(model), jo.override_context({"lax.scan": logging_scan}):
        jlax.scan(lambda c, _: (model(c), None), X, length=2)
    assert log == ["scan"] and int(model.count[...]) == 2
