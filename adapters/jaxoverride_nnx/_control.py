"""Overrides of the neutral control flow: the tracked Variables become loop carries.

Every lifted Variable's value is carried (or passed to each branch) next to the user's
carry, so a counter, BatchNorm statistics or an RNG stream advances once per step as in
a Python loop; only the Variables some traced function wrote are stored back. Array
attributes of modules ride along, read only.

The calls are the kit's threaded combinators over ``_Source``, given only the tracked
values of the modules the call touches (``_touched``). The user's functions reach the kit
as they are, so its wrappers are reused and JAX's trace cache works as for raw
``jax.lax.scan``; what their traces found (``_Seen``) is kept next to them
(``kit.kept``). Given no tracked value, ``while_loop`` and ``map`` are JAX's own.
A stateful ``while_loop`` carries its predicate (``carried_predicate``), so a
``cond_fun`` that updates state does so as often as in ``while cond(x): x = body(x)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

import jax

import jaxoverride as jo
from jaxoverride import adapter_kit as kit
from jaxoverride.adapter_kit import (
    NO_OPERAND as _NO_OPERAND,
    branch_error,
    check_loop_carry,
    check_scan_output,
    jax_arguments,
    join_batches,
    output_shapes,
    scan_arguments,
    split_batches,
)
from jaxoverride_nnx._lift import (
    call_plain,
    check_same_refs,
    from_refs,
    refuse_modules,
    run_lifted,
    to_refs,
    with_arguments,
    write_back,
)
from jaxoverride_nnx._solve import FRAMEWORK, discarded, parts_of, policy_for
from jaxoverride_nnx._touched import Threads, given_values
from jaxoverride_nnx._tracked import Tracked, current
from jaxoverride_nnx._transforms import run_closure, run_mapped

T = TypeVar("T")

# Tracked values by index: those given to a call, or a trace's values of them.
_Values = dict[int, Any]


@dataclasses.dataclass(eq=False, slots=True)
class _Seen:
    """What the traces of one call's functions found: the tracked values they touch and
    the Variables they wrote; kept as long as the kit's wrappers of the functions."""

    threads: Threads = dataclasses.field(default_factory=Threads)
    written: set[int] = dataclasses.field(default_factory=set)


def _seen(functions: Sequence[Any], kind: str, tracked: Tracked) -> _Seen:
    return kit.kept(functions, (kind, tracked.key), _Seen)


# ``step(source, fun, values, constants, *args) -> (out, values after)``: one traced run
# of the user's ``fun`` for a kind of call.
Step = Callable[..., tuple[Any, _Values]]

# ``initial`` of a call that is not a loop.
_NO_CARRY: Any = object()


class _Source(kit.ScopedStateSource):
    """The kit's state source for one control-flow call: the tracked values given, run
    through the step of each function (``steps``: by its id, with its ``_Seen``)."""

    carried_predicate = True
    # jaxoverride.solve_state: the kit's Threaded applies a declaration to these calls.
    framework: ClassVar[str | None] = FRAMEWORK
    __slots__ = (
        "constants", "initial", "kind", "outputs", "owner", "state", "steps", "tracked", "where",
    )  # fmt: skip

    def __init__(
        self,
        tracked: Tracked,
        kind: str,
        where: str,
        steps: dict[int, tuple[Step, _Seen]],
        given: tuple[_Values, _Values, object],
        initial: Any = _NO_CARRY,
        outputs: dict[int, Any] | None = None,
    ):
        self.tracked, self.kind, self.where, self.steps = tracked, kind, where, steps
        self.state, self.constants, self.owner = given
        self.initial = initial  # the loop's carry as the user passed it, for JAX's messages
        self.outputs = outputs  # a branch's output shapes by its id, for branch_error

    def reuse_key(self) -> Any:
        # The layout of the state and what ``_Seen`` records depend on these.
        return type(self), self.kind, self.tracked.key

    def read(self) -> Any:
        return self.state, self.constants

    def run(self, state: Any, fun: Any, *args: Any) -> tuple[Any, Any]:
        values, constants = state
        out, after = self.step(fun, values, constants, *args)
        return out, (after, constants)

    def step(self, fun: Any, values: _Values, constants: _Values, *args: Any) -> Any:
        return self.steps[id(fun)][0](self, fun, values, constants, *args)

    def lifted(
        self, fun: Any, values: _Values, constants: _Values, fn: Callable[..., Any], args: Any
    ) -> tuple[Any, _Values]:
        """Inside the trace: ``fn(*args)`` (``fun``'s run) with the Variables holding
        ``values`` (the others hold probes of the running call, see ``_touched``)."""
        out, after = run_lifted(
            self.tracked, {**values, **constants}, fn, args, {}, self.where, owner=self.owner
        )
        written = self.steps[id(fun)][1].written
        written.update(index for index, value in values.items() if after[index] is not value)
        return out, {index: after[index] for index in values}

    def initial_or(self, traced: Any) -> Any:
        initial = self.initial
        if initial is _NO_CARRY or jax.tree.structure(initial) != jax.tree.structure(traced):
            return traced
        return initial

    def write(self, state: Any) -> None:
        self.store(state[0])

    def store(self, final: _Values) -> None:
        written = set().union(*(seen.written for _, seen in self.steps.values()))
        write_back(
            self.tracked, {i: value for i, value in final.items() if i in written}, self.where
        )

    def parts(self, state: Any) -> list[Any]:
        values, constants = state
        return parts_of(self.tracked, values) + [None] * len(jax.tree.leaves(constants))


class _ReadOnlySource(_Source):
    """``_Source`` of a ``while_loop`` given no tracked value: JAX's own structure, no
    declaration applied by the kit (``_threaded`` pushes its frame)."""

    carried_predicate = False
    framework: ClassVar[str | None] = None
    __slots__ = ()


def _threaded(
    tracked: Tracked,
    functions: Sequence[Any],
    seen: Sequence[_Seen],
    call: Callable[[frozenset[int], tuple[_Values, _Values, object]], T],
    operands: Any = (),
    read_only: bool = False,
) -> T:
    """``call(indices, (state, constants, owner))`` given the tracked values that
    ``functions`` touch, traced again with the module of each probe it used; the first
    ``_Seen`` keeps what was found (a ``cond``'s branches share one carry). ``read_only``:
    given nothing, the call is JAX's own, and under ``jaxoverride.solve_state`` what an
    inner boundary keeps stays in a frame of this call."""
    reach = [*functions, operands]
    policy = policy_for(tracked)

    def attempt(given: frozenset[int], owner: object) -> T:
        for record in seen:
            record.threads.found[tracked.key] = given
        values = given_values(tracked, given, reach)  # Variables, then array attributes
        count = len(tracked.variables)
        state = {i: v for i, v in values.items() if i < count}
        constants = {i: v for i, v in values.items() if i >= count}
        with discarded(None if given or not read_only else policy):
            return call(given, (state, constants, owner))

    given = frozenset().union(*(record.threads.get(tracked, reach) for record in seen))
    seen[0].threads.found[tracked.key] = given
    return seen[0].threads.run(tracked, attempt)


def _no_modules_in(xs: Any, where: str) -> None:
    fix = (
        "Looping over slices of a module's state is nnx.scan's job; here a module is "
        "either closed over (and tracked) or carried in the carry."
    )
    refuse_modules(xs, where, "in xs", fix)


def _pair(out: Any, where: str) -> tuple[Any, Any]:
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise TypeError(
            f"{where} body function must return a pair (carry, y), got {type(out).__name__}."
        )
    return out[0], out[1]


# -- scan -----------------------------------------------------------------------------

_SCAN = "jaxoverride.lax.scan"


def _scan_step(source: _Source, f: Any, values: _Values, constants: _Values, carry: Any, x: Any):
    tracked = source.tracked
    out, after = source.lifted(f, values, constants, f, (from_refs(carry, tracked), x))
    out = to_refs(out, tracked)[0]
    if isinstance(out, (tuple, list)) and len(out) == 2:
        check_same_refs(carry, out[0], "carry", _SCAN)
    check_scan_output(f, source.initial_or(carry), out)
    return _pair(out, _SCAN), after


def scan(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """The ``"lax.scan"`` override: ``jax.lax.scan``'s arguments (``scan_arguments``)."""
    f, init, xs, length, reverse, unroll, _split_transpose = scan_arguments(*args, **kwargs)
    below = jo.next_impl("lax.scan")
    _no_modules_in(xs, _SCAN)
    tracked = with_arguments(current(), init)
    if tracked is None or not callable(f):  # not callable: JAX's own error
        return call_plain(
            below, (f, init, xs, length, reverse, unroll, _split_transpose), {}, _SCAN
        )
    seen = _seen((f,), "scan", tracked)
    steps = {id(f): (_scan_step, seen)}
    start = to_refs(init, tracked)[0]
    options = (length, reverse, unroll, _split_transpose)

    def call(_: frozenset[int], given: Any) -> Any:
        source = _Source(tracked, "scan", _SCAN, steps, given, init)
        return kit.threaded_scan(source, below, f, start, xs, *options)

    final, ys = _threaded(tracked, [f], [seen], call, init)
    return from_refs(final, tracked), from_refs(ys, tracked)


def _loop_step(where: str, cond_fun: Any) -> Step:
    """The step of a loop body ``fun(*leading, carry) -> carry`` (while, fori)."""

    def step(source: _Source, fun: Any, values: _Values, constants: _Values, *args: Any):
        *leading, value = args
        tracked = source.tracked
        new, after = source.lifted(
            fun, values, constants, fun, (*leading, from_refs(value, tracked))
        )
        new = to_refs(new, tracked)[0]
        check_same_refs(value, new, "carry", where)
        check_loop_carry(fun, source.initial_or(value), new, cond_fun)
        return new, after

    return step


# -- while_loop -----------------------------------------------------------------------

_WHILE = "jaxoverride.lax.while_loop"


def _while_test(source: _Source, cond_fun: Any, values: _Values, constants: _Values, value: Any):
    value = from_refs(value, source.tracked)
    return source.lifted(cond_fun, values, constants, cond_fun, (value,))


def while_loop(
    cond_fun: Callable[[Any], Any], body_fun: Callable[[Any], Any], init_val: Any
) -> Any:
    """The ``"lax.while_loop"`` override: JAX's own loop while nothing tracked is touched,
    else the kit's, its predicate carried (``_Source.carried_predicate``)."""
    below = jo.next_impl("lax.while_loop")
    tracked = with_arguments(current(), init_val)
    if tracked is None or not (callable(cond_fun) and callable(body_fun)):
        return call_plain(below, (cond_fun, body_fun, init_val), {}, _WHILE)
    seen = _seen((cond_fun, body_fun), "while", tracked)

    body_step = _loop_step(_WHILE, cond_fun)
    steps = {id(cond_fun): (_while_test, seen), id(body_fun): (body_step, seen)}
    init = to_refs(init_val, tracked)[0]

    def call(given: frozenset[int], values: Any) -> Any:
        source = (_Source if given else _ReadOnlySource)(
            tracked, "while", _WHILE, steps, values, init_val
        )
        return kit.threaded_while_loop(source, below, cond_fun, body_fun, init)

    final = _threaded(tracked, [cond_fun, body_fun], [seen], call, init_val, read_only=True)
    return from_refs(final, tracked)


# -- fori_loop ------------------------------------------------------------------------

_FORI = "jaxoverride.lax.fori_loop"


_fori_step = _loop_step(_FORI, None)


def fori_loop(*args: Any, **kwargs: Any) -> Any:
    """The ``"lax.fori_loop"`` override: ``jax.lax.fori_loop``'s arguments
    (``jax_arguments``)."""
    lower, upper, body_fun, init_val, unroll = jax_arguments("lax.fori_loop", *args, **kwargs)
    below = jo.next_impl("lax.fori_loop")
    tracked = with_arguments(current(), init_val)
    if tracked is None or not callable(body_fun):
        return call_plain(below, (lower, upper, body_fun, init_val), {"unroll": unroll}, _FORI)
    seen = _seen((body_fun,), "fori", tracked)
    steps = {id(body_fun): (_fori_step, seen)}
    start = to_refs(init_val, tracked)[0]

    def call(_: frozenset[int], given: Any) -> Any:
        source = _Source(tracked, "fori", _FORI, steps, given, init_val)
        return kit.threaded_fori_loop(source, below, lower, upper, body_fun, start, unroll=unroll)

    final = _threaded(tracked, [body_fun], [seen], call, init_val)
    return from_refs(final, tracked)


# -- cond and switch ------------------------------------------------------------------


class _BranchSource(_Source):
    """``_Source`` for ``cond`` and ``switch``: the array attributes, read only, are not
    returned by the branches; they are their first operand (after the state)."""

    __slots__ = ()

    def read(self) -> Any:
        return self.state

    def run(self, state: Any, fun: Any, *args: Any) -> tuple[Any, Any]:
        constants, *operands = args
        return self.step(fun, state, constants, *operands)

    def write(self, state: Any) -> None:
        self.store(state)

    def parts(self, state: Any) -> list[Any]:
        return parts_of(self.tracked, state)


def _branch(source: _Source, fn: Any, values: _Values, constants: _Values, *operands: Any):
    tracked = source.tracked
    out, after = source.lifted(fn, values, constants, fn, tuple(from_refs(operands, tracked)))
    out = to_refs(out, tracked)[0]
    assert source.outputs is not None
    source.outputs[id(fn)] = output_shapes(out)
    return out, after


def _all_callable(branches: Any) -> bool:
    try:
        return len(branches) > 0 and all(map(callable, branches))
    except TypeError:  # not a sequence
        return False


def _branching(
    kind: str, arguments: Any, kwargs: Any, selector: Any, branches: Any, operands: Any, one: Any
) -> Any:
    """``cond`` or ``switch`` (``kind``) given ``jax_arguments``' reading of JAX's
    ``arguments``: the tracked state passes through the taken branch."""
    below = jo.next_impl(f"lax.{kind}")
    where = f"jaxoverride.lax.{kind}"
    switch = kind == "switch"
    if one is not _NO_OPERAND:  # ``operand=``, JAX's older keyword
        if operands:  # JAX's own error for passing both
            return below(*arguments, **kwargs)
        operands = (one,)
    tracked = with_arguments(current(), operands)
    if tracked is None or not _all_callable(branches):
        head = (selector, branches) if switch else (selector, *branches)
        return call_plain(below, (*head, *operands), {}, where)
    branches = list(branches)
    # Per branch: the kit reuses each branch's wrapper on its own.
    seen = [_seen((fn,), kind, tracked) for fn in branches]
    steps = {id(fn): (_branch, record) for fn, record in zip(branches, seen, strict=True)}
    refs = to_refs(operands, tracked)[0]
    outputs: dict[int, Any] = {}

    def run(_: frozenset[int], given: Any) -> Any:
        source = _BranchSource(tracked, kind, where, steps, given, outputs=outputs)
        if switch:
            return kit.threaded_switch(source, below, selector, branches, given[1], *refs)
        return kit.threaded_cond(source, below, selector, *branches, given[1], *refs)

    try:
        out = _threaded(tracked, branches, seen, run, operands)
    except TypeError as error:
        shapes = [outputs.get(id(fn)) for fn in branches]
        jax_error = branch_error(error, branches, shapes, switch=switch)
        if jax_error is error:
            raise
        raise jax_error from None
    return from_refs(out, tracked)


def cond(*arguments: Any, **kwargs: Any) -> Any:
    """The ``"lax.cond"`` override: ``jax.lax.cond``'s arguments (``jax_arguments``)."""
    pred, true_fun, false_fun, *rest = jax_arguments("lax.cond", *arguments, **kwargs)
    return _branching("cond", arguments, kwargs, pred, (true_fun, false_fun), *rest)


def switch(*arguments: Any, **kwargs: Any) -> Any:
    """The ``"lax.switch"`` override: ``jax.lax.switch``'s arguments (``jax_arguments``)."""
    index, branches, *rest = jax_arguments("lax.switch", *arguments, **kwargs)
    return _branching("switch", arguments, kwargs, index, branches, *rest)


# -- map ------------------------------------------------------------------------------

_MAP = "jaxoverride.lax.map"


def _map_step(source: _Source, f: Any, values: _Values, constants: _Values, carry: Any, x: Any):
    y, after = source.lifted(f, values, constants, f, (x,))
    return (carry, to_refs(y, source.tracked)[0]), after


def _vmapped(
    tracked: Tracked, f: Callable[[Any], Any], vmap_below: Callable[..., Any], xs: Any, where: str
) -> Any:
    """``vmap(f)(xs)`` with tracked state broadcast; writes the (unbatched) updates."""

    def pure(x: Any) -> Any:
        out, updates = run_closure(tracked, f, (x,), {}, where)
        return to_refs(out, tracked)[0], updates

    return run_mapped(vmap_below(pure, out_axes=(0, None)), tracked, where, (xs,), {})


def lax_map(f: Callable[[Any], Any], xs: Any, *, batch_size: int | None = None) -> Any:
    """The ``"lax.map"`` override: a ``scan`` that threads the state (``vmap`` within a
    batch when ``batch_size`` is given, as ``jax.lax.map`` does); with nothing tracked
    touched, JAX's own ``map``."""
    below = jo.next_impl("lax.map")
    _no_modules_in(xs, _MAP)
    tracked = current()
    if tracked is None or not callable(f):
        return call_plain(below, (f, xs), {"batch_size": batch_size}, _MAP)
    scan_below = jo.next_impl("lax.scan")
    vmap_below = jo.next_impl("vmap")
    kind = "map" if batch_size is None else "map-blocks"
    seen = _seen((f,), kind, tracked)

    def block_step(source: _Source, fun: Any, values: _Values, constants: _Values, *args: Any):
        carry, chunk = args
        batch = lambda c: _vmapped(source.tracked, fun, vmap_below, c, _MAP)
        y, after = source.lifted(fun, values, constants, batch, (chunk,))
        return (carry, y), after

    steps = {id(f): (_map_step if batch_size is None else block_step, seen)}

    def call(given: frozenset[int], values: Any) -> Any:
        source = _Source(tracked, kind, _MAP, steps, values)
        if not given:  # JAX's own map (which traces anew at every call), run with probes

            def each(x: Any) -> Any:
                return to_refs(source.lifted(f, {}, {}, f, (x,))[0], tracked)[0]

            return below(each, xs, batch_size=batch_size)
        if batch_size is None:
            return kit.threaded_scan(source, scan_below, f, (), xs)[1]
        # JAX's own split, so that every batch size (0 included, which JAX versions read
        # differently) gives what jax.lax.map gives.
        blocks, rest = split_batches(xs, batch_size)
        ys = None if blocks is None else kit.threaded_scan(source, scan_below, f, (), blocks)[1]
        rest_ys = None if rest is None else _vmapped(tracked, f, vmap_below, rest, _MAP)
        return join_batches(ys, rest_ys)

    return from_refs(_threaded(tracked, [f], [seen], call, read_only=True), tracked)
