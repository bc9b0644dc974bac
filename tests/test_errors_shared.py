"""One error hierarchy: each adapter's errors are caught by ``jaxoverride.errors``' classes.

Every error is raised by a real misuse through the real framework, then caught three
ways: by the adapter's own class (what users catch today), by the shared class, and by
``JaxoverrideError``. The classes keep their historical bases (``ValueError``, Flax's
``TraceContextError`` ...) and module paths.
"""

from __future__ import annotations

import sys

import haiku as hk
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from flax.errors import TraceContextError

import jaxoverride as jo
import jaxoverride.errors
import jaxoverride_dag as dag
import jaxoverride_haiku as joh
import jaxoverride_nnx as jon
from jaxoverride import errors


def test_the_errors_module_is_exported():
    assert jo.errors is jaxoverride.errors
    assert jo.ImportOrderError is errors.ImportOrderError
    from jaxoverride._import_hook import ImportOrderError  # the path it had before

    assert ImportOrderError is errors.ImportOrderError
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, (errors.JaxoverrideError, Warning)), name


def _haiku_closed_over():
    def f(x):
        scale = jo.custom_vjp(lambda x: x * hk.get_parameter("w", [], init=jnp.ones))
        scale.defvjp(lambda x: (scale(x), None), lambda _, g: (g,))
        return scale(x)

    model = hk.transform(f)
    with joh.context():
        params = model.init(None, 1.0)
        jax.grad(lambda p: model.apply(p, None, 1.0))(params)


def _nnx_closed_over():
    w = nnx.Param(jnp.ones(()))
    f = jo.custom_vjp(lambda x: x * w[...])
    f.defvjp(lambda x: (x * w[...], None), lambda _, g: (g,))
    with jon.track(w):
        jo.grad(lambda p: f(1.0))(w)


def haiku_pure_write_model() -> hk.TransformedWithState:
    """A Haiku model that closure-converts a function writing Haiku state: its init, over
    ``jnp.ones(2)`` under the adapter, raises PureFunctionWriteError (test_messages too)."""

    def forward(x):
        def g(v):
            hk.set_state("n", jnp.ones(()))
            return v

        return jo.closure_convert(g, x)

    return hk.transform_with_state(forward)


def _haiku_pure_write():
    with joh.context():
        haiku_pure_write_model().init(None, jnp.ones(2))


def _nnx_pure_write():
    counter = nnx.Variable(jnp.array(0))

    def g(v):
        counter[...] += 1
        return v

    with jon.track(counter):
        jo.closure_convert(g, jnp.ones(2))


def _haiku_differentiated_state():
    def writes_state(x):  # the primal of the rule, and its fwd
        hk.set_state("y", 3.0 * x)
        return x

    rule = jo.custom_vjp(writes_state)
    rule.defvjp(lambda x: (writes_state(x), None), lambda _, ct: (ct,))
    model = hk.transform_with_state(lambda x: rule(x) + hk.get_state("y", [], init=jnp.zeros))
    with joh.context():
        params, state = model.init(None, 1.0)
        jax.grad(lambda x: model.apply(params, state, None, x)[0])(1.0)


def _nnx_untracked():
    counter = nnx.Variable(jnp.array(0))

    def bump(x):
        counter[...] += 1
        return x

    with jon.context():
        jo.jit(bump)(1.0)


def _nnx_structure_change():
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    def grow(x):
        model.extra = nnx.Variable(x)
        return x

    with jon.track(model):
        jo.jit(grow)(1.0)


def _dag_sharing():
    node = {"w": jnp.ones(2)}  # a shared node under two mapped axes would lose its identity
    with dag.context():
        jo.vmap(lambda a, b: a["w"] + b["w"], in_axes=(0, None))(node, node)


CASES = [
    (_haiku_closed_over, joh.ClosedOverDifferentiationError, errors.ClosedOverDifferentiationError),
    (_nnx_closed_over, jon.ClosedOverDifferentiationError, errors.ClosedOverDifferentiationError),
    (_haiku_pure_write, joh.PureFunctionWriteError, errors.PureFunctionWriteError),
    (_nnx_pure_write, jon.PureFunctionWriteError, errors.PureFunctionWriteError),
    (_haiku_differentiated_state, joh.DifferentiatedStateError, errors.DifferentiatedStateError),
    (_nnx_untracked, jon.UntrackedModuleError, errors.UntrackedModuleError),
    (_nnx_structure_change, jon.StructureChangeError, errors.StructureChangeError),
    (_dag_sharing, dag.SharingError, errors.SharingError),
]


@pytest.mark.parametrize(
    ("misuse", "own", "shared"), CASES, ids=[case[0].__name__[1:] for case in CASES]
)
def test_each_adapter_error_is_caught_by_the_shared_class(misuse, own, shared):
    with pytest.raises(shared) as caught:
        misuse()
    assert type(caught.value) is own  # the adapter's own class, as users catch it today
    assert isinstance(caught.value, errors.JaxoverrideError)


@pytest.mark.parametrize(
    ("own", "base"),
    [
        (joh.ClosedOverDifferentiationError, ValueError),
        (jon.ClosedOverDifferentiationError, ValueError),
        (joh.DifferentiatedStateError, ValueError),
        (joh.PureFunctionWriteError, RuntimeError),
        (jon.PureFunctionWriteError, RuntimeError),
        (jon.UntrackedModuleError, TraceContextError),
        (jon.LevelError, TraceContextError),
        (dag.SharingError, ValueError),
    ],
)
def test_the_historical_bases_are_kept_under_public_paths(own, base):
    assert issubclass(own, base)
    assert issubclass(own, errors.JaxoverrideError)
    # Printed where a program imports it from (issue 31 item 13), not a private module.
    assert own.__module__ in ("jaxoverride_haiku", "jaxoverride_nnx", "jaxoverride_dag")
    assert getattr(sys.modules[own.__module__], own.__name__) is own


def test_the_structure_change_error_is_one_class_under_its_old_names():
    # Not a subclass per adapter: ``jaxoverride_nnx.StructureChangeError`` and the kit's
    # ``StateStructureError`` are ``jaxoverride.errors.StructureChangeError``.
    assert jon.StructureChangeError is errors.StructureChangeError
    assert issubclass(errors.StructureChangeError, ValueError)


def test_the_closed_over_message_is_written_once():
    messages = []
    for misuse in (_haiku_closed_over, _nnx_closed_over):
        with pytest.raises(errors.ClosedOverDifferentiationError) as caught:
            misuse()
        messages.append(str(caught.value))
    haiku, flax = messages
    assert "the Haiku value '~/w'" in haiku and "the tracked Variable `" in flax
    tail = "without having it as an argument. A custom rule gives gradients"
    assert haiku[haiku.index(tail) :] == flax[flax.index(tail) :]
    built = errors.ClosedOverDifferentiationError.reading("jaxoverride.custom_vjp", "x")
    assert haiku.endswith(str(built)[str(built).index(tail) :])
    assert type(jon.ClosedOverDifferentiationError.reading("w", "x")) is (
        jon.ClosedOverDifferentiationError
    )
