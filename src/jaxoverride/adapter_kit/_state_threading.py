"""State threading: run a framework's implicit state through JAX control flow, explicitly.

A framework that keeps state outside JAX's view (Linen's collections and rng counters,
Haiku's frame, NNX's Variables) cannot let a traced loop body or branch write it: the
write would be a leaked tracer. The combinators here put that state in the carry (or
the operands), install the traced values while the body runs, read back what it left,
restore the caller's values, and write the result back after the JAX call. A framework
provides a ``StateSource`` (``_state_source``), whose docstring is the contract.

Stability: semi-public, for adapters in this repository and their authors. The contract
and the combinators' signatures change only with a note in the changelog.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.core import Tracer, eval_jaxpr

from jaxoverride.adapter_kit._batched_map import batched_map
from jaxoverride.adapter_kit._cache import WrapperCache
from jaxoverride.adapter_kit._handed import handed_call, wraps
from jaxoverride.adapter_kit._operands import (
    NO_OPERAND as _NO_OPERAND,
    as_jax_operands,
    distinct_functions,
    first_slice,
)
from jaxoverride.adapter_kit._phase import applying, is_applying
from jaxoverride.adapter_kit._solve_policy import Participant, participant
from jaxoverride.adapter_kit._state_source import StateSource, require_source
from jaxoverride.adapter_kit._trace_abort import TraceAbort
from jaxoverride.errors import StructureChangeError

# A traced body left state whose structure differs from the state it received: the
# one structure-change error (the kit's name kept for the code that catches it).
StateStructureError = StructureChangeError


class _RetraceRequestedError(Exception):
    """Raised by ``Threaded.finish``, outside every trace, to run the JAX call again."""


_RETRACES = 3


class Threaded:
    """Runs ``count`` functions traced by one JAX call, the source's state threaded.

    Function ``i`` starts from the names function ``i - 1`` ended in (the first from the
    caller's; a retrace from the same again); ``finish(state)`` writes the JAX call's
    state and leaves the caller's names where the last function ended. With
    ``alternatives`` (branches of a source with ``alternative_branches``) each starts
    from the caller's names and ``finish`` leaves the join of their ends.

    Args:
      source: the ``StateSource``.
      count: how many distinct functions the JAX call traces.
      where: the neutral name, for error messages.
      alternatives: whether the functions are alternatives (see above).
      backward: whether it runs in a backward pass (under a declaration, its writes are
        dropped).
    """

    __slots__ = ("_alternatives", "_ends", "_starts", "backward", "policy", "source", "where")

    def __init__(
        self,
        source: StateSource,
        count: int,
        where: str,
        alternatives: bool = False,
        backward: bool = False,
    ):
        self.source = require_source(source, where)
        self.where = where
        self._alternatives = alternatives
        self._starts: list[Any] = [source.names()] + [None] * (count - 1)
        self._ends: list[Any] = [None] * count
        # The ``jaxoverride.solve_state`` declaration this call runs under, if any.
        self.policy: Participant | None = participant(source)
        self.backward = backward
        if self.policy is not None and not backward:
            self.policy.learn(source.read())

    def _start(self, index: int) -> Any:
        if self._alternatives:
            return self._starts[0]
        start = self._starts[index]
        if start is None:
            earlier = (e for e in reversed(self._ends[:index]) if e is not None)
            start = self._starts[index] = next(earlier, self._starts[0])
        return start

    def read(self) -> Any:
        """The state the JAX call starts from: ``source.read()``, or under a declaration
        the state the running evaluation has as its latest (``Participant.current``)."""
        state = self.source.read()
        return state if self.policy is None else self.policy.current(state)

    def run(self, index: int, state: Any, fun: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
        """Calls ``fun(*args)`` with ``state`` installed; returns ``(out, state_after)``."""
        policy = self.policy
        if policy is None:
            return self._run(index, state, fun, *args)
        frame = policy.push(received=state, backward=self.backward)
        try:
            out, after = self._run(index, policy.freeze(state), fun, *args)
        finally:
            policy.pop(frame)
        return out, policy.left(after, frame)

    def _run(self, index: int, state: Any, fun: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
        source = self.source
        source.restore_names(self._start(index))
        try:
            out, after = source.run(state, fun, *args)
        except BaseException:
            source.restore_names(self._starts[0])
            raise
        self._ends[index] = source.names()
        source.restore_names(self._starts[0])
        if jax.tree.structure(state) != jax.tree.structure(after):
            raise StructureChangeError.between(
                self.where,
                state,
                after,
                "Create every variable before the loop, or let init create it (the creation "
                "pass runs at init).",
            )
        return out, after

    def finish(self, state: Any, ran: bool | None = True) -> None:
        """Writes the JAX call's final ``state`` and advances the caller's names.

        ``ran=False`` (a loop traced with 0 trips) writes nothing: a variable its body
        would write first (a ``sow``) must not appear. ``ran=None`` (a trip count unknown
        when traced) first hands ``state`` to the source's ``check_unknown_trips``. If
        ``retrace()``, nothing is written and the combinator runs the JAX call again.
        """
        ends = [e for e in self._ends if e is not None]
        names = ends[-1] if ends else None
        if ends and self._alternatives:
            names = self.source.join_names(ends)
        if self.source.retrace():
            raise _RetraceRequestedError
        if ran is None:
            self.source.check_unknown_trips(state)
        if ran is not False:
            if self.policy is not None:
                state = self.policy.written(state, self.backward)
            self.source.write(state)
        if names is not None:
            self.source.restore_names(names)


def init_safe(source: StateSource, creation: Callable[[], Any], call: Callable[[], Any]) -> Any:
    """At init, the creation pass ``creation`` in ``source.create``, then ``call()``.

    Args:
      source: the ``StateSource``.
      creation: runs the functions once, outside JAX transformations.
      call: the threaded JAX call; its result is returned.

    Returns:
      What ``call()`` returns (under ``applying()`` after a creation pass).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxoverride.adapter_kit import DictStateSource, init_safe
      >>> init_safe(DictStateSource({}), lambda: None, lambda: "applied")
      'applied'
    """
    if is_applying() or not require_source(source, "init_safe").initializing():
        return _retrying(call)
    return source.init_call(lambda: _retrying(call), lambda: _two_passes(source, creation, call))


def _two_passes(source: StateSource, creation: Callable[[], Any], call: Callable[[], Any]) -> Any:
    source.create(creation)
    try:
        with applying():
            return _retrying(call)
    except BaseException:
        # A failed call leaves nothing behind, not even what the creation pass made.
        source.undo_creation()
        raise


def _retrying(call: Callable[[], Any]) -> Any:
    for _ in range(_RETRACES):
        try:
            return call()
        except _RetraceRequestedError:
            continue
    raise RuntimeError(
        f"jaxoverride: the state a traced function writes kept growing over {_RETRACES} "
        "traces; make the variables it writes the same on every call."
    )


def _scan_length(xs: Any, length: Any) -> int | None:
    """A scan's trip count as it is traced (None where JAX will refuse the call)."""
    if length is not None:
        return int(length)
    leaves = jax.tree.leaves(xs)
    return int(jnp.shape(leaves[0])[0]) if leaves and jnp.ndim(leaves[0]) else None


def _may_run(lower_bound: Any, upper_bound: Any) -> bool | None:
    """Whether a ``fori_loop`` runs, as its bounds tell when traced (None: traced). A
    traced bound is not compared: that would stage an equation into the caller's jaxpr."""
    if isinstance(lower_bound, Tracer) or isinstance(upper_bound, Tracer):
        return None
    return bool(upper_bound > lower_bound)


def threaded_scan(
    source: StateSource,
    below: Callable[..., Any],
    f: Callable[..., Any],
    init: Any,
    xs: Any = None,
    length: Any = None,
    reverse: bool = False,
    unroll: Any = 1,
    _split_transpose: bool = False,
) -> Any:
    """``lax.scan`` with ``source``'s state in the carry, init-exact.

    Args:
      source: the ``StateSource``.
      below: the scan to run (``jax.lax.scan`` or ``jaxoverride.next_impl("lax.scan")``).
      f, init, xs, length, reverse, unroll, _split_transpose: as for ``jax.lax.scan``.

    Returns:
      ``(carry, ys)``, as ``below`` returns them.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxoverride.adapter_kit import DictStateSource, threaded_scan
      >>> store = {"total": jnp.float32(0)}
      >>> def body(c, x):
      ...     store["total"] = store["total"] + x
      ...     return c, x * 2
      >>> _, ys = threaded_scan(DictStateSource(store), jax.lax.scan, body, 0, jnp.arange(3.0))
      >>> ys.tolist(), float(store["total"])
      ([0.0, 2.0, 4.0], 3.0)
    """

    def runs(thread: Threaded) -> list[tuple[int, Any]]:
        def body(fns: Any, carry: Any, x: Any) -> Any:
            value, state = carry
            (value, y), state = thread.run(0, state, fns[0], value, x)
            return (value, state), y

        return [(0, body)]

    def call() -> Any:
        with handed_call(source, "jaxoverride.lax.scan", (f,), 1, runs, Threaded) as handed:
            (value, state), ys = below(
                handed.functions[0],
                (init, handed.thread.read()),
                xs,
                length,
                reverse,
                unroll,
                _split_transpose,
            )
            handed.thread.finish(state, ran=_scan_length(xs, length) != 0)
        return value, ys

    def creation() -> Any:
        replay = lambda: jax.lax.scan(lambda c, _: (c, None), init, xs, length, reverse)
        return f(as_jax_operands(init), first_slice(xs, reverse, replay=replay))

    return init_safe(source, creation, call)


def threaded_while_loop(
    source: StateSource,
    below: Callable[..., Any],
    cond_fun: Callable[..., Any],
    body_fun: Callable[..., Any],
    init_val: Any,
) -> Any:
    """``lax.while_loop`` with ``source``'s state in the carry, init-exact.

    ``cond_fun`` sees the state; if it changes it (a variable, an rng draw), the loop
    evaluates it at the end of each body instead, carrying the predicate (always, for a
    source with ``carried_predicate``). The creation pass calls ``cond_fun`` and
    ``body_fun`` once, so a zero-trip loop still creates its parameters.

    Args:
      source: the ``StateSource``.
      below: the while loop to run.
      cond_fun, body_fun, init_val: as for ``jax.lax.while_loop``.

    Returns:
      The loop value for which ``cond_fun`` first returned false.

    Example:
      A ``cond_fun`` that writes the state, tested before each step as in Python:

      >>> import jax, jax.numpy as jnp
      >>> from jaxoverride.adapter_kit import DictStateSource, threaded_while_loop
      >>> store = {"tests": jnp.int32(0)}
      >>> def below_ten(x):
      ...     store["tests"] += 1
      ...     return x < 10
      >>> loop = jax.lax.while_loop
      >>> out = threaded_while_loop(DictStateSource(store), loop, below_ten, lambda x: x * 2, 1)
      >>> int(out), int(store["tests"])
      (16, 5)
    """

    where = "jaxoverride.lax.while_loop"
    functions = (cond_fun, body_fun)
    abort = require_source(source, where).abort_changed_predicate
    cond_changed_state: list[bool] = []

    def read_only_runs(thread: Threaded) -> list[tuple[int, Any]]:
        def cond(fns: Any, carry: Any) -> Any:
            value, state = carry
            pred, after = thread.run(0, state, fns[0], value)
            pairs = zip(jax.tree.leaves(after), jax.tree.leaves(state), strict=True)
            if any(a is not b for a, b in pairs):
                if abort:
                    raise _PredicateChangedStateError
                # Finish this trace (aborting one that closes over outer tracers leaks
                # it), then run the loop again with the predicate inside the body.
                # A false predicate: this discarded loop must not run (eagerly, it would
                # never end, since cond_fun's writes are undone after each trace).
                cond_changed_state.append(True)
                return jnp.zeros(jnp.shape(pred), bool)
            return pred

        def body(fns: Any, carry: Any) -> Any:
            value, state = carry
            return thread.run(1, state, fns[1], value)

        return [(0, cond), (1, body)]

    def carried_runs(thread: Threaded) -> list[tuple[int, Any]]:
        def test(fns: Any, state: Any, value: Any) -> Any:
            return thread.run(0, state, fns[0], value)

        def body(fns: Any, carry: Any) -> Any:
            value, state, _ = carry
            value, state = thread.run(1, state, fns[1], value)
            pred, state = thread.run(2, state, fns[0], value)
            return value, state, pred

        return [(0, test), (1, body)]

    def carried_call(first: Any = None) -> Any:
        # JAX's cond_fun cannot return state, so the predicate is evaluated at the end of
        # each body instead, and carried: cond, body, cond, body, ... as Python would. The
        # first test is ``first`` where the caller already ran it.
        with handed_call(source, where, functions, 3, carried_runs, Threaded) as handed:
            test, body = handed.functions
            state = handed.thread.read()
            if first is None:
                first, state = _first_test(handed.traces, test, state, init_val)
            value, state, _ = below(_carried_predicate, body, (init_val, state, first))
            handed.thread.finish(state, ran=None)
        return value

    def call() -> Any:
        cond_changed_state.clear()
        with handed_call(source, where, functions, 2, read_only_runs, Threaded) as handed:
            if handed.variant is None:
                try:
                    value, state = below(*handed.functions, (init_val, handed.thread.read()))
                except _PredicateChangedStateError as abort:
                    abort.release()
                    handed.variant = "stateful"  # reused: the next call goes straight there
                else:
                    if not cond_changed_state:
                        handed.thread.finish(state, ran=None)
                        return value
        return carried_call(cond_fun(init_val))

    def creation() -> Any:
        value = as_jax_operands(init_val)
        return cond_fun(value), body_fun(value)

    return init_safe(source, creation, carried_call if source.carried_predicate else call)


_FIRST_TESTS = 16  # first-test traces kept per reused wrapper, before they are dropped


def _first_test(traces: dict[Any, Any], test: Callable[..., Any], *operands: Any) -> Any:
    """``test(*operands)``: traced inline under a trace; eagerly, its jaxpr evaluated, as
    JAX would trace ``cond_fun`` (no Python on an identical call, no compilation of its own)."""
    leaves, tree = jax.tree.flatten(operands)
    if any(isinstance(leaf, Tracer) for leaf in leaves):
        return test(*operands)
    try:
        key = (tree, tuple(map(jax.typeof, leaves)))
    except TypeError:  # a leaf JAX cannot type: JAX will say so in the loop itself
        return test(*operands)
    traced = traces.get(key)
    if traced is None:
        closed, shapes = jax.make_jaxpr(test, return_shape=True)(*operands)
        if len(traces) >= _FIRST_TESTS:
            traces.clear()
        traced = traces[key] = (closed, jax.tree.structure(shapes))
    closed, out_tree = traced
    return jax.tree.unflatten(out_tree, eval_jaxpr(closed.jaxpr, closed.consts, *leaves))


class _PredicateChangedStateError(TraceAbort):
    """Raised while JAX traces a ``cond_fun`` that changed the state (see
    ``abort_changed_predicate``)."""


def _carried_predicate(carry: Any) -> Any:
    return carry[2]


def threaded_fori_loop(
    source: StateSource,
    below: Callable[..., Any],
    lower_bound: Any,
    upper_bound: Any,
    body_fun: Callable[..., Any],
    init_val: Any,
    *,
    unroll: Any = None,
) -> Any:
    """``lax.fori_loop`` with ``source``'s state in the carry, init-exact.

    Args:
      source: the ``StateSource``.
      below: the fori loop to run.
      lower_bound, upper_bound, body_fun, init_val, unroll: as for ``jax.lax.fori_loop``.

    Returns:
      The loop value after ``body_fun`` ran for every ``i`` in
      ``[lower_bound, upper_bound)``.

    Example:
      >>> import jax
      >>> from jaxoverride.adapter_kit import DictStateSource, threaded_fori_loop
      >>> add_index = lambda i, x: x + i
      >>> int(threaded_fori_loop(DictStateSource({}), jax.lax.fori_loop, 0, 4, add_index, 0))
      6
    """

    def runs(thread: Threaded) -> list[tuple[int, Any]]:
        def body(fns: Any, i: Any, carry: Any) -> Any:
            value, state = carry
            return thread.run(0, state, fns[0], i, value)

        return [(0, body)]

    def call() -> Any:
        where = "jaxoverride.lax.fori_loop"
        with handed_call(source, where, (body_fun,), 1, runs, Threaded) as handed:
            value, state = below(
                lower_bound,
                upper_bound,
                handed.functions[0],
                (init_val, handed.thread.read()),
                unroll=unroll,
            )
            handed.thread.finish(state, ran=_may_run(lower_bound, upper_bound))
        return value

    creation = lambda: body_fun(as_jax_operands(lower_bound), as_jax_operands(init_val))
    return init_safe(source, creation, call)


def _threaded_branches(
    source: StateSource,
    where: str,
    branches: Sequence[Callable[..., Any]],
    operands: tuple[Any, ...],
    operand: Any,
    call: Callable[[list[Callable[..., Any]], Any], Any],
) -> Any:
    if operand is not _NO_OPERAND:
        if operands:  # JAX's own refusal, before any branch runs
            raise TypeError(
                "if 'operand' keyword is passed then no positional operands can be "
                f"passed, got {operand=} and positional operands {operands}"
            )
        operands = (operand,)

    # One wrapper per distinct branch object: JAX traces a repeated branch once.
    distinct = distinct_functions(branches)

    def runs(thread: Threaded) -> list[tuple[int, Any]]:
        def wrap(index: int) -> Any:
            def branch(fns: Any, packed: Any) -> Any:
                state, args = packed
                return thread.run(index, state, fns[index], *args)

            return branch

        return [(index, wrap(index)) for index in range(len(distinct))]

    alternatives = require_source(source, where).alternative_branches
    make_thread = functools.partial(Threaded, alternatives=alternatives)

    def run() -> Any:
        count = len(distinct)
        with handed_call(source, where, distinct, count, runs, make_thread, separately=True) as h:
            by_id = dict(zip(map(id, distinct), h.functions, strict=True))
            out, state = call([by_id[id(fun)] for fun in branches], (h.thread.read(), operands))
            h.thread.finish(state)
        return out

    def creation() -> Any:
        arguments = as_jax_operands(operands)
        start = source.names() if alternatives else None
        outs = []
        for branch in distinct:
            if alternatives:
                source.restore_names(start)  # each arm from the caller's names
            outs.append(branch(*arguments))
        return outs

    return init_safe(source, creation, run)


def threaded_cond(
    source: StateSource,
    below: Callable[..., Any],
    pred: Any,
    true_fun: Callable[..., Any],
    false_fun: Callable[..., Any],
    *operands: Any,
    operand: Any = _NO_OPERAND,
) -> Any:
    """``lax.cond`` with ``source``'s state passed through the taken branch, init-exact.

    At init both branches create their parameters (the creation pass runs both).

    Args:
      source: the ``StateSource``.
      below: the cond to run.
      pred, true_fun, false_fun, operands, operand: as for ``jax.lax.cond``.

    Returns:
      The output of ``true_fun`` if ``pred`` holds, else of ``false_fun``.

    Example:
      Only the taken branch's write reaches the state:

      >>> import jax, jax.numpy as jnp
      >>> from jaxoverride.adapter_kit import DictStateSource, threaded_cond
      >>> store = {"branch": jnp.int32(0)}
      >>> def taken(x):
      ...     store["branch"] = jnp.int32(1)
      ...     return x
      >>> def other(x):
      ...     store["branch"] = jnp.int32(2)
      ...     return -x
      >>> out = threaded_cond(DictStateSource(store), jax.lax.cond, True, taken, other, 2.0)
      >>> float(out), int(store["branch"])
      (2.0, 1)
    """
    call = lambda fns, packed: below(pred, fns[0], fns[1], packed)
    where = "jaxoverride.lax.cond"
    return _threaded_branches(source, where, (true_fun, false_fun), operands, operand, call)


def threaded_switch(
    source: StateSource,
    below: Callable[..., Any],
    index: Any,
    branches: Sequence[Callable[..., Any]],
    *operands: Any,
    operand: Any = _NO_OPERAND,
) -> Any:
    """``lax.switch`` with ``source``'s state passed through the taken branch, init-exact.

    Args:
      source: the ``StateSource``.
      below: the switch to run.
      index, branches, operands, operand: as for ``jax.lax.switch``.

    Returns:
      The output of ``branches[index]``, ``index`` clamped into range as JAX clamps it.

    Example:
      >>> import jax
      >>> from jaxoverride.adapter_kit import DictStateSource, threaded_switch
      >>> branches = [lambda x: x, lambda x: x + 1, lambda x: x + 2]
      >>> int(threaded_switch(DictStateSource({}), jax.lax.switch, 2, branches, 10))
      12
    """
    call = lambda fns, packed: below(index, fns, packed)
    where = "jaxoverride.lax.switch"
    return _threaded_branches(source, where, tuple(branches), operands, operand, call)


def threaded_map(
    scan: Callable[..., Any],
    vmap: Callable[..., Any],
    f: Callable[..., Any],
    xs: Any,
    *,
    batch_size: int | None = None,
) -> Any:
    """``lax.map`` written, as JAX writes it, in terms of a (threaded) ``scan`` and ``vmap``.

    JAX's map has no carry, so this map is a scan: each element sees the state the
    previous one left; with ``batch_size``, a scan of ``vmap``s over JAX's own split
    (``batched_map``). The scan body is one function per ``f`` (held weakly), so that an
    identical eager call through a source that reuses its wrappers compiles once.

    Args:
      scan: the scan to use (the neutral ``jaxoverride.lax.scan``, so that it threads).
      vmap: the vmap to use for batches.
      f, xs, batch_size: as for ``jax.lax.map``.

    Returns:
      The stacked outputs.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxoverride.adapter_kit import threaded_map
      >>> threaded_map(jax.lax.scan, jax.vmap, lambda x: x * 2, jnp.arange(5.0),
      ...              batch_size=2).tolist()
      [0.0, 2.0, 4.0, 6.0, 8.0]
    """
    if batch_size is None:
        return scan(_map_step(f, None), (), xs)[1]
    blocks = lambda xs: scan(_map_step(f, vmap), (), xs)[1]
    return batched_map(blocks, vmap(f), xs, batch_size)


# The scan bodies of ``threaded_map``, per mapped function (weakly) and ``vmap``.
_MAP_STEPS: WrapperCache[Callable[..., Any]] = WrapperCache()


def _map_step(f: Callable[..., Any], vmap: Callable[..., Any] | None) -> Callable[..., Any]:
    def make(getters: Sequence[Callable[[], Any]]) -> Callable[..., Any]:
        get = getters[0]

        def step(_: Any, x: Any) -> Any:
            return (), (get() if vmap is None else vmap(get()))(x)

        return step

    return _MAP_STEPS.get((f,), ("map", vmap), make)


def threaded_call(
    source: StateSource, fun: Callable[..., Any], where: str
) -> tuple[Callable[..., Any], Callable[[Any], None], Any]:
    """Makes ``fun`` pure for a JAX transform: state goes in and comes out explicitly.

    Args:
      source: the ``StateSource``.
      fun: the function the transform receives.
      where: the neutral name, for error messages.

    Returns:
      ``(pure, finish, state)``: ``pure(state, *args, **kwargs)`` returns
      ``(out, state_after)``; call the transform on ``pure`` with ``state`` (unmapped,
      not differentiated), then ``finish(state_after)`` with the state it returned.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxoverride.adapter_kit import DictStateSource, threaded_call
      >>> store = {"seen": jnp.float32(0)}
      >>> def f(x):
      ...     store["seen"] = x
      ...     return x * 2
      >>> pure, finish, state = threaded_call(DictStateSource(store), f, "jit")
      >>> out, after = jax.jit(pure)(state, 3.0)
      >>> finish(after)
      >>> float(out), float(store["seen"])
      (6.0, 3.0)
    """
    thread = Threaded(source, 1, where)

    @wraps(fun)
    def pure(state: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        return thread.run(0, state, lambda: fun(*args, **kwargs))

    return pure, thread.finish, thread.read()
