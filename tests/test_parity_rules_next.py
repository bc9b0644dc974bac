"""The rule parity cases again, under JAX's next custom-derivative implementation.

JAX is moving ``jax.custom_vjp`` to ``custom_vjp3`` (flag ``jax_custom_vjp3``, with
``upgrade=True``: it becomes the default one day) and will do the same for ``custom_jvp``
(``jax_custom_jvp3``). Under the flag ``jax.custom_vjp(f)`` returns a different object, with
other attributes and a ``defvjp`` that returns the rule (until JAX 0.11.0), up to JAX 0.11;
from JAX 0.12 it returns the usual object, which runs the next implementation at its call.
Every case of ``test_parity_rules`` runs here with each flag this JAX has turned on (and put
back after the module), idle, under pass-through stacks and under every adapter.
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
import pytest

import _next_flags
import jaxoverride as jo
from _parity import (
    ALL_MODES,
    active,
    adapter_parity_tests,
    check_errors_in_mode,
    parity_tests,
)
from test_parity_rules import CASES, _sin_times, _sin_times_bwd, _sin_times_fwd, rule_errors

NEXT_FLAGS = tuple(flag for flag in _next_flags.available() if flag.startswith("jax_custom_"))
"""The flags of JAX's next custom-rule implementation that this JAX has."""

pytestmark = pytest.mark.skipif(
    not NEXT_FLAGS,
    reason=f"jax {jax.__version__} has no jax_custom_vjp3/jax_custom_jvp3 (0.9.1 and later do)",
)


@pytest.fixture(autouse=True, scope="module")
def next_custom_rules() -> Iterator[None]:
    """Turns on every flag of ``NEXT_FLAGS`` for this module; puts back what was there."""
    with _next_flags.turned_on(NEXT_FLAGS):
        yield


test_parity_next = parity_tests(CASES)
test_parity_next_under_adapter = adapter_parity_tests(CASES)


def test_the_flag_is_on_and_jax_runs_its_next_implementation():
    """Under the flag JAX 0.8.1 to 0.11 return a ``custom_vjp3`` object from
    ``jax.custom_vjp``; JAX 0.12 returns a ``custom_vjp`` that switches to ``custom_vjp3`` at
    the call. Either way the rule is staged as a hijax primitive, not ``custom_vjp_call``."""
    assert "jax_custom_vjp3" in NEXT_FLAGS
    rule = jax.custom_vjp(_sin_times)
    rule.defvjp(_sin_times_fwd, _sin_times_bwd)
    staged = [eqn.primitive.name for eqn in jax.make_jaxpr(rule)(1.0, 2.0).eqns]
    assert staged == ["call_hi_primitive"]


@pytest.mark.parametrize("mode", ALL_MODES)
def test_construction_and_definition_keep_jaxs_api(mode):
    with active(mode):
        ours = jo.custom_vjp(_sin_times, nondiff_argnums=(1,))
        returned = ours.defvjp(_sin_times_fwd, _sin_times_bwd)
    theirs = jax.custom_vjp(_sin_times, nondiff_argnums=(1,))
    theirs_returned = theirs.defvjp(_sin_times_fwd, _sin_times_bwd)
    # custom_vjp3.defvjp returns the rule, for chaining, in JAX 0.8.1 to 0.11.0 and None
    # in 0.11.2: ours returns what JAX's does, with JAX's object replaced by ours.
    assert theirs_returned is theirs or theirs_returned is None
    assert returned is (ours if theirs_returned is theirs else None)
    assert ours.nondiff_argnums == (1,)
    assert (ours.fwd, ours.bwd) == (theirs.fwd, theirs.bwd)
    assert ours.__name__ == theirs.__name__ == "_sin_times"


@pytest.mark.parametrize("mode", ALL_MODES)
def test_errors_inside_the_rules_are_jaxs(mode):
    # custom_vjp3 names a rule by its repr; _parity.error_messages drops the address.
    assert None not in check_errors_in_mode(rule_errors, mode)
