"""Converted functions under ``jaxoverride.solve_state``: what a framework's state does there.

Outside a declaration, a function JAX converts into a pure jaxpr (``closure_convert``,
``custom_root``, ``custom_linear_solve``) may only read its state: a write could not
come out. Inside one, the frozen parts have a defined value in every evaluation (the
entry state), so the function runs through the source, as a loop body does:

* ``closure_convert``: the jaxpr also returns the state the function left, and each
  evaluation hands it to the innermost boundary (``Participant.written``), so in a
  solver's loop it flows out through the carry; a backward pass's is dropped;
* ``make_jaxpr``: the outputs are the caller's, so the writes are handed out by a
  ``write_out`` equation (``Participant.written_parts``) instead;
* ``custom_root``: the evaluations inside ``solve`` are the forward ones; the last one's
  state comes out of ``solve`` as an auxiliary output and is kept; ``f``'s other
  evaluations and ``custom_linear_solve``'s ``matvec`` keep nothing;
* a write to a part the declaration leaves per evaluation is refused, as outside one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxoverride import errors
from jaxoverride.adapter_kit._solve_policy import Participant
from jaxoverride.adapter_kit._state_threading import StateSource, Threaded
from jaxoverride.adapter_kit._write_out import write_out


class _Declared:
    """One conversion's function run through ``source`` under ``policy``."""

    __slots__ = ("policy", "recording", "source", "state", "thread", "where")

    def __init__(self, where: str, source: StateSource, policy: Participant):
        self.where = where
        self.source = source
        self.policy = policy
        self.thread: Threaded | None = Threaded(source, 1, where)
        self.state = self.thread.read()
        self.recording = True

    def run(self, fun: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
        thread = self.thread
        if thread is None:
            raise RuntimeError(f"{self.where}: the converted function ran after its release")
        out, after = thread.run(0, self.state, fun, *args)
        changed = self.policy.changed_per_evaluation(self.state, after)
        if changed:
            raise errors.PureFunctionWriteError(
                f"{self.where}: the function wrote {', '.join(changed)} inside a function "
                "that JAX turns into a pure jaxpr, which the jaxoverride.solve_state around "
                "it leaves per evaluation: such a write cannot come out. Declare it "
                "(jaxoverride.solve_state(state={...: 'at_solution'}) or rng='per_solve'), "
                "or write it before the call and pass it in."
            )
        return out, after

    def release(self) -> None:
        """Drops the values of the conversion's trace: the converted function, which a
        backward rule may keep, then holds none."""
        self.state = self.thread = None

    def record(self, after: Any) -> None:
        if self.recording:
            self.policy.written(after)


def declared_closure_convert(
    where: str,
    source: StateSource,
    policy: Participant,
    below: Callable[..., Any],
    fun: Callable[..., Any],
    example_args: tuple[Any, ...],
) -> tuple[Callable[..., Any], list[Any]]:
    """``closure_convert`` of ``fun`` whose evaluations keep what they write (above).

    Args:
      where: the neutral name, for messages.
      source: the framework's ``StateSource`` at the call.
      policy: its ``Participant`` (``participant(source)``).
      below: the ``closure_convert`` below.
      fun: the function to convert.
      example_args: its example arguments.

    Returns:
      ``(converted, constants)``, as ``jax.closure_convert`` returns them.

    Example:
      A declaration over a dict-of-arrays framework "doc" whose map draws from a key:

      >>> import jax, jax.numpy as jnp, jaxoverride as jo
      >>> from jaxoverride import adapter_kit as kit
      >>> store = {"key": jax.random.key(0)}
      >>> class Source(kit.DictStateSource):
      ...     framework = "doc"
      ...     def parts(self, state):
      ...         return [kit.StatePart("rng", (), "key")]
      >>> kit.register_solve_source("doc", lambda: Source(store))
      >>> def f(x):
      ...     store["key"], sub = jax.random.split(store["key"])
      ...     return x * jax.random.uniform(sub)
      >>> with jo.solve_state():
      ...     source = Source(store)
      ...     policy = kit.participant(source)
      ...     g, consts = kit.declared_closure_convert(
      ...         "doc", source, policy, jax.closure_convert, f, (1.0,))
      ...     same = float(g(1.0, *consts)) == float(g(1.0, *consts))
      >>> same  # one key per solve: every evaluation draws the same
      True
      >>> kit.unregister_solve_source("doc")
    """
    declared = _Declared(where, source, policy)
    # The state enters as floats of the same bits, frozen parts as at entry: closure_convert
    # hoists closed-over float tracers into arguments, where a key or an integer would
    # stay a constant of the jaxpr (a tracer of a trace that has ended when JAX traces a
    # backward rule that calls the converted function).
    floats, restoring = _as_floats(policy.freeze(declared.state))

    def run(*args: Any) -> tuple[Any, Any]:
        declared.state = state = _restored(floats, *restoring)
        try:
            with policy.rebased(state):
                return declared.run(fun, *args)
        finally:
            declared.state = None  # a value of closure_convert's trace

    try:
        converted, constants = below(run, *example_args)
    finally:
        declared.release()

    @functools.wraps(fun)
    def evaluated(*args: Any) -> Any:
        out, after = converted(*args)
        declared.record(after)
        return out

    return evaluated, constants


def declared_make_jaxpr(
    where: str,
    source: StateSource,
    policy: Participant,
    fun: Callable[..., Any],
) -> Callable[..., Any]:
    """``fun`` to trace with ``make_jaxpr`` in its place,
    whose jaxpr hands out, at each evaluation, what ``fun`` wrote (above).

    Args:
      where, source, policy: as for ``declared_closure_convert``.
      fun: the function being traced.

    Returns:
      The function to trace in place of ``fun``.

    Example:
      A declaration over a dict-of-arrays framework "doc" whose map writes a mean:

      >>> import jax, jax.extend.core, jax.numpy as jnp, jaxoverride as jo
      >>> from jaxoverride import adapter_kit as kit
      >>> store = {"mean": jnp.zeros(())}
      >>> class Source(kit.DictStateSource):
      ...     framework = "doc"
      ...     def parts(self, state):
      ...         return [kit.StatePart("state", ("mean",), "mean")]
      >>> kit.register_solve_source("doc", lambda: Source(store))
      >>> def f(x):
      ...     store["mean"] = 0.5 * store["mean"] + x
      ...     return 2.0 * x
      >>> with jo.solve_state():
      ...     source = Source(store)
      ...     traced = kit.declared_make_jaxpr(
      ...         "doc", source, kit.participant(source), f)
      ...     closed = jax.make_jaxpr(traced)(1.0)
      ...     _ = jax.extend.core.jaxpr_as_fun(closed)(3.0)
      >>> float(store["mean"])  # the last evaluation's write, kept at the exit
      3.0
      >>> kit.unregister_solve_source("doc")
    """
    declared = _Declared(where, source, policy)
    # What the evaluations before the conversion left, which the function is handed and
    # passes on where it writes nothing (a solver's loop test, converted in its loop):
    # not its write. Handed out of the jaxpr, it would be a constant of the conversion,
    # replacing at every evaluation what the evaluations since then wrote.
    handed = policy.frozen_written(declared.state)

    @functools.wraps(fun)
    def traced(*args: Any, **kwargs: Any) -> Any:
        out, after = declared.run(lambda *a: fun(*a, **kwargs), *args)
        written = {
            slot: leaf
            for slot, leaf in policy.frozen_written(after).items()
            if handed.get(slot) is not leaf
        }
        slots = list(written)

        def write(values: list[Any]) -> None:
            policy.written_parts(dict(zip(slots, values, strict=True)))

        write_out(policy, list(written.values()), write, where)
        return out

    return traced


def declared_custom_root(
    where: str,
    source: StateSource,
    policy: Participant,
    below: Callable[..., Any],
    f: Callable[[Any], Any],
    initial_guess: Any,
    solve: Callable[..., Any],
    tangent_solve: Callable[..., Any],
    has_aux: bool,
) -> Any:
    """``custom_root`` whose ``solve`` keeps what its last evaluation of ``f`` wrote."""
    declared = _Declared(where, source, policy)
    declared.recording = False

    def evaluated(x: Any) -> Any:
        out, after = declared.run(f, x)
        declared.record(after)
        return out

    def solving(g: Callable[[Any], Any], guess: Any) -> Any:
        # ``solve`` gets the map run through the source, not JAX's ``g``: from jax 0.12
        # ``g`` evaluates ``f``'s jaxpr, traced once, whose state effects are gone. (JAX
        # never differentiates ``solve``: its ``g`` only stops gradients that no rule
        # takes.)
        del g
        frame = policy.push()
        declared.recording = True
        try:
            result = solve(evaluated, guess)
        finally:
            declared.recording = False
            policy.pop(frame)
        solution, aux = result if has_aux else (result, None)
        if frame.last is None:
            return solution, (aux, None)
        floats, restoring[:] = _as_floats(frame.last)
        return solution, (aux, floats)

    restoring: list[Any] = []
    solution, (aux, last) = below(evaluated, initial_guess, solving, tangent_solve, has_aux=True)
    if last is not None:
        policy.written(_restored(last, *restoring))
    return (solution, aux) if has_aux else solution


# JAX's custom_root gives its auxiliary outputs tangents of their own dtype, which an
# integer or key output cannot have (``float0``): the state passes through as floats.
def _as_floats(tree: Any) -> tuple[list[jax.Array], list[Any]]:
    leaves, treedef = jax.tree.flatten(tree)
    floats, kinds = [], []
    for leaf in leaves:
        leaf = jnp.asarray(leaf)
        impl = None
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            impl, leaf = jax.random.key_impl(leaf), jax.random.key_data(leaf)
        kinds.append((impl, leaf.dtype))
        if jnp.issubdtype(leaf.dtype, jnp.inexact):
            floats.append(leaf)
        elif leaf.dtype.itemsize in (4, 8):
            floats.append(jax.lax.bitcast_convert_type(leaf, _FLOATS[leaf.dtype.itemsize]))
        else:  # bool, 8- and 16-bit integers: exact in float32
            floats.append(leaf.astype(jnp.float32))
    return floats, [treedef, kinds]


_FLOATS = {4: jnp.float32, 8: jnp.float64}


def _restored(floats: list[jax.Array], treedef: Any, kinds: list[Any]) -> Any:
    leaves = []
    for value, (impl, dtype) in zip(floats, kinds, strict=True):
        if jnp.issubdtype(dtype, jnp.inexact):
            data = value
        elif dtype.itemsize in (4, 8):
            data = jax.lax.bitcast_convert_type(value, dtype)
        else:
            data = value.astype(dtype)
        leaves.append(data if impl is None else jax.random.wrap_key_data(data, impl=impl))
    return jax.tree.unflatten(treedef, leaves)


def declared_linear_solve(
    where: str,
    source: StateSource,
    policy: Participant,
    below: Callable[..., Any],
    matvec: Callable[[Any], Any],
    *args: Any,
    **options: Any,
) -> Any:
    """``custom_linear_solve`` whose ``matvec`` sees the declared state and keeps nothing."""
    declared = _Declared(where, source, policy)
    declared.recording = False
    return below(lambda x: declared.run(matvec, x)[0], *args, **options)
