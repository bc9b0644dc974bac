"""The Haiku test matrix: every neutral function x module kind x {init, apply} x {eager, jit}.

Each cell passes a callback ``g`` using a module of one kind to one neutral function,
inside ``hk.transform_with_state``, with ``jaxoverride_haiku.context()`` active, under
``jax.checking_leaks()`` and ``hk.config.context(check_jax_usage=True)``, and checks:

* init: the params and state created are exactly the ones expected (every parameter the
  apply uses, distinct modules where distinct modules were built), and the value the
  program computed at init (stored with ``hk.set_state("out", ...)``, which init returns
  as the initial state) equals what apply computes from those params, state and rng;
* apply: output and new state equal a reference written with explicit Haiku params
  (``inner.apply(params, state, rng, x)`` under the raw JAX transform) and, where Haiku
  has one that works, the ``hk.*`` equivalent (``hk.scan``, ``hk.vmap``, ``hk.cond``...).

Module kinds: ``outside`` (an ``hk.Linear`` built in the transformed function, closed
over), ``inside`` (built inside the callback), ``stateful`` (a counter with
``hk.get_state``/``hk.set_state``), ``rng`` (draws ``hk.next_rng_key()`` on every call;
its parameter has a constant initializer so that init and apply draw the same keys).

``eager`` runs ``f.init``/``f.apply`` as they are; ``jit`` runs them under ``jax.jit``.

To keep the matrix fast, one program per (function, mode) runs the four kinds one after the
other (distinct module names, the ``rng`` kind first) and init and apply are traced in
one ``jax.jit``; each cell then checks its own kind's slice. The references are jitted once
per function and shared by both modes. No cell is impossible: every one has a reference.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxoverride as jo
import jaxoverride_haiku as joh
from jaxoverride import lax as jlax

# The rng kind runs first in every program, so that its keys are the first ones drawn both
# at init and at apply (parameter initializers of the other kinds draw keys at init only).
KINDS = ("rng", "outside", "inside", "stateful")
MODES = ("eager", "jit")
X = jnp.array([-0.5, 0.25, 1.0], jnp.float32)  # x[0] < 0: cond takes its false branch
RNG = jax.random.PRNGKey(42)
# The programs are tiny: XLA's backend optimisations would only double the compile time.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


class Counter(hk.Module):
    """Counts its calls in state; its output depends on the count."""

    def __call__(self, x: jax.Array) -> jax.Array:
        count = hk.get_state("count", [], jnp.int32, init=jnp.zeros)
        hk.set_state("count", count + 1)
        w = hk.get_parameter("w", x.shape, init=hk.initializers.RandomNormal())
        return jnp.tanh(x * w) + 0.1 * count


class Noisy(hk.Module):
    """Adds noise from ``hk.next_rng_key()``; its parameter needs no rng to initialise."""

    def __call__(self, x: jax.Array) -> jax.Array:
        scale = hk.get_parameter("scale", x.shape, init=jnp.ones)
        return jnp.tanh(x * scale) + 0.1 * jax.random.normal(hk.next_rng_key(), x.shape)


def make_g(kind: str) -> Callable[[jax.Array], jax.Array]:
    """The callback; modules of kind ``inside`` are built each time it is called."""
    if kind == "inside":
        return lambda v: jnp.tanh(hk.Linear(3, name="inner")(v))
    module: Callable[[jax.Array], jax.Array]
    if kind == "outside":
        linear = hk.Linear(3, name="lin")
        module = lambda v: jnp.tanh(linear(v))
    elif kind == "stateful":
        module = Counter()
    else:
        module = Noisy()
    return module


def batch(x: jax.Array) -> jax.Array:
    return x[None] * jnp.arange(1.0, 5.0)[:, None]


def _sum_with_state(pure):
    def f(v):
        y, state = pure(v)
        return y.sum(), state

    return f


@dataclass(frozen=True)
class Op:
    """How a neutral function is exercised, and its references."""

    drive: Callable[[Any, Callable, jax.Array], jax.Array]  # (api, g, x) -> output
    explicit: Callable[[Callable, jax.Array], tuple[jax.Array, Any]] | None = None
    hk_ref: bool = True  # drive with api=HK is the hk.* equivalent
    hk_ref_inside: bool = True  # the hk.* equivalent is valid with modules built inside
    distinct: int = 1  # how many times the callback is called in distinct places


class NeutralApi:
    jit = staticmethod(jo.jit)
    vmap = staticmethod(jo.vmap)
    grad = staticmethod(jo.grad)
    value_and_grad = staticmethod(jo.value_and_grad)
    jacfwd = staticmethod(jo.jacfwd)
    jacrev = staticmethod(jo.jacrev)
    hessian = staticmethod(jo.hessian)
    jvp = staticmethod(jo.jvp)
    vjp = staticmethod(jo.vjp)
    checkpoint = staticmethod(jo.checkpoint)
    remat = staticmethod(jo.remat)
    eval_shape = staticmethod(jo.eval_shape)
    scan = staticmethod(jlax.scan)
    while_loop = staticmethod(jlax.while_loop)
    fori_loop = staticmethod(jlax.fori_loop)
    cond = staticmethod(jlax.cond)
    switch = staticmethod(jlax.switch)
    map = staticmethod(jlax.map)


class HaikuApi:
    """The hk.* equivalents (only those used by ops with ``hk_ref=True``)."""

    vmap = staticmethod(functools.partial(hk.vmap, split_rng=False))
    grad = staticmethod(hk.grad)
    value_and_grad = staticmethod(hk.value_and_grad)
    checkpoint = staticmethod(hk.remat)
    remat = staticmethod(hk.remat)
    scan = staticmethod(hk.scan)
    while_loop = staticmethod(hk.while_loop)
    fori_loop = staticmethod(hk.fori_loop)
    cond = staticmethod(hk.cond)
    switch = staticmethod(hk.switch)
    map = staticmethod(hk.map)


def _value_and_grad(api, g, x):
    value, grads = api.value_and_grad(lambda v: g(v).sum())(x)
    return grads + value


def _vjp(api, g, x):
    y, pullback = api.vjp(g, x)
    return pullback(jnp.ones_like(y))[0]


def _explicit_vjp(pure, x):
    y, pullback, state = jax.vjp(pure, x, has_aux=True)
    return pullback(jnp.ones_like(y))[0], state


def _explicit_value_and_grad(pure, x):
    (value, state), grads = jax.value_and_grad(_sum_with_state(pure), has_aux=True)(x)
    return grads + value, state


def _eval_shape(api, g, x):
    shape = api.eval_shape(g, x).shape  # first: a module built inside takes the first name
    return g(x) + shape[0]


def _scan(api, g, x):
    carry, ys = api.scan(lambda c, k: (g(c * k), c.sum()), x, jnp.arange(1.0, 4.0))
    return carry + ys.sum()


def _cond_select(api, g, x):
    # The reference for callbacks that build modules: both branches run in order (so
    # they build the same distinct modules) and the value of the taken one is kept.
    return jnp.where(x[0] > 0, g(x), g(-x))


def _switch_select(api, g, x):
    return jnp.stack([-x, g(x), g(2 * x)])[2]


OPS: dict[str, Op] = {
    "jit": Op(lambda api, g, x: api.jit(g)(x), explicit=lambda pure, x: pure(x), hk_ref=False),
    "vmap": Op(
        lambda api, g, x: api.vmap(g)(batch(x)),
        explicit=lambda pure, x: jax.vmap(pure, out_axes=(0, None))(batch(x)),
    ),
    "grad": Op(
        lambda api, g, x: api.grad(lambda v: g(v).sum())(x),
        explicit=lambda pure, x: jax.grad(_sum_with_state(pure), has_aux=True)(x),
    ),
    "value_and_grad": Op(_value_and_grad, explicit=_explicit_value_and_grad),
    "jacfwd": Op(
        lambda api, g, x: api.jacfwd(g)(x),
        explicit=lambda pure, x: jax.jacfwd(pure, has_aux=True)(x),
        hk_ref=False,
    ),
    "jacrev": Op(
        lambda api, g, x: api.jacrev(g)(x),
        explicit=lambda pure, x: jax.jacrev(pure, has_aux=True)(x),
        hk_ref=False,
    ),
    "hessian": Op(
        lambda api, g, x: api.hessian(lambda v: g(v).sum())(x),
        explicit=lambda pure, x: jax.hessian(_sum_with_state(pure), has_aux=True)(x),
        hk_ref=False,
    ),
    "jvp": Op(
        lambda api, g, x: api.jvp(g, (x,), (jnp.ones_like(x),))[1],
        explicit=lambda pure, x: jax.jvp(pure, (x,), (jnp.ones_like(x),), has_aux=True)[1:],
        hk_ref=False,
    ),
    "vjp": Op(_vjp, explicit=_explicit_vjp, hk_ref=False),
    "checkpoint": Op(
        lambda api, g, x: api.checkpoint(g)(x), explicit=lambda pure, x: jax.checkpoint(pure)(x)
    ),
    "remat": Op(lambda api, g, x: api.remat(g)(x), explicit=lambda pure, x: jax.remat(pure)(x)),
    "eval_shape": Op(_eval_shape, hk_ref=False, distinct=2),
    "scan": Op(_scan),
    "while_loop": Op(
        lambda api, g, x: api.while_loop(
            lambda s: s[1] < 3, lambda s: (g(s[0]) * 1.5, s[1] + 1), (x, 0)
        )[0]
    ),
    "fori_loop": Op(lambda api, g, x: api.fori_loop(0, 3, lambda i, c: g(c) * (i + 1), x)),
    "cond": Op(
        lambda api, g, x: api.cond(x[0] > 0, g, lambda v: g(-v), x),
        hk_ref_inside=False,
        distinct=2,
    ),
    "switch": Op(
        lambda api, g, x: api.switch(2, [lambda v: -v, g, lambda v: g(2 * v)], x),
        hk_ref_inside=False,
        distinct=2,
    ),
    "map": Op(lambda api, g, x: api.map(g, batch(x))),
}


def _eval_shape_reference(kind: str) -> Callable[..., jax.Array]:
    """What ``_eval_shape`` must compute: shapes only, state changes and rng draws inside
    discarded, and a module built inside takes the first name (the next is ``inner_1``)."""

    def drive(api, g, x):
        if kind == "inside":
            hk.Linear(3, name="inner")
        return g(x) + 3

    return drive


def _program(drives: dict[str, Callable[..., jax.Array]], api: Any) -> Callable[[jax.Array], None]:
    """All four kinds through one neutral function, in one program (one compile per cell
    row instead of four); each kind's value is kept in state ``~/out_<kind>``."""

    def f(x):
        for kind in KINDS:
            hk.set_state(f"out_{kind}", drives[kind](api, make_g(kind), x))

    return f


def _expected_params(op_name: str) -> dict[str, set[str]]:
    inner = ["inner", "inner_1"][: OPS[op_name].distinct]
    return {
        "noisy": {"scale"},
        "lin": {"w", "b"},
        **{name: {"w", "b"} for name in inner},
        "counter": {"w"},
    }


def _kind_state(state: Any, kind: str) -> Any:
    """The state a kind owns: its output, and the counter for the stateful kind."""
    own = {"out": state["~"][f"out_{kind}"]}
    if kind == "stateful":
        own["count"] = state["counter"]["count"]
    return own


def _close(a: Any, b: Any, what: str) -> None:
    def check(u, v):
        np.testing.assert_allclose(u, v, rtol=2e-5, atol=2e-5, err_msg=what)

    jax.tree.map(check, a, b)


def _init_and_apply(op_name: str, mode: str):
    model = hk.transform_with_state(_program(dict.fromkeys(KINDS, OPS[op_name].drive), NeutralApi))

    def init_and_apply(rng, x):
        params, state = model.init(rng, x)
        _, new_state = model.apply(params, state, rng, x)
        return params, state, new_state

    if mode == "jit":
        # init and apply both traced under jax.jit, in one compilation to save test time.
        init_and_apply = jax.jit(init_and_apply, compiler_options=FAST_COMPILE)
    with joh.context(), jax.checking_leaks(), hk.config.context(check_jax_usage=True):
        return init_and_apply(RNG, X)


@functools.cache
def _run(op_name: str, mode: str):
    """One init and one apply per (function, mode), shared by the cells of its four kinds."""
    return _init_and_apply(op_name, mode)


def _explicit_reference(op_name: str, kind: str):
    explicit = OPS[op_name].explicit
    assert explicit is not None
    inner = hk.transform_with_state(lambda v: make_g(kind)(v))

    def reference(params, state, rng, x):
        out, new_state = explicit(lambda v: inner.apply(params, state, rng, v), x)
        return {
            "out": out,
            **({"count": new_state["counter"]["count"]} if kind == "stateful" else {}),
        }

    return reference


@functools.cache
def _references(op_name: str) -> Callable[..., dict[str, dict[str, Any]]]:
    """``(params, state, rng, x) -> {label: {kind: kind state}}``, jitted once per function."""
    op = OPS[op_name]
    programs = []
    if op.hk_ref:
        hk_drives = dict.fromkeys(KINDS, op.drive)
        if not op.hk_ref_inside:
            hk_drives["inside"] = {"cond": _cond_select, "switch": _switch_select}[op_name]
        programs.append(("hk.* equivalent", hk_drives))
    if op_name == "eval_shape":
        programs.append(("explicit program", {k: _eval_shape_reference(k) for k in KINDS}))
    transformed = [
        (label, hk.transform_with_state(_program(drives, HaikuApi))) for label, drives in programs
    ]
    explicit = (
        {k: _explicit_reference(op_name, k) for k in KINDS} if op.explicit is not None else {}
    )

    def references(params, state, rng, x):
        out: dict[str, dict[str, Any]] = {}
        for label, model in transformed:
            _, new_state = model.apply(params, state, rng, x)
            out[label] = {kind: _kind_state(new_state, kind) for kind in KINDS}
        if explicit:
            own = {m: b for m, b in state.items() if m != "~"}
            out["explicit params"] = {
                kind: reference(params, own, rng, x) for kind, reference in explicit.items()
            }
        return out

    return jax.jit(references, compiler_options=FAST_COMPILE)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("op_name", list(OPS))
def test_cell(op_name: str, kind: str, mode: str) -> None:
    params, state, new_state = _run(op_name, mode)

    # init: every parameter apply uses, and distinct modules where distinct ones were built.
    assert {m: set(b) for m, b in params.items()} == _expected_params(op_name)
    assert set(state["~"]) == {f"out_{k}" for k in KINDS}
    # init-exact: what init computed (init returns the first value set, i.e. the value of
    # this kind's call) is what apply computes from the same params, state and rng.
    _close(state["~"][f"out_{kind}"], new_state["~"][f"out_{kind}"], "init vs apply")
    # apply: against the references, with the params and state that init returned.
    references = _references(op_name)(params, state, RNG, X)
    assert references, "every cell has a reference"
    for label, by_kind in references.items():
        _close(_kind_state(new_state, kind), by_kind[kind], f"apply vs {label}")
    if kind == "stateful":
        calls = {"scan": 3, "while_loop": 3, "fori_loop": 3, "map": 4}
        assert int(state["counter"]["count"]) == 0
        assert int(new_state["counter"]["count"]) == calls.get(op_name, 1)


def test_matrix_covers_every_overridable_function() -> None:
    transforms = {
        "jit",
        "vmap",
        "grad",
        "value_and_grad",
        "jacfwd",
        "jacrev",
        "hessian",
        "jvp",
        "vjp",
        "checkpoint",
        "remat",
        "eval_shape",
    }
    covered = {name if name in transforms else f"lax.{name}" for name in OPS}
    # linearize is covered in test_haiku_transforms; pmap and shard_map need 8 devices and
    # are covered in test_multidevice_haiku.
    # The implicit-differentiation names are covered in test_haiku_implicit, and
    # custom_vjp/custom_jvp (stateful rule functions) in test_haiku_rules.
    implicit = {"custom_vjp", "custom_jvp", "closure_convert", "make_jaxpr"}
    implicit |= {"lax.custom_root", "lax.custom_linear_solve"}
    assert covered | {"linearize", "pmap", "shard_map"} | implicit == set(jo.OVERRIDEABLE)
    assert set(joh.context()) == set(jo.OVERRIDEABLE)
