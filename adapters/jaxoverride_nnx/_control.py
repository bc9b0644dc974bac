"""Overrides of the neutral control flow: the tracked Variables become loop carries.

Every lifted Variable's value is carried (or passed to each branch) next to the user's
carry; inside the body the Variables hold the carried values and may be written, so a
counter, BatchNorm statistics or an RNG stream advances once per step exactly as in a
Python loop. After the call only the Variables that the body or a branch actually wrote
(seen when it was traced) are stored back. Array attributes of modules are read-only
and ride along unchanged.

``scan``, ``while_loop``, ``fori_loop``, ``cond``, ``switch`` and the stateful ``map``
are the kit's threaded combinators over ``_Source``, a ``StateSource`` of the tracked
values given to the call (``_touched``: only those of the modules it touches); the
stateless paths (JAX's own structure when nothing is touched) are written here.

The functions handed to JAX are cached per (user function, tracked set) and close over
nothing that changes between calls: here they find the running call in a contextvar, and
in the kit's combinators the kit reuses its wrappers of them (``reuse_key``, inherited
from ``ScopedStateSource``). So JAX's own trace cache works as it does for raw
``jax.lax.scan``, and a loop called eagerly again with the same body is neither traced
nor compiled again.

A stateful ``while_loop`` evaluates ``cond_fun`` once before the loop and then at the end
of each body step (the predicate rides in the carry: the kit's ``carried_predicate``), so
a ``cond_fun`` that updates state does so exactly as often as in
``while cond(x): x = body(x)``.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Hashable, Sequence
from typing import Any, ClassVar, TypeVar

import jax

import jaxoverride as jo
from jaxoverride import adapter_kit as kit
from jaxoverride.adapter_kit import (
    NO_OPERAND as _NO_OPERAND,
    WrapperCache,
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
from jaxoverride_nnx._solve import FRAMEWORK, parts_of, policy_for
from jaxoverride_nnx._touched import NeedsState, Threads, given_values, module_of
from jaxoverride_nnx._tracked import Tracked, current
from jaxoverride_nnx._transforms import run_closure, run_mapped

T = TypeVar("T")

# Tracked values by index: those given to a call, or a trace's values of them.
_Values = dict[int, Any]
# What a traced step runs with: the tracked set, its Variables' and array attributes' values.
_Given = tuple[Tracked, _Values, _Values]

# The tracked set of the control-flow call whose functions JAX is tracing right now.
_RUNNING: contextvars.ContextVar[Tracked] = contextvars.ContextVar("jaxoverride_nnx_running")


class _Lifted:
    """A function handed to JAX in place of the user's: cached, so JAX can cache its trace.

    It holds the user's functions by weak reference (a strong one would keep them, and
    every module they close over, alive through the cache) and passes them to ``body``
    (the kit's step, ``step``) or to ``plain`` (called by JAX's own loop, when nothing
    tracked is touched). ``written`` records which Variables some trace of it wrote; it
    lives as long as the wrapper, because a cached trace is not run again.
    """

    __slots__ = ("__weakref__", "body", "outputs", "plain", "refs", "threads", "written")

    def __init__(
        self,
        body: Callable[..., Any],
        plain: Callable[..., Any] | None,
        refs: tuple[Callable[[], Any], ...],
    ):
        self.body = body
        self.plain = plain
        self.refs = refs
        self.written: set[int] = set()
        self.outputs: Any = None  # a branch's output shapes, for branch_error
        self.threads = Threads()  # which tracked values the function touches

    def __call__(self, *args: Any) -> Any:
        assert self.plain is not None, "a stateful step is handed to JAX by the kit"
        return self.plain(self, [ref() for ref in self.refs], *args)

    def step(self, given: _Given, *args: Any) -> Any:
        """The kit's step (``_Source.run``): ``(out, new state)`` of one trace."""
        return self.body(self, [ref() for ref in self.refs], given, *args)

    def run(
        self,
        tracked: Tracked,
        state: dict[int, Any],
        constants: dict[int, Any],
        fn: Callable[..., Any],
        args: Sequence[Any],
        where: str,
    ) -> tuple[Any, dict[int, Any]]:
        """Inside the trace: run ``fn`` with the Variables holding ``state`` (the values
        given; the others hold probes of the running call, see ``_touched``)."""
        out, after = run_lifted(
            tracked, {**state, **constants}, fn, args, {}, where, owner=_OWNER.get()
        )
        new_state = {index: after[index] for index in state}
        self.written.update(index for index, value in state.items() if after[index] is not value)
        return out, new_state


_wrappers: WrapperCache[_Lifted] = WrapperCache()


def _lifted(
    fns: Sequence[Any], key: Hashable, body: Callable[..., Any], plain: Any = None
) -> _Lifted:
    """The cached wrapper of the user's functions ``fns`` for ``key`` (the kind of call
    and the tracked set): its stateful step ``body``, and its ``plain`` form if any."""
    return _wrappers.get(fns, key, lambda refs: _Lifted(body, plain, refs))


def _start(
    tracked: Tracked, given: frozenset[int], reach: Sequence[Any]
) -> tuple[dict[int, Any], dict[int, Any]]:
    """The given Variables' values to carry and the given array attributes to pass along,
    for a call whose functions and operands are ``reach``."""
    values = given_values(tracked, given, reach)
    count = len(tracked.variables)
    return (
        {i: v for i, v in values.items() if i < count},
        {i: v for i, v in values.items() if i >= count},
    )


def _store(
    tracked: Tracked, wrappers: Sequence[_Lifted], final: dict[int, Any], where: str
) -> None:
    """After the call: write back the Variables that some traced function wrote."""
    written = set().union(*(w.written for w in wrappers))
    write_back(tracked, {i: value for i, value in final.items() if i in written}, where)


# ``initial`` of a call that is not a loop.
_NO_CARRY: Any = object()

# The mark of the probes of the control-flow call whose functions JAX is tracing.
_OWNER: contextvars.ContextVar[object] = contextvars.ContextVar("jaxoverride_nnx_owner")


def _threaded(
    tracked: Tracked,
    wrappers: Sequence[_Lifted],
    call: Callable[..., T],
    operands: Any = (),
    initial: Any = _NO_CARRY,
) -> T:
    """``call(state, constants)`` given the tracked values that ``wrappers`` touch, with
    ``tracked`` running (and ``initial``, a loop's carry as refs, for JAX's messages).

    The first wrapper's ``Threads`` keeps what was found, for the call as a whole (a
    ``while_loop``'s test and body, a ``cond``'s branches share one carry)."""

    def attempt(given: frozenset[int], owner: object) -> T:
        for wrapper in wrappers:
            wrapper.threads.found[tracked.key] = given
        reach = [*(fn for wrapper in wrappers for fn in _users(wrapper)), operands]
        state, constants = _start(tracked, given, reach)
        token = _OWNER.set(owner)
        try:
            return call(state, constants)
        finally:
            _OWNER.reset(token)

    tokens = _enter(tracked, initial)
    try:
        given = frozenset().union(
            *(w.threads.get(tracked, [*_users(w), operands]) for w in wrappers)
        )
        wrappers[0].threads.found[tracked.key] = given
        return wrappers[0].threads.run(tracked, attempt)
    finally:
        _leave(tokens)


def _users(wrapper: _Lifted) -> list[Any]:
    """The user's functions that ``wrapper`` runs (those still alive)."""
    return [fn for ref in wrapper.refs if (fn := ref()) is not None]


_STATEFUL: Any = object()


def _stateless(
    tracked: Tracked,
    wrappers: Sequence[_Lifted],
    call: Callable[[], T],
    then: Sequence[_Lifted],
    initial: Any = _NO_CARRY,
) -> T | Any:
    """``call()`` (JAX's own loop over ``wrappers``) with no tracked value given, unless
    the functions are known to touch one; ``_STATEFUL`` if they do.

    For the calls whose stateful form differs in structure from JAX's (a ``while_loop``'s
    first test, ``lax.map`` as a ``scan``): with nothing to do they are JAX's. What a
    probe showed is handed to the stateful wrappers ``then``.
    """
    if any(w.threads.get(tracked, _users(w)) for w in (*wrappers, *then)):
        return _STATEFUL
    owner = object()
    tokens = _enter(tracked, initial)
    token = _OWNER.set(owner)
    # Under jaxoverride.solve_state, what an inner boundary keeps as its last stays in
    # this call's frame: a tracer of JAX's trace here, never the caller's.
    policy = policy_for(tracked)
    frame = None if policy is None else policy.push()
    try:
        return call()
    except NeedsState as error:
        if error.owner is not owner:
            raise
        error.release()
        touched = module_of(tracked, error.index)
        for wrapper in (*wrappers, *then):
            wrapper.threads.found[tracked.key] = touched
        return _STATEFUL
    finally:
        if frame is not None and policy is not None:
            policy.pop(frame)
        _OWNER.reset(token)
        _leave(tokens)


def _enter(tracked: Tracked, initial: Any) -> tuple[Any, Any]:
    """Makes ``tracked`` the running set (and ``initial`` the loop's initial carry)."""
    return _RUNNING.set(tracked), None if initial is _NO_CARRY else _INITIAL.set(initial)


def _leave(tokens: tuple[Any, Any]) -> None:
    running, initial = tokens
    if initial is not None:
        _INITIAL.reset(initial)
    _RUNNING.reset(running)


# The carry the user's loop started from (modules as references), for the replays of
# ``adapter_kit``'s replays: JAX's messages describe the initial carry as the user passed it.
_INITIAL: contextvars.ContextVar[Any] = contextvars.ContextVar("jaxoverride_nnx_initial")


def _initial_or(traced: Any) -> Any:
    initial = _INITIAL.get(traced)
    return initial if jax.tree.structure(initial) == jax.tree.structure(traced) else traced


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


class _Source(kit.ScopedStateSource):
    """The kit's state source for one control-flow call: the tracked values given.

    ``read()`` is the given Variables' values and array attributes; each traced step
    installs them for its extent (``run``, as ``run_lifted`` does); ``write`` stores
    what some trace of ``wrappers`` wrote (kept on each ``_Lifted``: a cached trace does
    not run again).
    """

    # A while_loop tests once before the loop and at the end of each step, as Python does.
    carried_predicate = True
    # jaxoverride.solve_state: the kit's Threaded applies a declaration to these calls.
    framework: ClassVar[str | None] = FRAMEWORK
    __slots__ = ("constants", "state", "tracked", "where", "wrappers")

    def __init__(
        self, tracked: Tracked, state: _Values, constants: _Values, wrappers: Any, where: str
    ):
        self.tracked, self.state, self.constants = tracked, state, constants
        self.wrappers, self.where = wrappers, where

    def read(self) -> Any:
        return self.state, self.constants

    def run(self, state: Any, fun: Any, *args: Any) -> tuple[Any, Any]:
        values, constants = state
        out, after = fun.step((self.tracked, values, constants), *args)
        return out, (after, constants)

    def write(self, state: Any) -> None:
        _store(self.tracked, self.wrappers, state[0], self.where)

    def parts(self, state: Any) -> list[Any]:
        """For ``jaxoverride.solve_state``: the Variables' parts (``_solve.parts_of``);
        the array attributes are untouched."""
        values, constants = state
        return parts_of(self.tracked, values) + [None] * len(jax.tree.leaves(constants))


def _scan_step(self: _Lifted, fns: list[Any], given: _Given, user_carry: Any, x: Any) -> Any:
    (f,) = fns
    tracked = given[0]
    out, after = self.run(*given, f, (from_refs(user_carry, tracked), x), _SCAN)
    out = to_refs(out, tracked)[0]
    if isinstance(out, (tuple, list)) and len(out) == 2:
        check_same_refs(user_carry, out[0], "carry", _SCAN)
    check_scan_output(f, _initial_or(user_carry), out)
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
    body = _lifted((f,), ("scan", tracked.key), _scan_step)
    start = to_refs(init, tracked)[0]
    options = (length, reverse, unroll, _split_transpose)
    final, ys = _threaded(
        tracked,
        [body],
        lambda state, constants: kit.threaded_scan(
            _Source(tracked, state, constants, [body], _SCAN), below, body, start, xs, *options
        ),
        init,
        start,
    )
    return from_refs(final, tracked), from_refs(ys, tracked)


# -- while_loop -----------------------------------------------------------------------

_WHILE = "jaxoverride.lax.while_loop"


def _while_step(self: _Lifted, fns: list[Any], given: _Given, value: Any) -> Any:
    body_fun, cond_fun = fns
    tracked = given[0]
    new_value, after = self.run(*given, body_fun, (from_refs(value, tracked),), _WHILE)
    new_value = to_refs(new_value, tracked)[0]
    check_same_refs(value, new_value, "carry", _WHILE)
    check_loop_carry(body_fun, _initial_or(value), new_value, cond_fun)
    return new_value, after


def _while_test(self: _Lifted, fns: list[Any], given: _Given, value: Any) -> Any:
    (cond_fun,) = fns
    return self.run(*given, cond_fun, (from_refs(value, given[0]),), _WHILE)


def _plain_test(self: _Lifted, fns: list[Any], value: Any) -> Any:
    (cond_fun,) = fns
    tracked = _RUNNING.get()
    return self.run(tracked, {}, {}, cond_fun, (from_refs(value, tracked),), _WHILE)[0]


def _plain_step(self: _Lifted, fns: list[Any], value: Any) -> Any:
    body_fun, cond_fun = fns
    tracked = _RUNNING.get()
    new_value, _ = self.run(tracked, {}, {}, body_fun, (from_refs(value, tracked),), _WHILE)
    new_value = to_refs(new_value, tracked)[0]
    check_same_refs(value, new_value, "carry", _WHILE)
    check_loop_carry(body_fun, _initial_or(value), new_value, cond_fun)
    return new_value


def while_loop(
    cond_fun: Callable[[Any], Any], body_fun: Callable[[Any], Any], init_val: Any
) -> Any:
    """The ``"lax.while_loop"`` override: JAX's own loop while nothing tracked is touched,
    else the kit's, its predicate carried (``_Source.carried_predicate``)."""
    below = jo.next_impl("lax.while_loop")
    tracked = with_arguments(current(), init_val)
    if tracked is None or not (callable(cond_fun) and callable(body_fun)):
        return call_plain(below, (cond_fun, body_fun, init_val), {}, _WHILE)
    test = _lifted((cond_fun,), ("while-test", tracked.key), _while_test, _plain_test)
    body = _lifted((body_fun, cond_fun), ("while", tracked.key), _while_step, _plain_step)
    init = to_refs(init_val, tracked)[0]
    final = _stateless(tracked, [test, body], lambda: below(test, body, init), [], initial=init)
    if final is _STATEFUL:
        final = _threaded(
            tracked,
            [body, test],
            lambda state, constants: kit.threaded_while_loop(
                _Source(tracked, state, constants, [test, body], _WHILE), below, test, body, init
            ),
            init_val,
            init,
        )
    return from_refs(final, tracked)


# -- fori_loop ------------------------------------------------------------------------

_FORI = "jaxoverride.lax.fori_loop"


def _fori_step(self: _Lifted, fns: list[Any], given: _Given, i: Any, value: Any) -> Any:
    (body_fun,) = fns
    tracked = given[0]
    new_value, after = self.run(*given, body_fun, (i, from_refs(value, tracked)), _FORI)
    new_value = to_refs(new_value, tracked)[0]
    check_same_refs(value, new_value, "carry", _FORI)
    check_loop_carry(body_fun, _initial_or(value), new_value, None)
    return new_value, after


def fori_loop(*args: Any, **kwargs: Any) -> Any:
    """The ``"lax.fori_loop"`` override: ``jax.lax.fori_loop``'s arguments
    (``jax_arguments``)."""
    lower, upper, body_fun, init_val, unroll = jax_arguments("lax.fori_loop", *args, **kwargs)
    below = jo.next_impl("lax.fori_loop")
    tracked = with_arguments(current(), init_val)
    if tracked is None or not callable(body_fun):
        return call_plain(below, (lower, upper, body_fun, init_val), {"unroll": unroll}, _FORI)
    body = _lifted((body_fun,), ("fori", tracked.key), _fori_step)
    start = to_refs(init_val, tracked)[0]
    final = _threaded(
        tracked,
        [body],
        lambda state, constants: kit.threaded_fori_loop(
            _Source(tracked, state, constants, [body], _FORI),
            below,
            lower,
            upper,
            body,
            start,
            unroll=unroll,
        ),
        init_val,
        start,
    )
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
        return fun.step((self.tracked, state, constants), *operands)

    def write(self, state: Any) -> None:
        _store(self.tracked, self.wrappers, state, self.where)

    def parts(self, state: Any) -> list[Any]:
        """For ``jaxoverride.solve_state``: the Variables' parts (``_solve.parts_of``)."""
        return parts_of(self.tracked, state)


def _branch(self: _Lifted, fns: list[Any], where: str, given: _Given, *operands: Any) -> Any:
    (fn,) = fns
    tracked = given[0]
    out, after = self.run(*given, fn, tuple(from_refs(operands, tracked)), where)
    out = to_refs(out, tracked)[0]
    self.outputs = output_shapes(out)
    return out, after


def _cond_branch(self: _Lifted, fns: list[Any], *args: Any) -> Any:
    return _branch(self, fns, "jaxoverride.lax.cond", *args)


def _switch_branch(self: _Lifted, fns: list[Any], *args: Any) -> Any:
    return _branch(self, fns, "jaxoverride.lax.switch", *args)


def _run_branches(
    tracked: Tracked,
    branches: list[Callable[..., Any]],
    args: tuple[Any, ...],
    call: Callable[..., Any],
    switch: bool,
) -> Any:
    """``call(source, wrapped branches, constants, *operands)`` (the kit's threaded cond
    or switch) with the tracked state passed through the taken branch."""
    body = _switch_branch if switch else _cond_branch
    where = "jaxoverride.lax.switch" if switch else "jaxoverride.lax.cond"
    wrapped = [_lifted((fn,), (body, tracked.key), body) for fn in branches]
    operands = to_refs(args, tracked)[0]

    def run(state: dict[int, Any], constants: dict[int, Any]) -> Any:
        source = _BranchSource(tracked, state, constants, wrapped, where)
        return call(source, wrapped, constants, *operands)

    try:
        out = _threaded(tracked, wrapped, run, args)
    except TypeError as error:
        jax_error = branch_error(error, branches, _outputs(wrapped), switch=switch)
        if jax_error is error:
            raise
        raise jax_error from None
    return from_refs(out, tracked)


def _outputs(wrapped: Sequence[_Lifted]) -> list[Any]:
    """Each branch's output shapes from its trace, ``None`` for one JAX never traced;
    then forgotten, so that they hold nothing past the call."""
    outputs = [w.outputs for w in wrapped]
    for w in wrapped:
        w.outputs = None
    return outputs


def _all_callable(branches: Any) -> bool:
    try:
        return len(branches) > 0 and all(map(callable, branches))
    except TypeError:  # not a sequence
        return False


def _operands(operands: tuple[Any, ...], operand: Any) -> tuple[tuple[Any, ...], bool]:
    if operand is _NO_OPERAND:
        return operands, True
    return (operand,), not operands


def cond(*arguments: Any, **kwargs: Any) -> Any:
    """The ``"lax.cond"`` override: ``jax.lax.cond``'s arguments (``jax_arguments``)."""
    pred, true_fun, false_fun, operands, operand = jax_arguments("lax.cond", *arguments, **kwargs)
    below = jo.next_impl("lax.cond")
    where = "jaxoverride.lax.cond"
    args, valid = _operands(operands, operand)
    if not valid:  # JAX's own error for passing both
        return below(*arguments, **kwargs)
    tracked = with_arguments(current(), args)
    if tracked is None or not (callable(true_fun) and callable(false_fun)):
        return call_plain(below, (pred, true_fun, false_fun, *args), {}, where)
    return _run_branches(
        tracked,
        [true_fun, false_fun],
        args,
        lambda source, fns, *packed: kit.threaded_cond(source, below, pred, *fns, *packed),
        switch=False,
    )


def switch(*arguments: Any, **kwargs: Any) -> Any:
    """The ``"lax.switch"`` override: ``jax.lax.switch``'s arguments (``jax_arguments``)."""
    index, branches, operands, operand = jax_arguments("lax.switch", *arguments, **kwargs)
    below = jo.next_impl("lax.switch")
    where = "jaxoverride.lax.switch"
    args, valid = _operands(operands, operand)
    if not valid:
        return below(*arguments, **kwargs)
    tracked = with_arguments(current(), args)
    if tracked is None or not _all_callable(branches):
        return call_plain(below, (index, branches, *args), {}, where)
    return _run_branches(
        tracked,
        list(branches),
        args,
        lambda source, fns, *packed: kit.threaded_switch(source, below, index, fns, *packed),
        switch=True,
    )


# -- map ------------------------------------------------------------------------------

_MAP = "jaxoverride.lax.map"


def _map_step(self: _Lifted, fns: list[Any], given: _Given, carry: Any, x: Any) -> Any:
    (f,) = fns
    tracked = given[0]
    y, after = self.run(*given, f, (x,), _MAP)
    return (carry, to_refs(y, tracked)[0]), after


def _plain_map(self: _Lifted, fns: list[Any], x: Any) -> Any:
    (f,) = fns
    y, _ = self.run(_RUNNING.get(), {}, {}, f, (x,), _MAP)
    return to_refs(y, _RUNNING.get())[0]


def _vmapped(
    tracked: Tracked, f: Callable[[Any], Any], vmap_below: Callable[..., Any], xs: Any, where: str
) -> Any:
    """``vmap(f)(xs)`` with tracked state broadcast; writes the (unbatched) updates."""

    def pure(x: Any) -> Any:
        out, updates = run_closure(tracked, f, (x,), {}, where)
        return to_refs(out, tracked)[0], updates

    return run_mapped(vmap_below(pure, out_axes=(0, None)), tracked, where, (xs,), {})


_VMAP_BELOW: contextvars.ContextVar[Callable[..., Any]] = contextvars.ContextVar(
    "jaxoverride_nnx_vmap_below"
)


def _block_step(self: _Lifted, fns: list[Any], given: _Given, carry: Any, chunk: Any) -> Any:
    (f,) = fns
    tracked = given[0]
    vmap_below = _VMAP_BELOW.get()

    def batch(c: Any) -> Any:
        return _vmapped(tracked, f, vmap_below, c, _MAP)

    y, after = self.run(*given, batch, (chunk,), _MAP)
    return (carry, y), after


def _map_scan(tracked: Tracked, body: _Lifted, scan_below: Callable[..., Any], xs: Any) -> Any:
    """The ``ys`` of the kit's threaded scan of ``body`` over ``xs`` (no carry of its
    own: the tracked state is the carry); stores what the body wrote."""
    _, ys = _threaded(
        tracked,
        [body],
        lambda state, constants: kit.threaded_scan(
            _Source(tracked, state, constants, [body], _MAP), scan_below, body, (), xs
        ),
    )
    return ys


def lax_map(f: Callable[[Any], Any], xs: Any, *, batch_size: int | None = None) -> Any:
    """The ``"lax.map"`` override: a ``scan`` that threads the state (``vmap`` within a
    batch when ``batch_size`` is given, as ``jax.lax.map`` does)."""
    below = jo.next_impl("lax.map")
    _no_modules_in(xs, _MAP)
    tracked = current()
    if tracked is None or not callable(f):
        return call_plain(below, (f, xs), {"batch_size": batch_size}, _MAP)
    scan_below = jo.next_impl("lax.scan")
    each = _lifted((f,), ("map", tracked.key), _map_step, _plain_map)
    blocks_body = _lifted((f,), ("map-blocks", tracked.key), _block_step)
    ys = _stateless(tracked, [each], lambda: below(each, xs, batch_size=batch_size), [blocks_body])
    if ys is not _STATEFUL:
        return from_refs(ys, tracked)
    if batch_size is None:
        return from_refs(_map_scan(tracked, each, scan_below, xs), tracked)
    vmap_below = jo.next_impl("vmap")
    # JAX's own split, so that every batch size (0 included, which JAX versions read
    # differently) gives what jax.lax.map gives.
    blocks, rest = split_batches(xs, batch_size)
    ys = None
    if blocks is not None:
        below_token = _VMAP_BELOW.set(vmap_below)
        try:
            ys = _map_scan(tracked, blocks_body, scan_below, blocks)
        finally:
            _VMAP_BELOW.reset(below_token)
    rest_ys = None if rest is None else _vmapped(tracked, f, vmap_below, rest, _MAP)
    return from_refs(join_batches(ys, rest_ys), tracked)
