"""optimistix, lineax and diffrax, unmodified, with a Haiku model in their callbacks.

Equinox compiles ``eqx.filter_jit`` when optimistix/diffrax/lineax are imported and
closure-converts every callback with ``jax.make_jaxpr``, so these libraries work inside
``hk.transform`` only when ``jo.interpose_on_import("equinox", ...)`` runs before they are
imported. Each group of cases therefore runs in a fresh interpreter
(``tests/_equinox_haiku.py``, which prints JSON); this file asserts on what it reports,
case by case:

* init creates the parameters once, under the names a direct call of the layer gives,
  and none of them is a tracer;
* apply, ``jax.jit(apply)``, apply under ``install()`` instead of ``context()``,
  ``jax.grad`` and ``jax.jit(jax.grad)`` (with respect to params and inputs) equal the
  same library run on the explicit parameters with raw JAX;
* a state write or an rng draw inside the callback is refused by jaxoverride with a
  ``PureFunctionWriteError`` that says why, at init, at apply and under ``jax.jit``, and
  the refusal leaves the read-only model working.

The in-process tests of ``tests/test_libraries_haiku.py`` pin what happens when the
libraries are interposed only after they were imported.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jax
import pytest

import jaxoverride as jo
import jaxoverride_haiku as joh
from _libraries import REFUSALS, FreshScript, assert_callback_refusal, run_fresh

# Each test runs fresh interpreters that import the solver libraries: `make test-slow`.
pytestmark = pytest.mark.slow

GROUPS = {
    "optimistix": [
        "fixed_point_iteration",
        "fixed_point_newton",
        "root_find_newton",
        "least_squares_gauss_newton",
    ],
    "lineax_diffrax": ["linear_solve_gmres", "neural_ode_tsit5"],
    "inside": ["inside:fixed_point_iteration", "inside:neural_ode_tsit5"],
}
SCRIPT = FreshScript(Path(__file__).with_name("_equinox_haiku.py"), GROUPS, [jo, joh], timeout=600)
CASES = SCRIPT.cases(besides="inside")


@pytest.fixture(params=CASES, ids=[case for _, case in CASES])
def result(request) -> dict[str, Any]:
    return SCRIPT.reported(*request.param)


def test_init_creates_the_parameters_once_and_leaks_nothing(result):
    assert result["params"] == result["direct_params"]
    assert result["param_tracers"] == 0
    assert result["output_tracers"] == 0


def test_apply_and_jit_apply_equal_the_explicit_library_call(result):
    assert result["apply"] <= 1e-5
    assert result["jit_apply"] <= 1e-5
    assert result["first_traces"] == 1  # jax.jit(apply) traces the model once...
    assert result["retraces"] == 0  # ...and called again with new values, not again


def test_install_works_as_the_context_does(result):
    assert result["installed_params"] == 0.0  # init under install(): the same parameters
    assert result["installed_apply"] <= 1e-5


def test_the_gradient_program_is_the_explicit_one(result):
    """``make_jaxpr`` of ``jax.grad`` inside Haiku lists the same primitives, in the same
    order and nesting, as on the explicit parameters: nothing of the adapter remains.

    On JAX 0.12 this holds because a staged rule takes only the params its function
    reads: a staged ``custom_jvp`` met in ``jax.linearize`` (optimistix's Newton step)
    makes each of its inputs a residual, and the unread bias would be one more leaf of
    lineax's operator."""
    assert result["primitives"] > 20  # the whole solver, not an empty program
    assert result["only_ours"] == {}
    if not result["same_primitives"]:
        # diffrax only: its dt0 sign check (``eqx.error_if`` on a constant, which passes
        # at trace time) is an identity ``jit`` that raw JAX keeps (plus the cast of its
        # weak-typed output), while through the Haiku ``jit`` override JAX forwards the
        # input and drops the empty ``jit``.
        assert result["only_explicit"] == {"jit": 1, "convert_element_type": 1}


def test_gradients_wrt_params_and_inputs_equal_the_explicit_ones(result):
    # The gradients are O(1) (``grad_scale``): a wrong or missing term would show.
    assert result["grad_scale"] > 0.1
    assert result["grad"] <= 1e-5 * result["grad_scale"] + 1e-6
    assert result["jit_grad"] <= 1e-5 * result["grad_scale"] + 1e-6


@pytest.mark.parametrize("where", REFUSALS)
def test_state_writes_and_rng_draws_in_the_callback_are_refused(result, where):
    assert_callback_refusal(
        result,
        where,
        written="Haiku state '~/calls' was written",
        drawn="rng key was drawn",
        why="nothing it writes or draws could come out",
    )


def test_a_state_write_outside_the_callback_works(result):
    """The fix the refusal names: the same write, before the library call, is kept."""
    assert result["write_outside"] <= 1e-5
    # Haiku's init returns the initial state (0), as raw Haiku does; one apply adds one.
    assert result["write_outside_calls"] == 1


def test_haiku_neural_ode_example_trains_through_diffrax():
    """``examples/haiku_neural_ode.py`` in a fresh interpreter (its import order matters):
    it checks its first loss and gradient against diffrax on the explicit parameters."""
    example = Path(__file__).resolve().parents[1] / "examples" / "haiku_neural_ode.py"
    out = run_fresh([str(example)], SCRIPT.env(), timeout=600)
    losses = [float(v) for v in out.split("loss per step:", 1)[1].splitlines()[0].split()]
    assert len(losses) == 8
    assert losses[-1] < 0.5 * losses[0]
    assert int(out.split("traces of the loss:", 1)[1].split()[0]) == 1  # one compile, then hits
    assert "['vector_field/~/linear_0', 'vector_field/~/linear_1']" in out


def test_the_import_order_snippet_of_the_docs_runs_in_a_fresh_interpreter():
    """``docs/existing-libraries.md`` shows the import-order rule in the ``python`` block marked
    ``<!-- docs-test: fresh interpreter, equinox-family -->`` (``tests/test_docs.py`` runs it
    too): it runs here in a fresh interpreter, with checks of its own appended."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "existing-libraries.md").read_text()
    fence = "<!-- docs-test: fresh interpreter, equinox-family -->\n```python\n"
    start = page.index(fence) + len(fence)
    assert page[start:].startswith("import jaxoverride as jo\n")
    snippet = page[start : page.index("```", start)]
    check = "\nassert set(params) == {'cell'}\nassert not isinstance(z, jax.core.Tracer)\n"
    run_fresh(["-c", snippet + check], SCRIPT.env(), timeout=600)


def test_a_module_built_inside_the_callback_is_one_module_per_trace():
    """Haiku names every construction anew, and these libraries trace the callback more
    than once: optimistix once (one ``cell``), diffrax three times (``cell``, ``cell_1``,
    ``cell_2``; the last feeds the solution). Init and apply agree on the names, so apply
    works; the docs say to build modules outside the callback."""
    reported = SCRIPT.group("inside")
    for case, modules in (
        ("inside:fixed_point_iteration", ["cell"]),
        ("inside:neural_ode_tsit5", ["cell", "cell_1", "cell_2"]),
    ):
        assert "crashed" not in reported[case], reported[case].get("crashed")
        assert reported[case]["modules"] == modules
        assert reported[case]["apply_uses_last"] <= 1e-5


def _nondifferentiable(custom_jvp: Any) -> Any:
    """Equinox's ``nondifferentiable``: a ``custom_jvp`` whose rule always raises."""

    @functools.partial(custom_jvp, nondiff_argnums=(0,))
    def nondifferentiable(message: str, x: Any) -> Any:
        return x

    @nondifferentiable.defjvp
    def _(message: str, primals: Any, tangents: Any) -> Any:
        raise RuntimeError(message)

    return nondifferentiable


@pytest.mark.parametrize("jit", [False, True], ids=["grad", "jit_grad"])
def test_a_jvp_rule_is_not_called_when_only_haiku_params_are_differentiated(jit):
    """Equinox guards its closure-converted inputs with ``nondifferentiable``. Raw JAX calls
    no JVP rule when none of the function's own arguments is perturbed; inside Haiku the
    params are perturbed too, but the rule gives no tangent for them, so it must not be
    called either: the gradient equals raw JAX's, and a perturbed argument still raises."""
    import haiku as hk
    import jax
    import jax.numpy as jnp
    import numpy as np

    x = jnp.array([1.0, 2.0])

    def loss(nondifferentiable: Any, w: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.sum(nondifferentiable("x is not differentiable", x) * w)

    def forward(x: jax.Array) -> jax.Array:
        w = hk.get_parameter("w", [2], init=jnp.ones)
        return loss(_nondifferentiable(jo.custom_jvp), w, x)

    model = hk.transform(forward)
    grad = jax.grad(lambda p, x: model.apply(p, None, x))
    with joh.context():
        params = model.init(None, x)
        got = (jax.jit(grad) if jit else grad)(params, x)
        with pytest.raises(RuntimeError, match="x is not differentiable"):
            jax.grad(lambda x: model.apply(params, None, x))(x)
    raw = jax.grad(functools.partial(loss, _nondifferentiable(jax.custom_jvp)))(jnp.ones(2), x)
    np.testing.assert_array_equal(got["~"]["w"], raw)
