"""Shared machinery of the differential parity tests (``test_parity_*.py``).

A *case* is a function ``fn(api, *args)`` written once against a namespace ``api`` that is
either JAX itself (``JAX``: ``jax.jit``, ``jax.lax.scan``, ...) or ``jaxoverride``. The
tests run it through both and require the same outputs (values, dtypes, weak types and
tree structure), the same ``jax.make_jaxpr`` text, and the same gradients, in four
*modes*:

- ``idle``: nothing active anywhere, the neutral API's fast path;
- ``context``: inside an ``override_context`` whose implementations only log their name
  and delegate with ``jo.next_impl``, i.e. the slow path through the dispatcher;
- ``installed_active``: the same pass-through layer installed globally (``when=None``);
- ``installed_inactive``: installed with a false predicate, so every neutral call goes
  through the slow path but resolves to JAX;
- ``scoped`` (jaxprs only, see ``check_jaxprs_in_mode``): installed with
  ``scoped=True`` and run inside its ``scope()``.

In the pass-through modes each case also asserts that the overrides it exercises were
really reached (``Case.uses``), so a neutral function that silently bypasses the stack
fails here.

``ADAPTER_MODES`` run the same cases under each adapter where it has nothing to do
(``adapter_parity_tests``); ``ALL_MODES`` are the modes of the error and API tests.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import re
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxoverride as jo
from jaxoverride import _stack

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
"""The event of ``jax.monitoring`` that JAX records once per XLA compilation."""

TOP_LEVEL = sorted(name for name in jo.OVERRIDEABLE if not name.startswith("lax."))
LAX = sorted(name[4:] for name in jo.OVERRIDEABLE if name.startswith("lax."))

JAX = types.SimpleNamespace(**{name: getattr(jax, name) for name in TOP_LEVEL}, lax=jax.lax)
"""The reference namespace: every name a case may call, as JAX's own function."""

MODES = ("idle", "context", "installed_active", "installed_inactive")
PASSING_MODES = ("context", "installed_active", "scoped")

LOG: list[str] = []
"""Names the pass-through overrides were called for, in order."""


def _passthrough(name: str) -> Callable[..., Any]:
    def impl(*args: Any, **kwargs: Any) -> Any:
        LOG.append(name)
        return jo.next_impl(name)(*args, **kwargs)

    impl.__qualname__ = f"passthrough[{name}]"
    return impl


# Module-level implementations and predicate: re-entering equal layers then hits the
# wrappers' caches, exactly as a real adapter's module-level context does.
PASSTHROUGH = {name: _passthrough(name) for name in sorted(jo.OVERRIDEABLE)}
PASSTHROUGH_CONTEXT = jo.override_context(PASSTHROUGH, name="passthrough")


def _never() -> bool:
    return False


@contextlib.contextmanager
def active(mode: str) -> Iterator[None]:
    """Runs the block in one of ``MODES``; ``LOG`` is cleared on entry."""
    LOG.clear()
    if mode == "idle":
        if not _stack.idle:
            gc.collect()  # activations are counted down when freed
        assert _stack.idle, f"not idle at the start of an idle-mode test: {jo.current_stack()}"
        yield
        assert _stack.idle
    elif mode == "context":
        with PASSTHROUGH_CONTEXT:
            assert not _stack.idle
            yield
    elif mode == "scoped":
        with jo.install(PASSTHROUGH, scoped=True, name="passthrough-scoped") as installation:
            assert _stack.idle  # outside its scope a scoped installation costs nothing
            with installation.scope():
                yield
    elif mode in ("installed_active", "installed_inactive"):
        when = None if mode == "installed_active" else _never
        with jo.install(PASSTHROUGH, when=when, name=f"passthrough-{mode}"):
            assert not _stack.idle
            yield
    elif mode in ADAPTER_MODES:
        with adapter_context(mode):
            yield
    else:  # pragma: no cover
        raise ValueError(mode)


ADAPTER_MODES = ("plain", "haiku_installed", "nnx_track", "dag", "linen_installed")
"""Each adapter active where it has nothing to do, so it must behave exactly as JAX:

- ``plain``: ``jaxoverride_plain.context()`` outside ``init_context()``;
- ``haiku_installed``: ``jaxoverride_haiku.install()``, outside any ``hk.transform``;
- ``nnx_track``: ``jaxoverride_nnx.track(m)`` of a module ``m`` that the code never uses;
- ``dag``: ``jaxoverride_dag.context()`` (functional: without sharing or non-array leaves
  in the arguments, it must give what JAX gives);
- ``linen_installed``: ``jaxoverride_linen.install()``, outside any bound Linen module.
"""


ALL_MODES = (*MODES, *ADAPTER_MODES)
"""The modes of the error and API tests: the pass-through stacks and every adapter."""


@contextlib.contextmanager
def adapter_context(mode: str) -> Iterator[None]:
    """Runs the block in one of ``ADAPTER_MODES``; imports the adapter on first use."""
    if mode not in ADAPTER_MODES:  # pragma: no cover
        raise ValueError(mode)
    # Each mode is named after its adapter: "haiku_installed" runs jaxoverride_haiku.
    adapter = importlib.import_module(f"jaxoverride_{mode.split('_')[0]}")
    if mode == "nnx_track":
        with adapter.track(_unrelated_module()):
            yield
    elif mode.endswith("_installed"):
        adapter.install()
        try:
            yield
        finally:
            adapter.uninstall()
    else:  # plain and dag: their context()
        with adapter.context():
            yield


@functools.cache
def _unrelated_module() -> Any:
    from flax import nnx

    class Unrelated(nnx.Module):
        def __init__(self) -> None:
            self.w = nnx.Param(jnp.ones(2))
            self.calls = nnx.Variable(jnp.array(0))

    return Unrelated()


@pytest.fixture(autouse=True, scope="module")
def fresh_jax_caches_per_module() -> Iterator[None]:
    """Drops JAX's tracing and compilation caches after each test module that imports it.

    conftest collects garbage after every test, and that costs time in proportion to the
    objects alive: without this, the jaxprs and executables cached by the parity modules
    made every later ``gc.collect()`` several times slower (measured: 46 s of 126 s).
    """
    yield
    jax.clear_caches()


# ---------------------------------------------------------------------------------------
# Comparison


def _leaf_signature(leaf: Any) -> tuple[Any, ...]:
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return ("ShapeDtypeStruct", leaf.shape, leaf.dtype, leaf.weak_type)
    if isinstance(leaf, jax.Array):
        return ("Array", leaf.shape, leaf.dtype, leaf.weak_type)
    if isinstance(leaf, np.ndarray | np.generic):
        return ("numpy", leaf.shape, leaf.dtype)
    return (type(leaf).__name__,)


def assert_same(actual: Any, expected: Any, what: str = "output") -> None:
    """Same tree structure, and per leaf: same kind, shape, dtype, weak type and bits."""
    actual_leaves, actual_tree = jax.tree_util.tree_flatten(actual)
    expected_leaves, expected_tree = jax.tree_util.tree_flatten(expected)
    assert actual_tree == expected_tree, f"{what}: tree {actual_tree} != {expected_tree}"
    for index, (a, e) in enumerate(zip(actual_leaves, expected_leaves, strict=True)):
        assert _leaf_signature(a) == _leaf_signature(e), (
            f"{what} leaf {index}: {_leaf_signature(a)} != {_leaf_signature(e)}"
        )
        if isinstance(e, jax.ShapeDtypeStruct):
            assert a.sharding == e.sharding, f"{what} leaf {index}: sharding differs"
            continue
        if isinstance(e, jax.Array) and e.dtype == jax.dtypes.float0:
            continue
        if isinstance(e, jax.Array):
            assert a.sharding.is_equivalent_to(e.sharding, e.ndim), (
                f"{what} leaf {index}: sharding {a.sharding} != {e.sharding}"
            )
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e), err_msg=f"{what} leaf {index}")


# JAX 0.8's pmap names its mesh axis with a fresh object per call, printed with its id
# (`'<axis 0x7f...>'`), so even two raw-JAX jaxprs or errors differ there; the id is not
# the program.
_AXIS_ID = re.compile(r"<axis 0x[0-9a-f]+>")
# JAX's next custom_vjp (`jax_custom_vjp3`) names a rule by its repr, address included
# ('<function f.<locals>.<lambda> at 0x7f...>'), and the error cases make new lambdas on
# every call: the address is not the message.
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


def error_messages(thunks: Sequence[Callable[[], Any]]) -> list[tuple[type, str] | None]:
    """For each thunk, the type and text of what it raised, or ``None`` if it returned."""
    found: list[tuple[type, str] | None] = []
    for thunk in thunks:
        try:
            thunk()
        except Exception as error:
            found.append((type(error), _ADDRESS.sub("", _AXIS_ID.sub("<axis>", str(error)))))
        else:
            found.append(None)
    return found


def assert_same_errors(
    actual: Sequence[tuple[type, str] | None],
    expected: Sequence[tuple[type, str] | None],
    mode: str,
) -> None:
    """The errors of ``error_messages`` in ``mode`` are JAX's.

    With a pass-through stack they are identical; under an adapter each has JAX's type and
    JAX's message in its own (an adapter may add where the error happened, never replace).
    """
    assert len(actual) == len(expected)
    wrong = [
        f"call {index}: {difference}"
        for index, (got, want) in enumerate(zip(actual, expected, strict=True))
        if (difference := _error_difference(got, want, mode)) is not None
    ]
    assert not wrong, f"[mode {mode}] errors differ from JAX's:\n" + "\n".join(wrong)


def _error_difference(
    got: tuple[type, str] | None, want: tuple[type, str] | None, mode: str
) -> str | None:
    if want is None or got is None or mode not in ADAPTER_MODES:
        return None if got == want else f"{got} != {want}"
    if got[0] is not want[0]:
        return f"{got[0].__name__} is not JAX's {want[0].__name__}: {got[1]!r}"
    if want[1] not in got[1]:
        return f"JAX's message {want[1]!r} is not in {got[1]!r}"
    return None


@contextlib.contextmanager
def counting_compiles() -> Iterator[list[str]]:
    """Yields the list of XLA compilations (the compiled function's name) in the block.

    JAX reports each backend compilation as a duration event; a cache hit reports none.
    """
    compiled: list[str] = []

    def listener(event: str, duration: float, **kwargs: Any) -> None:
        if event == BACKEND_COMPILE_EVENT:
            compiled.append(str(kwargs.get("fun_name", "?")))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield compiled
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def program_text(jaxpr: Any) -> str:
    """A jaxpr's text without what names an object rather than the program: an axis's id
    and an address (``jax.debug.callback``'s callback is a new closure per trace, printed
    with its address on JAX 0.8)."""
    return _ADDRESS.sub("", _AXIS_ID.sub("<axis>", str(jaxpr)))


def jaxpr_text(fn: Callable[..., Any], *args: Any) -> str:
    return program_text(jax.make_jaxpr(fn)(*args))


# ---------------------------------------------------------------------------------------
# Cases


@dataclass(frozen=True)
class Case:
    """One call pattern, written once against ``api``.

    Attributes:
      id: the pytest id.
      fn: ``fn(api, *args)``; ``api`` is ``JAX`` or ``jaxoverride``.
      args: a thunk returning the arguments (built lazily: no device work at import).
      uses: the overridable names the neutral version must dispatch through.
      diff: ``"rev"`` (``jax.grad``), ``"fwd"`` (``jax.jvp``, for loops JAX cannot
        reverse-differentiate) or ``None``.
      argnums: the float arguments to differentiate with respect to.
      jaxpr: whether ``jax.make_jaxpr`` applies (false for host-side results).
    """

    id: str
    fn: Callable[..., Any]
    args: Callable[[], tuple[Any, ...]]
    uses: tuple[str, ...]
    diff: str | None = "rev"
    argnums: tuple[int, ...] = (0,)
    jaxpr: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def call(self, api: Any, *args: Any) -> Any:
        return self.fn(api, *args)


def _scalar(tree: Any) -> jax.Array:
    """A scalar that depends non-linearly on every float leaf of ``tree``."""
    total = jnp.float32(0.0)
    for index, leaf in enumerate(jax.tree_util.tree_leaves(tree)):
        leaf = jnp.asarray(leaf)
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            total = total + jnp.sum(jnp.sin(leaf * (index + 1.0)))
    return total


def derivative(case: Case, api: Any) -> Callable[..., Any]:
    """The derivative of ``case`` under ``api`` as a function of all its arguments."""

    def restricted(args: Sequence[Any]) -> Callable[..., Any]:
        def f(*diff_args: Any) -> Any:
            full = list(args)
            for position, value in zip(case.argnums, diff_args, strict=True):
                full[position] = value
            return case.call(api, *full)

        return f

    if case.diff == "rev":

        def rev(*args: Any) -> Any:
            return jax.grad(
                lambda *d: _scalar(restricted(args)(*d)), argnums=tuple(range(len(case.argnums)))
            )(*(args[i] for i in case.argnums))

        return rev

    def fwd(*args: Any) -> Any:
        primals = tuple(jnp.asarray(args[i]) for i in case.argnums)
        tangents = tuple(
            jnp.full_like(p, 0.5) + jnp.arange(p.size).reshape(p.shape) * 0.25 for p in primals
        )
        return jax.jvp(restricted(args), primals, tangents)

    return fwd


@functools.cache
def mesh8() -> jax.sharding.Mesh:
    """A one-axis mesh over the 8 CPU devices that conftest asks XLA for."""
    assert jax.device_count() == 8, "conftest sets XLA_FLAGS for 8 CPU devices"
    return jax.make_mesh((8,), ("x",))


def f32(*shape: int, offset: float = 0.0) -> np.ndarray:
    """Deterministic, non-symmetric float32 test data."""
    size = int(np.prod(shape)) if shape else 1
    data = np.linspace(-1.3, 1.7, size, dtype=np.float32) + np.float32(offset)
    return data.reshape(shape)


# ---------------------------------------------------------------------------------------
# The three differential tests, generated for a list of cases


def parity_tests(cases: Sequence[Case]) -> Callable[..., None]:
    """``test_parity(case)``: one test per case, run in every one of ``MODES``.

    In each mode it compares the neutral call's outputs (run eagerly, as a user would;
    not in ``installed_inactive``) and its ``jax.make_jaxpr`` text with JAX's; in the
    ``idle`` and ``context`` modes also the jaxpr of its derivative, and (idle) the
    derivative's values under ``jax.jit``: with equal jaxprs the compiled code is the
    same, so the values are checked once. JAX's reference results are computed with
    nothing active; ``check_raw_jax_ignores_overrides`` shows that raw JAX never
    dispatches through an override, so where they are computed changes nothing. (One
    test per case rather than per case and mode: conftest's per-test ``gc.collect()``
    dominates otherwise.)
    """
    ids = [case.id for case in cases]
    assert len(set(ids)) == len(ids), "case ids must be unique"

    def check_dispatch(case: Case, mode: str, what: str) -> None:
        if mode in PASSING_MODES:
            missing = [name for name in case.uses if name not in LOG]
            assert not missing, f"{what}: the neutral call never reached the override of {missing}"
        else:
            assert LOG == [], f"{what}: {LOG}"
        LOG.clear()

    @pytest.mark.parametrize("case", cases, ids=ids)
    def test_parity(case: Case) -> None:
        args = case.args()
        expected = case.call(JAX, *args)
        if case.jaxpr:
            expected_jaxpr = jaxpr_text(functools.partial(case.call, JAX), *args)
        if case.diff:
            expected_grad_jaxpr = jaxpr_text(derivative(case, JAX), *args)
            expected_grad = jax.jit(derivative(case, JAX))(*args)
        for mode in MODES:
            where = f"[mode {mode}]"
            # installed_inactive resolves to JAX through the same slow path as the
            # other installed mode: its jaxpr shows that, and skipping its eager run
            # (every eager op compiles again per stack) keeps this file fast.
            eager = mode != "installed_inactive"
            with active(mode):
                if eager:
                    actual = case.call(jo, *args)
                    check_dispatch(case, mode, f"{where} outputs")
                if case.jaxpr:
                    actual_jaxpr = jaxpr_text(functools.partial(case.call, jo), *args)
                    check_dispatch(case, mode, f"{where} jaxpr")
                differentiate = case.diff is not None and mode in ("idle", "context")
                if differentiate:
                    actual_grad_jaxpr = jaxpr_text(derivative(case, jo), *args)
                    check_dispatch(case, mode, f"{where} derivative jaxpr")
                if differentiate and mode == "idle":
                    actual_grad = jax.jit(derivative(case, jo))(*args)
            if eager:
                assert_same(actual, expected, f"{where} outputs")
            if case.jaxpr:
                assert actual_jaxpr == expected_jaxpr, f"{where} jaxprs differ"
            if differentiate:
                assert actual_grad_jaxpr == expected_grad_jaxpr, f"{where} derivative jaxprs differ"
            if differentiate and mode == "idle":
                assert_same(actual_grad, expected_grad, f"{where} derivative")

    return test_parity


def adapter_parity_tests(
    cases: Sequence[Case], known: Mapping[tuple[str, str], str] | None = None
) -> Callable[..., None]:
    """``test_parity_under_adapter(mode, case)``: every case under every adapter.

    In each of ``ADAPTER_MODES`` the adapter is active but has nothing to do, so the
    neutral call must be JAX's: the same outputs (run eagerly, as a user would), the same
    ``jax.make_jaxpr`` text, the same derivative values (under ``jax.jit``), and a second
    call compiles exactly what JAX's second call compiles (nothing, but for an eager
    ``lax.map``, which JAX compiles on every call). Differences that another
    piece of work removes are listed in ``known``: ``{(mode, case id): reason}``, each a
    strict ``xfail``.
    """
    known = dict(known or {})
    ids = {case.id for case in cases}
    unknown = [key for key in known if key[0] not in ADAPTER_MODES or key[1] not in ids]
    assert not unknown, f"known differences of no case: {unknown}"
    params = [
        pytest.param(
            mode,
            case,
            id=f"{mode}-{case.id}",
            marks=[pytest.mark.xfail(strict=True, reason=known[mode, case.id])]
            if (mode, case.id) in known
            else [],
        )
        for mode in ADAPTER_MODES
        for case in cases
    ]

    references: dict[str, tuple[Any, ...]] = {}

    def reference(case: Case) -> tuple[Any, ...]:
        """JAX's results for ``case``, computed once for the four adapter modes."""
        if case.id not in references:
            args = case.args()
            expected = case.call(JAX, *args)
            with counting_compiles() as recompiles:
                case.call(JAX, *args)
            jaxpr = jaxpr_text(functools.partial(case.call, JAX), *args) if case.jaxpr else ""
            grad = jax.jit(derivative(case, JAX))(*args) if case.diff else None
            references[case.id] = (expected, recompiles, jaxpr, grad)
        return references[case.id]

    @pytest.mark.parametrize(("mode", "case"), params)
    def test_parity_under_adapter(mode: str, case: Case) -> None:
        args = case.args()
        expected, expected_recompiles, expected_jaxpr, expected_grad = reference(case)
        with active(mode):
            actual = case.call(jo, *args)
            with counting_compiles() as recompiles:
                again = case.call(jo, *args)
            actual_jaxpr = jaxpr_text(functools.partial(case.call, jo), *args) if case.jaxpr else ""
            actual_grad = jax.jit(derivative(case, jo))(*args) if case.diff else None
        where = f"[mode {mode}]"
        assert_same(actual, expected, f"{where} outputs")
        assert_same(again, expected, f"{where} outputs of the second call")
        assert actual_jaxpr == expected_jaxpr, f"{where} jaxprs differ"
        assert_same(actual_grad, expected_grad, f"{where} derivative")
        assert recompiles == expected_recompiles, (
            f"{where} the second call compiled {recompiles}, JAX's {expected_recompiles}"
        )

    return test_parity_under_adapter


def raw_jax_test(cases: Sequence[Case]) -> Callable[[], None]:
    """``test_raw_jax_ignores_overrides()``: ``check_raw_jax_ignores_overrides(cases)``."""

    def test_raw_jax_ignores_overrides() -> None:
        check_raw_jax_ignores_overrides(cases)

    return test_raw_jax_ignores_overrides


def scoped_jaxprs_test(cases: Sequence[Case]) -> Callable[[], None]:
    """``test_jaxprs_inside_a_scoped_installation()``: ``check_jaxprs_in_mode`` in ``scoped``."""

    def test_jaxprs_inside_a_scoped_installation() -> None:
        check_jaxprs_in_mode(cases, "scoped")

    return test_jaxprs_inside_a_scoped_installation


def check_errors_in_mode(
    errors: Callable[[Any], Sequence[tuple[type, str] | None]], mode: str
) -> Sequence[tuple[type, str] | None]:
    """``errors(api)`` (see ``error_messages``) with jaxoverride in ``mode`` gives JAX's errors.

    Returns JAX's, for the caller to check that the calls really fail where they should.
    """
    expected = errors(JAX)
    with active(mode):
        actual = errors(jo)
    assert_same_errors(actual, expected, mode)
    return expected


def check_raw_jax_ignores_overrides(cases: Sequence[Case]) -> None:
    """Raw JAX functions never reach an override, even while the pass-through is active."""
    with active("context"):
        for case in cases:
            case.call(JAX, *case.args())
        assert LOG == []


def check_jaxprs_in_mode(cases: Sequence[Case], mode: str) -> None:
    """The jaxpr part of ``test_parity`` for every case, in one more mode."""
    for case in cases:
        if not case.jaxpr:
            continue
        args = case.args()
        expected = jaxpr_text(functools.partial(case.call, JAX), *args)
        with active(mode):
            actual = jaxpr_text(functools.partial(case.call, jo), *args)
            if mode in PASSING_MODES:
                missing = [name for name in case.uses if name not in LOG]
                assert not missing, f"{case.id}: never reached the override of {missing}"
        assert actual == expected, f"{case.id} [mode {mode}]: jaxprs differ"
