"""The adapter's fused rng steps hand out exactly the keys of Haiku's step-by-step ones.

At init, a parameter created inside a traced body draws from a salted sequence
(``fold_in(next(parent), crc32(name))``), and the adapter reserves full rng blocks for a
loop's carry and a rule's call. Both are computed in one cached ``jax.jit`` call instead
of Haiku's split, slices and squeezes: the keys, and the sequences' states afterwards,
must be bit for bit those of ``hk.PRNGSequence``, for raw and typed keys and any
``rng_reserve_size``.
"""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from haiku._src import stateful

from jaxoverride_haiku._creation import _SaltedSequence
from jaxoverride_haiku._rng import CheckedSequence, reserve_full_block

KEYS = {"raw": lambda: jax.random.PRNGKey(7), "typed": lambda: jax.random.key(7)}


def _data(tree):
    def leaf(x):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)

    return jax.tree.map(leaf, tree)


def _same(a, b) -> bool:
    a, b = _data(a), _data(b)
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return all(np.array_equal(x, y) for x, y in pairs)


@pytest.mark.parametrize("kind", sorted(KEYS))
@pytest.mark.parametrize("block", [1, 3])
@pytest.mark.parametrize("parent_subkeys", [0, 2])
def test_salted_draw_is_haikus_draw(kind, block, parent_subkeys):
    key = KEYS[kind]()
    state = (key, tuple(jax.random.split(key, parent_subkeys + 1))[1:])
    salt = 123456789
    with hk.config.context(rng_reserve_size=block):
        reference_parent = hk.PRNGSequence(state)
        reference = hk.PRNGSequence(jax.random.fold_in(next(reference_parent), salt))
        expected = [next(reference), next(reference)]

        parent = CheckedSequence(state)
        salted = _SaltedSequence(parent, salt)
        drawn = [next(salted), next(salted)]

    assert _same(drawn, expected)
    assert _same(parent.internal_state, reference_parent.internal_state)
    assert _same(salted.internal_state, reference.internal_state)


@pytest.mark.parametrize("kind", sorted(KEYS))
def test_salted_state_read_before_a_draw_is_haikus(kind):
    key = KEYS[kind]()
    reference_parent = hk.PRNGSequence(key)
    reference = hk.PRNGSequence(jax.random.fold_in(next(reference_parent), 5))
    reference.reserve(2)

    parent = CheckedSequence((key, ()))
    salted = _SaltedSequence(parent, 5)
    salted.reserve(2)

    assert _same(salted.internal_state, reference.internal_state)
    assert _same(parent.internal_state, reference_parent.internal_state)


@pytest.mark.parametrize("kind", sorted(KEYS))
@pytest.mark.parametrize("block", [1, 3])
@pytest.mark.parametrize("held", [0, 1, 4])
def test_reserve_full_block_is_haikus(kind, block, held):
    key = KEYS[kind]()

    def reserved(reserve):
        def f():
            for _ in range(held):  # leave `held` subkeys in the sequence
                hk.reserve_rng_keys(1)
            reserve()
            return stateful.internal_state().rng

        with hk.config.context(rng_reserve_size=block):
            return hk.transform(f).apply({}, key)

    ours = reserved(reserve_full_block)
    haiku = reserved(stateful.reserve_up_to_full_rng_block)
    assert _same(ours, haiku)


def test_reserve_full_block_without_rng_does_nothing():
    def f():
        reserve_full_block()
        return stateful.internal_state().rng

    assert hk.transform(f).apply({}, None) is None


def test_salted_draw_traces_one_equation():
    def draw(key):
        return next(_SaltedSequence(CheckedSequence((key, ())), 9))

    jaxpr = jax.make_jaxpr(draw)(jax.random.PRNGKey(0))
    assert [eqn.primitive.name for eqn in jaxpr.eqns] in (["jit"], ["pjit"])
