"""Differential parity of ``jaxoverride.lax`` control flow against ``jax.lax``.

Every case runs through JAX and through jaxoverride, with nothing active and under a
pass-through override (see ``_parity``), and must give the same outputs, the same
``jax.make_jaxpr`` text and the same derivatives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import _parity
import jaxoverride as jo
from _parity import (
    JAX,
    Case,
    active,
    f32,
    fresh_jax_caches_per_module,  # noqa: F401 - an autouse fixture
    jaxpr_text,
)

# Bodies live at module level so that JAX and jaxoverride see the very same function.


def scan_body(carry, x):
    return carry * 0.9 + jnp.sin(x), carry * x


def count_body(carry, _):
    return carry * 1.1 + 1.0, carry


def tree_scan_body(carry, xs):
    a, b = xs
    new = {"h": jnp.tanh(carry["h"] * a + b), "n": carry["n"] + 1}
    return new, None


def while_cond(state):
    return state[0] < 10


def while_body(state):
    i, x = state
    return i + 1, jnp.sin(x) * 1.5


def fori_body(i, x):
    return x * 0.8 + jnp.cos(x) * i


def branch_a(x, y, z):
    return x + y * z


def branch_b(x, y, z):
    return x * y - z


def branch_c(x, y, z):
    return jnp.sin(x) + y + z


def one_a(x):
    return jnp.sin(x) * 2.0


def one_b(x):
    return jnp.cos(x) - 1.0


def one_c(x):
    return x**2


def map_f(x):
    return jnp.tanh(x) * x.sum()


def tree_map_f(tree):
    return {"s": tree["a"] * tree["b"], "t": jnp.sum(tree["a"])}


def pair_branch_a(pair):
    return pair[0] + pair[1]


def pair_branch_b(pair):
    return pair[0] * pair[1]


# Rows of one family differ only in their options: each builder writes the family's call once.


def scan_case(id: str, xs_rows: int, *options: Any, argnums=(0,), **keywords: Any) -> Case:
    """``lax.scan(scan_body, carry, xs, *options, **keywords)``, a carry of 3 and xs of
    ``xs_rows`` by 3."""
    return Case(
        id,
        lambda api, c, xs: api.lax.scan(scan_body, c, xs, *options, **keywords),
        lambda: (f32(3), f32(xs_rows, 3)),
        ("lax.scan",),
        argnums=argnums,
    )


def while_case(id: str, start: int) -> Case:
    """``lax.while_loop(while_cond, while_body, (start, x))`` over an x of 3, forward-mode:
    JAX cannot reverse-differentiate a while loop."""
    return Case(
        id,
        lambda api, x: api.lax.while_loop(while_cond, while_body, (start, x)),
        lambda: (f32(3),),
        ("lax.while_loop",),
        diff="fwd",
    )


def fori_case(id: str, lower: int, upper: int, **keywords: Any) -> Case:
    """``lax.fori_loop(lower, upper, fori_body, x, **keywords)`` over an x of 3."""
    return Case(
        id,
        lambda api, x: api.lax.fori_loop(lower, upper, fori_body, x, **keywords),
        lambda: (f32(3),),
        ("lax.fori_loop",),
    )


def one_operand_cond_case(id: str, predicate: Callable[[Any], Any], size: int) -> Case:
    """``lax.cond(predicate(x), one_a, one_b, x)`` over an x of ``size``."""
    return Case(
        id,
        lambda api, x: api.lax.cond(predicate(x), one_a, one_b, x),
        lambda: (f32(size),),
        ("lax.cond",),
    )


def switch_case(id: str, index: int) -> Case:
    """``lax.switch(index, [one_a, one_b, one_c], x)`` over an x of 3."""
    return Case(
        id,
        lambda api, x: api.lax.switch(index, [one_a, one_b, one_c], x),
        lambda: (f32(3),),
        ("lax.switch",),
    )


def map_case(id: str, shape: tuple[int, int], **keywords: Any) -> Case:
    """``lax.map(map_f, xs, **keywords)`` over xs of ``shape``."""
    return Case(
        id, lambda api, xs: api.lax.map(map_f, xs, **keywords), lambda: (f32(*shape),), ("lax.map",)
    )


CASES = [
    # --- scan ---------------------------------------------------------------------------
    scan_case("scan", 5, argnums=(0, 1)),
    Case(
        "scan-xs-none-length",
        lambda api, c: api.lax.scan(count_body, c, length=4),
        lambda: (f32(2),),
        ("lax.scan",),
    ),
    Case(
        "scan-xs-none-explicit-keywords",
        lambda api, c: api.lax.scan(f=count_body, init=c, xs=None, length=3),
        lambda: (f32(2),),
        ("lax.scan",),
    ),
    scan_case("scan-reverse", 4, reverse=True, argnums=(0, 1)),
    scan_case("scan-unroll-2", 5, unroll=2, argnums=(0, 1)),
    scan_case("scan-unroll-true", 4, unroll=True),
    scan_case("scan-unroll-beyond-length", 3, unroll=16),
    scan_case("scan-all-positional", 4, 4, True, 2, argnums=(0, 1)),
    scan_case("scan-length-with-xs", 6, length=6),
    Case(
        "scan-zero-length",
        lambda api, c, xs: api.lax.scan(scan_body, c, xs),
        lambda: (f32(3), np.zeros((0, 3), np.float32)),
        ("lax.scan",),
    ),
    Case(
        "scan-pytree",
        lambda api, h, a, b: api.lax.scan(tree_scan_body, {"h": h, "n": jnp.int32(0)}, (a, b)),
        lambda: (f32(2), f32(3, 2), f32(3, 2, offset=0.5)),
        ("lax.scan",),
        argnums=(0, 1, 2),
    ),
    Case(
        "scan-integer-carry",
        lambda api, xs: api.lax.scan(lambda c, x: (c + x, c * 2), 0, xs),
        lambda: (np.arange(5, dtype=np.int32),),
        ("lax.scan",),
        diff=None,
    ),
    # --- while_loop ---------------------------------------------------------------------
    while_case("while_loop", 0),
    Case(
        "while_loop-keywords",
        lambda api, x: api.lax.while_loop(
            cond_fun=while_cond, body_fun=while_body, init_val=(jnp.int32(3), x)
        ),
        lambda: (f32(2),),
        ("lax.while_loop",),
        diff="fwd",
    ),
    while_case("while_loop-zero-trips", 20),
    # --- fori_loop ----------------------------------------------------------------------
    fori_case("fori_loop-static-bounds", 0, 5),
    Case(
        "fori_loop-traced-bounds",
        lambda api, lo, hi, x: jax.jit(lambda lo, hi, x: api.lax.fori_loop(lo, hi, fori_body, x))(
            lo, hi, x
        ),
        lambda: (np.int32(1), np.int32(6), f32(3)),
        ("lax.fori_loop",),
        diff="fwd",
        argnums=(2,),
    ),
    Case(
        "fori_loop-traced-upper-only",
        lambda api, hi, x: jax.jit(lambda hi, x: api.lax.fori_loop(0, hi, fori_body, x))(hi, x),
        lambda: (np.int32(4), f32(3)),
        ("lax.fori_loop",),
        diff="fwd",
        argnums=(1,),
    ),
    fori_case("fori_loop-unroll", 0, 6, unroll=3),
    Case(
        "fori_loop-keywords",
        lambda api, x: api.lax.fori_loop(lower=2, upper=4, body_fun=fori_body, init_val=x),
        lambda: (f32(3),),
        ("lax.fori_loop",),
    ),
    fori_case("fori_loop-empty-range", 5, 2),
    # --- cond ---------------------------------------------------------------------------
    one_operand_cond_case("cond-one-operand", lambda x: x.sum() > 0, 4),
    one_operand_cond_case("cond-false-branch", lambda x: x.sum() > 100, 4),
    Case(
        "cond-several-operands",
        lambda api, x, y, z: api.lax.cond(x[0] < 0, branch_a, branch_b, x, y, z),
        lambda: (f32(3), f32(3, offset=1), f32(3, offset=2)),
        ("lax.cond",),
        argnums=(0, 1, 2),
    ),
    Case(
        "cond-operand-keyword",
        lambda api, x, y: api.lax.cond(True, pair_branch_a, pair_branch_b, operand=(x, y)),
        lambda: (f32(3), f32(3, offset=1)),
        ("lax.cond",),
        argnums=(0, 1),
    ),
    Case(
        "cond-no-operands",
        lambda api, x: api.lax.cond(x[1] > 0, lambda: x * 2, lambda: x - 1),
        lambda: (f32(3),),
        ("lax.cond",),
    ),
    one_operand_cond_case("cond-python-bool-predicate", lambda x: False, 3),
    Case(
        "cond-integer-predicate",
        lambda api, p, x: api.lax.cond(p, one_a, one_b, x),
        lambda: (np.int32(3), f32(3)),
        ("lax.cond",),
        argnums=(1,),
    ),
    # --- switch -------------------------------------------------------------------------
    switch_case("switch-in-range", 1),
    switch_case("switch-index-above-range", 7),
    switch_case("switch-negative-index", -4),
    Case(
        "switch-traced-out-of-range",
        lambda api, i, x: api.lax.switch(i, (one_a, one_b, one_c), x),
        lambda: (np.int32(9), f32(3)),
        ("lax.switch",),
        argnums=(1,),
    ),
    Case(
        "switch-several-operands",
        lambda api, i, x, y, z: api.lax.switch(i, [branch_a, branch_b, branch_c], x, y, z),
        lambda: (np.int32(2), f32(3), f32(3, offset=1), f32(3, offset=2)),
        ("lax.switch",),
        argnums=(1, 2, 3),
    ),
    Case(
        "switch-operand-keyword",
        lambda api, x, y: api.lax.switch(0, [pair_branch_a, pair_branch_b], operand=(x, y)),
        lambda: (f32(3), f32(3, offset=1)),
        ("lax.switch",),
        argnums=(0, 1),
    ),
    Case(
        "switch-single-branch",
        lambda api, x: api.lax.switch(3, [one_c], x),
        lambda: (f32(3),),
        ("lax.switch",),
    ),
    # --- map ----------------------------------------------------------------------------
    map_case("map", (5, 3)),
    map_case("map-batch-size-with-remainder", (7, 2), batch_size=3),
    map_case("map-batch-size-divides", (4, 2), batch_size=2),
    Case(
        "map-pytree",
        lambda api, a, b: api.lax.map(tree_map_f, {"a": a, "b": b}),
        lambda: (f32(4, 2), f32(4, 2, offset=1)),
        ("lax.map",),
        argnums=(0, 1),
    ),
    # --- nesting: neutral calls inside neutral bodies ------------------------------------
    Case(
        "scan-of-cond-of-map",
        lambda api, c, xs: api.lax.scan(
            lambda c, x: (
                api.lax.cond(
                    x.sum() > 0, lambda v: api.lax.map(jnp.sin, v), lambda v: v * 2, c + x
                ),
                x.sum(),
            ),
            c,
            xs,
        ),
        lambda: (f32(3), f32(4, 3)),
        ("lax.scan", "lax.cond", "lax.map"),
        argnums=(0, 1),
    ),
    Case(
        "fori-of-switch",
        lambda api, x: api.lax.fori_loop(
            0, 4, lambda i, v: api.lax.switch(i, [one_a, one_b, one_c], v), x
        ),
        lambda: (f32(3),),
        ("lax.fori_loop", "lax.switch"),
    ),
]


def test_every_neutral_lax_function_has_a_case():
    from test_parity_rules import CASES as RULE_CASES  # the implicit-differentiation names

    covered = {name for case in [*CASES, *RULE_CASES] for name in case.uses}
    assert {name for name in covered if name.startswith("lax.")} == {
        name for name in jo.OVERRIDEABLE if name.startswith("lax.")
    }


test_parity = _parity.parity_tests(CASES)
test_parity_under_adapter = _parity.adapter_parity_tests(CASES)
test_raw_jax_ignores_overrides = _parity.raw_jax_test(CASES)
test_jaxprs_inside_a_scoped_installation = _parity.scoped_jaxprs_test(CASES)


def test_switch_out_of_range_clamps_like_jax():
    """The clamping semantics, spelled out: above the range is the last branch, below the first."""
    x = jnp.float32(0.5)
    branches = [lambda v: v + 1, lambda v: v + 2, lambda v: v + 3]
    for index, expected in [(-5, 1.5), (0, 1.5), (2, 3.5), (3, 3.5), (100, 3.5)]:
        with active("context"):
            out = jo.lax.switch(index, branches, x)
        assert float(out) == expected == float(jax.lax.switch(index, branches, x))


def bad_body(c, x):
    return (c, c), x  # carry changes structure


def control_flow_errors(api):
    """What each misuse of the control flow raises (the last one JAX accepts)."""
    return _parity.error_messages(
        [
            lambda: api.lax.scan(bad_body, 0.0, jnp.arange(3.0)),
            lambda: api.lax.scan(count_body, 0.0),  # neither xs nor length
            lambda: api.lax.cond(jnp.zeros(2) > 0, one_a, one_b, 1.0),  # non-scalar predicate
            lambda: api.lax.switch(0, [], 1.0),  # no branches
            lambda: api.lax.while_loop(lambda x: x, lambda x: x + 1, 1.0),  # float predicate
            lambda: api.lax.map(map_f, jnp.ones((4, 2)), batch_size=0),
            # JAX names the user's functions and carries in these, never the adapter's
            lambda: api.lax.fori_loop(0, 1, NOT_CALLABLE, 0),
            lambda: api.lax.while_loop(NOT_CALLABLE, NOT_CALLABLE, 0),
            lambda: api.lax.switch(0, [NOT_CALLABLE], 1.0),
            lambda: api.lax.scan(lambda c, x: jnp.float32(1.0), 0.0, None, length=2),
            lambda: api.lax.scan(lambda x, _: (jnp.float32(1), None), jnp.int32(0), None, length=2),
            lambda: api.lax.while_loop(lambda c: True, lambda c: (1.0, 1.0), 0.0),
            lambda: api.lax.fori_loop(0, 2, lambda i, c: c.astype(jnp.float32), jnp.int32(1)),
            lambda: api.lax.cond(True, lambda x: jnp.zeros(1), lambda x: x, 1.0),
            lambda: api.lax.cond(True, lambda x: {"a": x}, lambda x: {"a": (x, x)}, 1.0),
            lambda: api.lax.switch(1, [lambda x: {"a": jnp.zeros(1)}, lambda x: {"a": x}], 1.0),
        ]
    )


NOT_CALLABLE: Any = 42


@pytest.mark.parametrize("mode", _parity.ALL_MODES)
def test_errors_are_jax_errors(mode):
    """Bad control-flow arguments raise JAX's own error type and message."""
    expected = _parity.check_errors_in_mode(control_flow_errors, mode)
    assert all(item is not None for index, item in enumerate(expected) if index != 5)


# --- hypothesis: random scan configurations -------------------------------------------


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    length=st.integers(0, 6),
    width=st.integers(1, 3),
    reverse=st.booleans(),
    unroll=st.one_of(st.integers(1, 8), st.booleans()),
    xs_none=st.booleans(),
    passthrough=st.booleans(),
)
def test_scan_random_configurations(length, width, reverse, unroll, xs_none, passthrough):
    carry = f32(width)
    xs = None if xs_none else f32(length, width)

    def run(api):
        if xs_none:
            return api.lax.scan(count_body, carry, length=length, reverse=reverse, unroll=unroll)
        return api.lax.scan(scan_body, carry, xs, reverse=reverse, unroll=unroll)

    expected_jaxpr = jaxpr_text(lambda: run(JAX))
    expected = run(JAX)
    with active("context" if passthrough else "idle"):
        assert jaxpr_text(lambda: run(jo)) == expected_jaxpr
        actual = run(jo)
    _parity.assert_same(actual, expected)


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    rows=st.integers(1, 9),
    batch_size=st.one_of(st.none(), st.integers(1, 10)),
    passthrough=st.booleans(),
)
def test_map_random_batch_sizes(rows, batch_size, passthrough):
    xs = f32(rows, 2)
    expected_jaxpr = jaxpr_text(lambda v: jax.lax.map(map_f, v, batch_size=batch_size), xs)
    with active("context" if passthrough else "idle"):
        actual_jaxpr = jaxpr_text(lambda v: jo.lax.map(map_f, v, batch_size=batch_size), xs)
    assert actual_jaxpr == expected_jaxpr


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    lower=st.integers(-3, 5),
    upper=st.integers(-3, 8),
    traced=st.booleans(),
    passthrough=st.booleans(),
)
def test_fori_loop_random_bounds(lower, upper, traced, passthrough):
    x = f32(2)

    def run(api):
        if traced:
            return jax.make_jaxpr(lambda lo, hi, v: api.lax.fori_loop(lo, hi, fori_body, v))(
                lower, upper, x
            )
        return jax.make_jaxpr(lambda v: api.lax.fori_loop(lower, upper, fori_body, v))(x)

    expected = str(run(JAX))
    with active("context" if passthrough else "idle"):
        assert str(run(jo)) == expected
