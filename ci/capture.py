"""Captures what JAX sees of a few hundred neutral programs, to compare two checkouts.

Usage::

    python ci/capture.py OUT.json [--only SUBSTRING] [--modes idle,dag,...]
    python ci/capture.py --compare BEFORE.json AFTER.json

The first form runs every program in every mode and writes one JSON object,
``{"program @ mode": record}``. The second prints each difference between two such
files (a key in one only, or a field that differs, with the first differing line of
a text) and exits 1 if there is any. To check that a change leaves behaviour as it
was, run the first form on a checkout before the change and on one after it (each
with its own ``.venv``: the script imports the checkout's ``jaxoverride``), then
compare; every difference must be explained by the change.

**Programs.** Every case of the parity suites (``tests/test_parity_lax.py``,
``tests/test_parity_rules.py``, ``tests/test_parity_transforms.py``: jit, vmap, pmap,
shard_map, the grad family, jvp/vjp/linearize, checkpoint, eval_shape, scan, while,
fori, cond, switch, map, custom_vjp/custom_jvp, custom_root/custom_linear_solve,
closure_convert) called through ``jaxoverride``, and the derivative of each that has
one (``_parity.derivative``); plus small stateful models (``STATEFUL``) for the Haiku,
Linen and NNX adapters, each in a loop, a branch or a transform.

**Modes.** ``idle`` (nothing active), ``context`` (a pass-through override layer),
each adapter with nothing to do (``plain``, ``haiku_installed``, ``nnx_track``,
``dag``, ``linen_installed``, as in ``tests/_parity.py``), ``haiku_transform`` (the
Haiku adapter installed and the pure program run inside ``hk.transform``) and
``debug`` (``jaxoverride_debug.trace()``). The stateful models run in their own
adapter's mode only (``haiku_model``, ``linen_model``, ``nnx_model``).

**Record.** For each program and mode: ``jaxpr`` (``jax.make_jaxpr``'s text),
``stablehlo`` (``jax.jit(f).lower(*args).as_text()``) and its sha256, ``calls`` (for
an identical call made three times, the number of XLA compilations and of jaxpr traces
each made, from ``jax.monitoring``'s events; JAX's caches are cleared when a mode
starts, not per program, so a first call's count also depends on what the programs
before it in that mode compiled: the order is fixed, so two captures compare) and
``output`` (tree structure, dtypes and a hash of the values). A step that raises
records the error's type and message instead; addresses and pmap's axis ids are
blanked, as the parity suites do.
"""

from __future__ import annotations

import os

# Must precede the first import of jax: pmap and shard_map cases need 8 CPU devices.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import contextlib
import functools
import hashlib
import importlib
import json
import pathlib
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", False)

import jaxoverride as jo  # noqa: E402
from jaxoverride import lax as jlax  # noqa: E402

SUITES = ("test_parity_lax", "test_parity_rules", "test_parity_transforms")
"""The test modules whose ``CASES`` are the programs."""

PURE_MODES = (
    "idle",
    "context",
    "haiku_transform",
    "nnx_track",
    "linen_installed",
    "dag",
    "haiku_installed",
    "plain",
    "debug",
)
"""The modes every pure program runs in, in the order they run."""

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
_ADDRESS = re.compile(r" at 0x[0-9a-f]+|<axis 0x[0-9a-f]+>|0x[0-9a-f]{8,}")
# A path into a checkout or its .venv (two captures come from two checkouts).
_CHECKOUT = re.compile(r"[^\s'\"(]*/(?=(?:tests|src|adapters|ci|examples|\.venv)/)")

Program = tuple[Callable[..., Any], tuple[Any, ...]]
"""A function and its arguments."""


# ---------------------------------------------------------------------------------------
# Modes


@contextlib.contextmanager
def active(mode: str) -> Iterator[None]:
    """Runs the block in ``mode`` (see the module docstring)."""
    _parity = importlib.import_module("_parity")  # tests/, on sys.path above

    if mode in ("idle", "context", *_parity.ADAPTER_MODES):
        with _parity.active(mode):
            yield
    elif mode in ("haiku_transform", "haiku_model"):
        with _installed("jaxoverride_haiku"):
            yield
    elif mode == "linen_model":
        with _installed("jaxoverride_linen"):
            yield
    elif mode == "nnx_model":  # each program enters track() of its own module
        yield
    elif mode == "debug":
        import jaxoverride_debug

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with jaxoverride_debug.trace():
                yield
    else:
        raise ValueError(f"unknown mode {mode!r}")


@contextlib.contextmanager
def _installed(adapter_name: str) -> Iterator[None]:
    adapter = importlib.import_module(adapter_name)
    adapter.install()
    try:
        yield
    finally:
        adapter.uninstall()


def in_haiku_transform(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run inside ``hk.transform(...).apply`` (it creates no parameter)."""
    import haiku as hk

    def run(*args: Any) -> Any:
        return hk.transform(lambda: fn(*args)).apply({}, None)

    return run


# ---------------------------------------------------------------------------------------
# Programs


def pure_programs() -> dict[str, Program]:
    """Every parity case through ``jaxoverride`` and, where it has one, its derivative."""
    _parity = importlib.import_module("_parity")  # tests/, on sys.path above

    programs: dict[str, Program] = {}
    for suite in SUITES:
        module = importlib.import_module(suite)
        for case in module.CASES:
            args = case.args()
            name = f"{suite.removeprefix('test_parity_')}/{case.id}"
            programs[name] = (functools.partial(case.call, jo), args)
            if case.diff:
                programs[f"{name}/derivative"] = (_parity.derivative(case, jo), args)
    return programs


def _haiku_model(kind: str) -> Callable[[], dict[str, Program]]:
    def build() -> dict[str, Program]:
        import haiku as hk

        def forward(x: jax.Array) -> jax.Array:
            linear = hk.Linear(3, w_init=hk.initializers.Constant(0.1))

            def step(carry: jax.Array) -> jax.Array:
                hk.set_state("count", hk.get_state("count", [], init=jnp.zeros) + 1.0)
                return jnp.tanh(linear(carry))

            return _loop(kind, step, x)

        model = hk.transform_with_state(forward)
        x = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
        key = jax.random.key(0)
        params, state = model.init(key, x)
        return {
            f"haiku/{kind}/init": (model.init, (key, x)),
            f"haiku/{kind}/apply": (lambda p, s, x: model.apply(p, s, None, x), (params, state, x)),
        }

    build.__qualname__ = f"haiku/{kind}"  # names a model that fails to build
    return build


def _linen_model(kind: str) -> Callable[[], dict[str, Program]]:
    def build() -> dict[str, Program]:
        import flax.linen as nn

        class Model(nn.Module):
            @nn.compact
            def __call__(self, x: jax.Array) -> jax.Array:
                dense = nn.Dense(3, kernel_init=nn.initializers.constant(0.1))
                count = self.variable("counter", "count", jnp.zeros, ())

                def step(carry: jax.Array) -> jax.Array:
                    count.value = count.value + 1.0
                    return jnp.tanh(dense(carry))

                return _loop(kind, step, x)

        model = Model()
        x = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
        key = jax.random.key(0)
        variables = model.init(key, x)
        return {
            f"linen/{kind}/init": (model.init, (key, x)),
            f"linen/{kind}/apply": (
                lambda v, x: model.apply(v, x, mutable=["counter"]),
                (variables, x),
            ),
        }

    build.__qualname__ = f"linen/{kind}"  # names a model that fails to build
    return build


def _nnx_model(kind: str) -> Callable[[], dict[str, Program]]:
    def build() -> dict[str, Program]:
        from flax import nnx

        class Model(nnx.Module):
            def __init__(self) -> None:
                self.w = nnx.Param(jnp.full((3, 3), 0.1))
                self.count = nnx.Variable(jnp.array(0.0))

            def __call__(self, carry: jax.Array) -> jax.Array:
                self.count.value = self.count.value + 1.0
                return jnp.tanh(carry @ self.w.value)

        model = Model()
        x = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)

        def forward(x: jax.Array) -> jax.Array:
            return _loop(kind, model, x)

        return {f"nnx/{kind}": (forward, (x,)), "nnx_module": (lambda: model, ())}

    build.__qualname__ = f"nnx/{kind}"  # names a model that fails to build
    return build


LOOP_KINDS = ("scan", "while_loop", "fori_loop", "cond", "switch", "map", "jit", "checkpoint")
"""How a stateful model's step is called, through the neutral API."""


def _loop(kind: str, step: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    if kind == "scan":
        return jlax.scan(lambda c, _: (step(c), None), x, None, length=3)[0]
    if kind == "while_loop":
        carry = jlax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, step(c[1])), (0, x))
        return carry[1]
    if kind == "fori_loop":
        return jlax.fori_loop(0, 3, lambda i, c: step(c), x)
    if kind == "cond":
        return jlax.cond(jnp.sum(x) > 0, step, lambda c: c * 2.0, x)
    if kind == "switch":
        return jlax.switch(1, [lambda c: c * 2.0, step], x)
    if kind == "map":
        return jlax.map(step, x)
    if kind == "jit":
        return jo.jit(step)(x)
    if kind == "checkpoint":
        return jo.checkpoint(step)(x)
    raise ValueError(kind)


STATEFUL: dict[str, list[Callable[[], dict[str, Program]]]] = {
    "haiku_model": [_haiku_model(kind) for kind in LOOP_KINDS],
    "linen_model": [_linen_model(kind) for kind in LOOP_KINDS],
    "nnx_model": [_nnx_model(kind) for kind in LOOP_KINDS],
}
"""The stateful programs of each stateful mode, built inside it."""


# ---------------------------------------------------------------------------------------
# Records


def _clean(text: str) -> str:
    return _CHECKOUT.sub("<checkout>/", _ADDRESS.sub(" at <address>", text))


def _cleaned(value: Any) -> Any:
    """``value`` (a record read back) with every text cleaned as ``_clean`` does."""
    if isinstance(value, str):
        return _clean(value)
    if isinstance(value, dict):
        return {key: _cleaned(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_cleaned(item) for item in value]
    return value


def _error(error: BaseException) -> dict[str, str]:
    return {"error": f"{type(error).__name__}: {_clean(str(error))}"[:2000]}


def _attempt(step: Callable[[], Any]) -> Any:
    try:
        return step()
    except Exception as error:  # a program that raises is recorded as such
        return _error(error)


def _output(tree: Any) -> dict[str, Any]:
    leaves, structure = jax.tree_util.tree_flatten(tree)
    digest = hashlib.sha256()
    kinds = []
    for leaf in leaves:
        if isinstance(leaf, jax.Array | np.ndarray | np.generic):
            array = np.asarray(leaf)
            kinds.append(f"{array.dtype}{list(array.shape)}")
            if array.dtype != jax.dtypes.float0:
                digest.update(array.tobytes())
        else:
            kinds.append(type(leaf).__name__)
    return {"tree": _clean(str(structure)), "leaves": kinds, "sha256": digest.hexdigest()}


@contextlib.contextmanager
def _counting() -> Iterator[dict[str, int]]:
    counts = {"compiles": 0, "traces": 0}

    def listener(event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event == COMPILE_EVENT:
            counts["compiles"] += 1
        elif event == TRACE_EVENT:
            counts["traces"] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield counts
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def record(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    reset: Callable[[], None] = lambda: None,
    api: Any = jax,
) -> dict[str, Any]:
    """The record of one program in the mode that is active (see the module docstring).

    Args:
      fn: the program.
      args: its arguments.
      reset: runs before each step (a stateful model's state is put back).
      api: whose ``make_jaxpr`` and ``jit`` give the jaxpr and the StableHLO: JAX's, or
        ``jaxoverride`` for an NNX model, whose tracked state raw JAX must not read.

    Returns:
      The record: ``calls``, ``output``, ``jaxpr``, ``stablehlo`` and its sha256.
    """
    calls: list[Any] = []
    output: Any = None
    for _ in range(3):
        reset()
        with _counting() as counts:
            result = _attempt(lambda: fn(*args))
        calls.append([counts["compiles"], counts["traces"]])
        output = result if isinstance(result, dict) and "error" in result else _output(result)
    reset()
    jaxpr = _attempt(lambda: _clean(str(api.make_jaxpr(fn)(*args))))
    reset()
    hlo = _attempt(lambda: api.jit(fn).lower(*args).as_text())
    reset()
    entry: dict[str, Any] = {"calls": calls, "output": output, "jaxpr": jaxpr}
    if isinstance(hlo, str):
        entry["stablehlo_sha256"] = hashlib.sha256(hlo.encode()).hexdigest()
    entry["stablehlo"] = hlo
    return entry


def capture(only: str, modes: tuple[str, ...], path: pathlib.Path) -> dict[str, Any]:
    """Runs every program whose name contains ``only`` in each of ``modes``.

    The records so far are written to ``path`` after each mode.
    """
    results: dict[str, Any] = {}
    pure = {name: program for name, program in pure_programs().items() if only in name}
    for mode in modes:
        if results:
            path.write_text(json.dumps(results, indent=1, sort_keys=True))
        jax.clear_caches()
        if mode in STATEFUL:
            for build in STATEFUL[mode]:
                with active(mode):
                    built = _attempt(build)
                    if "error" in built:
                        results[f"{build.__qualname__} @ {mode}"] = built
                        continue
                    results.update(_stateful(built, mode, only))
            continue
        for name, (fn, args) in pure.items():
            program = in_haiku_transform(fn) if mode == "haiku_transform" else fn
            with active(mode):
                results[f"{name} @ {mode}"] = record(program, args)
        print(f"{mode}: {len(pure)} programs", file=sys.stderr, flush=True)
    return results


def _stateful(built: dict[str, Program], mode: str, only: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    holder = built.pop("nnx_module", None)
    module = None if holder is None else holder[0]()
    for name, (fn, args) in built.items():
        if only not in name:
            continue
        if module is None:
            results[f"{name} @ {mode}"] = record(fn, args)
            continue
        from flax import nnx

        import jaxoverride_nnx

        saved = nnx.state(module)

        def reset(module: Any = module, saved: Any = saved) -> None:
            nnx.update(module, jax.tree.map(lambda leaf: leaf, saved))

        with jaxoverride_nnx.track(module):
            results[f"{name} @ {mode}"] = record(fn, args, reset, api=jo)
    return results


# ---------------------------------------------------------------------------------------
# Comparison


def _first_difference(a: str, b: str) -> str:
    lines_a, lines_b = a.splitlines(), b.splitlines()
    for index, (x, y) in enumerate(zip(lines_a, lines_b, strict=False)):
        if x != y:
            return f"line {index + 1}:\n      - {x.strip()}\n      + {y.strip()}"
    return f"{len(lines_a)} lines against {len(lines_b)}"


def compare(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Each difference between two captures, one text each (none when identical)."""
    found = [f"only in the first: {key}" for key in sorted(before.keys() - after.keys())]
    found += [f"only in the second: {key}" for key in sorted(after.keys() - before.keys())]
    for key in sorted(before.keys() & after.keys()):
        a, b = _cleaned(before[key]), _cleaned(after[key])
        for field in sorted(set(a) | set(b)):
            if field == "stablehlo_sha256" or a.get(field) == b.get(field):
                continue
            x, y = a.get(field), b.get(field)
            if isinstance(x, str) and isinstance(y, str):
                detail = _first_difference(x, y)
            else:
                detail = f"\n      - {json.dumps(x)[:600]}\n      + {json.dumps(y)[:600]}"
            found.append(f"{key}: {field} differs, {detail}")
    return found


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("paths", nargs="+", help="OUT.json, or with --compare two captures")
    parser.add_argument("--compare", action="store_true", help="compare two captures")
    parser.add_argument("--only", default="", help="programs whose name contains this")
    parser.add_argument(
        "--modes",
        default=",".join((PURE_MODES[0], *STATEFUL, *PURE_MODES[1:])),
        help="comma-separated modes (default: all)",
    )
    options = parser.parse_args(argv)
    if options.compare:
        if len(options.paths) != 2:
            parser.error("--compare takes two captures: BEFORE.json AFTER.json")
        before, after = (json.loads(pathlib.Path(p).read_text()) for p in options.paths)
        differences = compare(before, after)
        for difference in differences:
            print(difference)
        print(f"{len(differences)} differences over {len(before)} and {len(after)} records")
        return 1 if differences else 0
    if len(options.paths) != 1:
        parser.error("a capture takes one output path")
    path = pathlib.Path(options.paths[0])
    results = capture(options.only, tuple(options.modes.split(",")), path)
    path.write_text(json.dumps(results, indent=1, sort_keys=True))
    failing = sum(1 for entry in results.values() if '"error":' in json.dumps(entry))
    print(f"{len(results)} records ({failing} with an error) written to {options.paths[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
