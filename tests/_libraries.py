"""Shared helpers for the tests of unmodified third-party solver libraries.

``interposed(*packages)`` interposes whole installed packages (every imported submodule)
and undoes it on exit. ``eager_calls`` counts how often a callback runs when the library
runs eagerly (``jax.disable_jit()`` turns ``lax.while_loop``/``scan``/``cond`` into Python
loops), which is what an adapter that threads state must leave in a call counter.

The solvers under test, and which of their modules hold the ``jax``/``lax`` references:

- jaxopt: ``jaxopt._src.loop`` (``jax.lax.while_loop``/``scan``/``cond``, ``jax.jit``),
  ``jaxopt._src.base`` (``jax.jit(self.update)``), ``jaxopt._src.implicit_diff``
  (``jax.custom_vjp``, ``jax.vjp``) and the solver modules: ``interposed("jaxopt")``.
- optax: ``optax._src.linear_algebra`` (``power_iteration``: ``from jax import lax``).
- optimistix / diffrax / lineax: ``eqx.filter_jit`` at import, ``eqx.filter_closure_convert``
  (``jax.make_jaxpr``) and ``equinox.internal.while_loop``: they are interposed with
  ``equinox`` too, and still fail with a state-writing callback (the tests pin why).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import jax

import jaxoverride as jo

EQUINOX_FAMILY = ("optimistix", "diffrax", "lineax", "equinox")

UPSTREAM_LEAK_UNDER_JAX_011 = (
    "upstream, not jaxoverride: equinox's lru-cached filter_eval_shape keeps a jaxpr with "
    "tracers from jax 0.11 (0.11.2 and 0.12.0.1 run). jax 0.11 merged ClosedJaxpr into "
    "Jaxpr (jax/_src/core.py: "
    "`ClosedJaxpr = Jaxpr`, `Jaxpr.jaxpr` returns self with its consts), so the `jaxpr` leaf "
    "of equinox 0.13's `filter_closure_convert` (`closed_jaxpr.jaxpr`) carries the tracers "
    "closed over in a while-loop body; `equinox._eval_shape._cached_filter_eval_shape` (for "
    "lineax's Jacobian operators) and JAX's memoized custom_vjp bwd (diffrax) keep them "
    "after the trace, so jax.checking_leaks() raises inside the library, without "
    "jaxoverride too"
)
"""Why ``jax.checking_leaks()`` is off for ``UPSTREAM_LEAK_CASES`` from jax 0.11 on."""

UPSTREAM_LEAK_CASES = (
    {"fixed_point_newton", "root_find_newton", "neural_ode_tsit5", "diffrax_115"}
    if jax.__version_info__ >= (0, 11)
    else set()
)
"""The Equinox-family cases whose library leaks tracers under ``jax.checking_leaks()``: they
close over an iterate in a loop body (Newton's Jacobian operator, diffrax's step). Their
scripts count the tracers still alive once equinox's and JAX's caches are cleared instead."""


def leak_check(case: str) -> contextlib.AbstractContextManager[Any]:
    """``jax.checking_leaks()``, or no check for ``case`` in ``UPSTREAM_LEAK_CASES``."""
    return contextlib.nullcontext() if case in UPSTREAM_LEAK_CASES else jax.checking_leaks()


def tracers_alive_after_clearing_caches() -> int:
    """The tracers still alive once equinox's and JAX's caches are cleared and garbage is
    collected. Called with no trace running, so each one is a leak that no library cache
    explains: a context, registry or module binding of the adapter that kept it."""
    import equinox  # imported here: the scripts interpose it before its first import

    equinox.clear_caches()
    jax.clear_caches()
    gc.collect()
    return sum(isinstance(found, jax.core.Tracer) for found in gc.get_objects())


@contextlib.contextmanager
def interposed(*packages: str) -> Iterator[list[jo.Interposition]]:
    """Interposes each package recursively for the block; restores every binding on exit."""
    with contextlib.ExitStack() as stack:
        handles = [
            stack.enter_context(jo.interpose(importlib.import_module(name), recursive=True))
            for name in packages
        ]
        for name, handle in zip(packages, handles, strict=True):
            # A package whose layout changed would otherwise run raw JAX, unnoticed.
            assert handle.rebound, f"interposing {name} rebound nothing"
        yield handles


def fresh_env(*packages: ModuleType) -> dict[str, str]:
    """The environment of a fresh interpreter that imports the same jaxoverride and adapters.

    The folders that hold ``packages`` come first on its path; it gets one CPU device
    (enough, and it compiles faster than this session's eight).
    """
    paths = [str(Path(package.__file__).parents[1]) for package in packages]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]))
    env.pop("XLA_FLAGS", None)
    return env


def run_fresh(args: Sequence[str], env: dict[str, str], timeout: float) -> str:
    """Runs ``python *args`` in a fresh interpreter; asserts that it succeeds; its stdout."""
    done = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def run_script_json(
    script: Path, names: Sequence[str], env: dict[str, str], timeout: float
) -> dict[str, Any]:
    """``python script *names`` in a fresh interpreter: the JSON object on its last line."""
    return json.loads(run_fresh([str(script), *names], env, timeout).strip().splitlines()[-1])


REFUSALS = ["write_at_init", "write_at_apply", "write_under_jit", "draw_at_init", "draw_at_apply"]
"""Where the fresh-interpreter scripts write state and draw an rng key in a callback."""


def assert_callback_refusal(
    result: dict[str, Any], where: str, *, written: str, drawn: str, why: str
) -> None:
    """A fresh-interpreter script's report of a write or draw in the callback at ``where``.

    It raised ``PureFunctionWriteError``, whose message names what was ``written`` (or
    ``drawn``, for a ``draw_*`` in ``REFUSALS``), ``why`` it is refused and the fix (pass the
    value in the solver's ``args``); and the refusal left the read-only model as it was.
    """
    refusal = result[where]
    assert refusal["type"] == "PureFunctionWriteError", refusal
    message = refusal["message"]
    assert (drawn if where.startswith("draw") else written) in message
    assert why in message
    assert "args" in message  # the fix: pass the value in
    assert result["after_refusals"] <= 1e-5


class FreshScript:
    """A script that reports on named cases, run in fresh interpreters, one per group.

    Args:
      script: prints one JSON object, ``{case: result}``, for the case names it is given.
      groups: the cases, by group; each group runs once per test session, when first used.
      packages: the folders of these come first on the script's path (``fresh_env``).
      timeout: seconds a group may take.

    Example:
      >>> script = FreshScript(Path("s.py"), {"a": ["x", "y"], "b": ["z"]}, [], timeout=60)
      >>> script.cases(besides="b")
      [('a', 'x'), ('a', 'y')]
    """

    def __init__(
        self,
        script: Path,
        groups: dict[str, list[str]],
        packages: Sequence[ModuleType],
        timeout: float,
    ):
        self.script, self.groups, self.packages, self.timeout = script, groups, packages, timeout
        self._results: dict[str, dict[str, Any]] = {}

    def cases(self, besides: str) -> list[tuple[str, str]]:
        """``(group, case)`` for every case of every group but ``besides``."""
        return [(g, case) for g, cases in self.groups.items() if g != besides for case in cases]

    def env(self) -> dict[str, str]:
        return fresh_env(*self.packages)

    def group(self, group: str) -> dict[str, Any]:
        """What the script reports on the cases of ``group`` (run the first time only)."""
        if group not in self._results:
            names = self.groups[group]
            self._results[group] = run_script_json(self.script, names, self.env(), self.timeout)
        return self._results[group]

    def reported(self, group: str, case: str) -> dict[str, Any]:
        """What the script reports on ``case``, which must not have crashed."""
        reported = self.group(group)[case]
        assert "crashed" not in reported, reported.get("crashed")
        return reported


def eager_calls(run: Callable[[Callable[..., Any]], Any], callback: Callable[..., Any]) -> int:
    """How often ``run(counted_callback)`` calls the callback with JAX's loops as Python loops."""
    calls = 0

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return callback(*args, **kwargs)

    with jax.disable_jit():
        run(counted)
    return calls
