"""``custom_vjp`` and ``custom_jvp`` inside ``hk.transform``: Haiku's state as an argument.

JAX traces a rule's functions at levels of its own, and may trace ``fwd`` (or the JVP
rule) lazily: under ``jax.grad(jax.jit(apply))`` it does so after the transform has
returned, when no Haiku frame exists. So nothing of Haiku may be closed over. Here each
call builds JAX's rule over a function that takes Haiku's values ``(params, state, rng)``
as a leading argument and returns ``(state, rng)`` after it as an extra output:

* every function of the rule runs in a fresh frame made from that argument and from a
  copy of the caller's module stack and naming counters (taken at the call), so modules
  are named, and parameters found, as in the caller;
* state written and keys drawn by the primal or ``fwd``/JVP rule come out once per call,
  whichever JAX ran. Only the entries that the run replaced reach the caller's frame (a
  superset of the writes: a neutral loop or jit inside the rule stores what it carries
  again), so state the rule did not touch keeps its derivatives, and no write is lost;
  differentiating, after the call, state that came out of a ``custom_vjp`` is refused;
* ``bwd`` runs in a fresh frame holding the values as ``fwd`` left them, and a state
  write or rng draw there is refused at the write itself (``pure_frame``'s setter and rng
  guard), never by comparing afterwards, which a neutral loop inside ``bwd`` would
  trip: a backward pass returns cotangents only;
* the rule is registered with ``symbolic_zeros=True`` to learn which of Haiku's values are
  being differentiated. A rule gives gradients for its explicit arguments only, so a read
  of such a value (``hk.get_parameter``/``hk.get_state``, seen by a custom getter) is
  refused at the read, naming ``closure_convert``, instead of a silently zero gradient;
* at init the primal is traced once, as at apply: a parameter it creates is made at
  the call's site (``_site``), under the name apply uses.

JAX binds a rule's arguments with ``inspect.signature``: keywords are resolved to
positions on the user's function before the call, and the lifted functions keep a plain
``(values, *args)`` signature of their own.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import haiku as hk
import jax
from haiku._src import base, data_structures, stateful

import jaxoverride as jo
from jaxoverride import errors
from jaxoverride.adapter_kit import (
    LiftedRule,
    Participant,
    StagedPrimal,
    perturbed_leaves,
    resumed,
)
from jaxoverride_haiku import _layer
from jaxoverride_haiku._convert import pure_frame
from jaxoverride_haiku._creation import init_safe_call
from jaxoverride_haiku._frames import (
    InternalState,
    Names,
    current_frame,
    new_parameters_error,
    solve_policy,
    state_usable,
)
from jaxoverride_haiku._rng import (
    REFUSAL,
    CheckedSequence,
    RefusingSequence,
    reserve_full_block,
    update_state,
)
from jaxoverride_haiku._site import current_site, init_once


class ClosedOverDifferentiationError(errors.ClosedOverDifferentiationError):
    """A custom rule reads a Haiku parameter (or state) that is being differentiated.

    The Haiku case of ``jaxoverride.errors.ClosedOverDifferentiationError``, which
    catches it too (and its ``ValueError`` base).

    The rule gives gradients for its explicit arguments only, so the value would get a
    silently zero gradient. ``jaxoverride.closure_convert`` makes what a function reads
    explicit arguments.

    Example:
      >>> import jax, jax.numpy as jnp, haiku as hk
      >>> import jaxoverride as jo, jaxoverride_haiku as joh
      >>> def f(x):
      ...     scale = jo.custom_vjp(lambda x: x * hk.get_parameter("w", [], init=jnp.ones))
      ...     scale.defvjp(lambda x: (scale(x), None), lambda _, g: (g,))
      ...     return scale(x)
      >>> model = hk.transform(f)
      >>> with joh.context():
      ...     params = model.init(None, 1.0)
      ...     jax.grad(lambda p: model.apply(p, None, 1.0))(params)
      Traceback (most recent call last):
      ...
      jaxoverride_haiku.ClosedOverDifferentiationError: jaxoverride.custom_vjp: ...
    """


class DifferentiatedStateError(errors.DifferentiatedStateError):
    """State that came out of a custom rule is differentiated after it.

    The Haiku case of ``jaxoverride.errors.DifferentiatedStateError``.

    The rule's ``bwd`` gives cotangents from that of the rule's output only, so the state
    would get a silently zero gradient.

    Example:
      >>> import jax, jax.numpy as jnp, haiku as hk
      >>> import jaxoverride as jo, jaxoverride_haiku as joh
      >>> def f(x):
      ...     def primal(x):
      ...         hk.set_state("y", 3.0 * x)
      ...         return x
      ...     g = jo.custom_vjp(primal)
      ...     g.defvjp(lambda x: (primal(x), None), lambda _, ct: (ct,))
      ...     return g(x) + hk.get_state("y", [], init=jnp.zeros)
      >>> model = hk.transform_with_state(f)
      >>> with joh.context():
      ...     params, state = model.init(None, 1.0)
      ...     jax.grad(lambda x: model.apply(params, state, None, x)[0])(1.0)
      Traceback (most recent call last):
      ...
      jaxoverride_haiku.DifferentiatedStateError: jaxoverride.custom_vjp: ...
    """


_BACKWARD = (
    "the backward rule (bwd)",
    "A backward rule returns cotangents only, so nothing it writes or draws could come out, "
    "and the value would be silently lost. Write the state (or draw the key) in the primal "
    "function or in fwd, where {where} threads it out once per call, and pass what bwd "
    "needs as a residual; bwd reads the state as fwd left it. A solver whose backward pass "
    "calls your function again (jaxopt's implicit_diff=True) needs a function that writes "
    "no state; or use its unrolled mode (implicit_diff=False).",
)

# (where, names) of the values that the running rule must not read; one getter function
# for every call, so that a jo.jit inside a rule keeps one cache key.
_REFUSED: contextvars.ContextVar[tuple[str, frozenset[tuple[str, str]]]] = contextvars.ContextVar(
    "jaxoverride_haiku_refused_reads", default=("", frozenset())
)


def _refuse_differentiated(next_getter: Any, value: Any, context: hk.GetterContext) -> Any:
    where, names = _REFUSED.get()
    if (context.module_name, context.name) in names:
        raise ClosedOverDifferentiationError.reading(
            where, f"the Haiku value {context.full_name!r}"
        )
    return next_getter(value)


def _differentiated(internal: Any, perturbed: Callable[[Any], list[bool]]) -> frozenset:
    """Names ``(module, name)`` of the params and state entries with a perturbed leaf."""
    names = set()
    for group in (internal.params, internal.state):
        for module, bundle in (group or {}).items():
            for name, value in bundle.items():
                if any(perturbed(value)):
                    names.add((module, name))
    return frozenset(names)


def _refuse_differentiated_state(call: _RuleCall, cotangents: dict[str, Any]) -> None:
    """Refuses a derivative that would silently be zero: of state that the rule replaced.

    The user's ``bwd`` gives cotangents for the rule's arguments from that of its output
    only; a state value that came out of the rule and is differentiated afterwards (its
    cotangent is not a symbolic zero) would get none.
    """
    names = sorted(
        f"{module}/{name}"
        for module, name in call.changed
        if any(perturbed_leaves(cotangents[module][name].current))
    )
    if names:
        raise DifferentiatedStateError.came_out(call.where, f"the Haiku state {', '.join(names)}")


def _late_write_error(where: str, names: set[tuple[str, str]]) -> ValueError:
    listed = ", ".join(f"{module}/{name}" for module, name in sorted(names))
    return ValueError(
        f"{where}: fwd (or the JVP rule), traced by JAX after the call returned (as under "
        f"jax.grad(jax.jit(apply))), writes the Haiku state {listed}, which the primal "
        "function does not write; the call has already handed its state to the caller, so "
        "the write could not come out. Write the same state in the primal function and in "
        "fwd (the primal usually calls the same code)."
    )


def _state_identities(state: Any) -> dict[tuple[str, str], tuple[int, ...]]:
    """The identities of each state entry's values (``StatePair``'s leaves): every write
    stores new ones, while moving state between frames keeps them.

    Identities are not kept beyond the run, whose values are held meanwhile.
    """
    return {
        (module, name): tuple(_leaf_ids(pair))
        for module, bundle in (state or {}).items()
        for name, pair in bundle.items()
    }


def _mutable(bundles: Any) -> collections.defaultdict[str, dict[str, Any]]:
    return collections.defaultdict(dict, {module: dict(b) for module, b in bundles.items()})


def _rebased(policy: Participant, state: InternalState, entry: InternalState) -> InternalState:
    """``state`` with the frozen parts of ``entry`` (the state a rule's call received):
    what its backward pass re-evaluates from, with no value of the declaration's trace
    closed over (JAX may trace bwd after that trace ended)."""
    frame = policy.push(entry)
    try:
        return policy.freeze(state)
    finally:
        policy.pop(frame)


def _handed(policy: Participant, values: InternalState) -> tuple[InternalState, InternalState]:
    """The values a rule takes under ``jaxoverride.solve_state``: ``values`` with the
    frozen parts as at entry, and what the evaluations before the call left (its params
    left out: it is passed on, never read), which a run that evaluates nothing (a
    ``cond``'s no-op branch inside the rule) passes on (``Participant.push``)."""
    received = policy.current(values)._replace(params={})
    return policy.freeze(values), received


def _split(values: Any) -> tuple[InternalState, InternalState | None]:
    """A rule's values and, under a declaration, what it received (``_handed``)."""
    if isinstance(values, InternalState):
        return values, None
    internal, received = values
    return internal, received


def _after(frame: base.Frame, call: _RuleCall) -> tuple[Any, Any]:
    """What a rule hands back: state and rng, the rng with a full block (a fixed structure);
    under ``jaxoverride.solve_state`` what the run leaves (``Participant.left``)."""
    sequence = frame.rng_stack.peek()
    if sequence is not None:
        sequence.reserve_up_to_full()
    if call.policy is not None and call.policy_frames:
        update_state(call.policy.left(stateful.internal_state(), call.policy_frames[-1]))
    rng = None if sequence is None else sequence.internal_state
    state: Any = frame.state  # a mapping inside a transform
    return stateful.copy_structure(dict(state)), rng


class _RuleCall:
    """One call of a lifted rule (a kit ``RuleCall``): the caller's frame state and its end."""

    __slots__ = (
        "__weakref__",
        "changed",
        "drew",
        "end",
        "finished",
        "left_out",
        "policy",
        "policy_frames",
        "refuse",
        "template",
        "where",
    )

    def __init__(self, where: str):
        frame = current_frame()
        # A decoupled copy of the module stack and naming counters: every function of the
        # rule starts from it, also one that JAX traces after the transform returned.
        # The template holds no rng sequence: the caller's may hold JAX values.
        template = frame.evolve(params={}, state={}, rng=None)
        self.template = template._replace(rng_stack=data_structures.Stack())
        self.where = where
        # The refusal of rng draws in force at the call (inside a function that JAX makes
        # pure), or None. Every function of the rule keeps it, also one that JAX traces
        # after that function's trace ended (from JAX 0.12 the JVP rule of a custom_jvp
        # met in jax.linearize's partial evaluation: optimistix's Newton step): the rule's
        # runs then build the same sequence, and so hand back rng state of one structure.
        self.refuse = REFUSAL.get()
        # Full names of the params that a staged rule does not take (its primal function
        # does not use them): a read of one in the JVP rule is refused (``_left_out``).
        self.left_out: frozenset[str] = frozenset()
        self.end: Names | None = None
        # Names of the state entries that a forward run replaced (written, or stored by a
        # neutral loop or jit inside it): only these reach the caller's frame, so a value
        # the rule did not touch keeps its own derivatives.
        self.changed: set[tuple[str, str]] = set()
        # Whether a forward run drew a key (None: no forward run yet). The rng sequence
        # reaches the caller only then, for the same reason as the state entries: from
        # JAX 0.12 a custom_jvp staged in a partial evaluation with an unknown input (a
        # tangent, inside jax.linearize: optimistix's Newton step; a custom_jvp's JVP
        # rule that calls another on its tangent, as optimistix's ``_asarray`` does, met
        # in lineax's transpose) has only unknown outputs, so a sequence passed through
        # would come back unknown. Both compare with what the run was handed, under a
        # declaration also what the evaluations before the call left (``received``),
        # which a run that evaluates nothing passes on: that is no write or draw.
        self.drew: bool | None = None
        self.finished = False
        # The ``jaxoverride.solve_state`` declaration in force at the call (JAX runs bwd
        # after it has exited), and the boundaries pushed for the runs now open.
        self.policy = solve_policy()
        self.policy_frames: list[Any] = []

    @contextlib.contextmanager
    def frame(
        self, values: InternalState, refused: frozenset = frozenset(), *, forward: bool = True
    ) -> Iterator[base.Frame]:
        """A fresh frame holding ``values``, at the current trace level.

        ``refused``: names of differentiated values whose reads are refused. ``forward``:
        whether this run's naming state is the one the caller continues from.
        """
        values, received = _split(values)
        rng = None
        if values.rng is not None:
            refuse = self.refuse
            rng = (
                CheckedSequence(values.rng)
                if refuse is None
                else RefusingSequence(values.rng, refuse)
            )
        frame = self.template.evolve(
            params=_mutable(values.params), state=_mutable(values.state), rng=rng
        )
        _, outer = _REFUSED.get()
        with contextlib.ExitStack() as stack:
            stack.enter_context(_haiku_layer())
            stack.enter_context(base.frame_stack(frame))
            stack.enter_context(base.push_jax_trace_level())
            if self.refuse is not None:
                token = REFUSAL.set(self.refuse)
                stack.callback(REFUSAL.reset, token)
            if refused - outer:
                token = _REFUSED.set((self.where, outer | refused))
                stack.callback(_REFUSED.reset, token)
                if not outer:
                    stack.enter_context(
                        hk.custom_getter(_refuse_differentiated, params=True, state=True)
                    )
            if self.left_out:
                stack.enter_context(hk.custom_creator(self._refuse_left_out, params=True))
            before = base.param_names()
            # What the run is handed: its own values and, under a declaration, what the
            # evaluations before the call left (which a run that evaluates nothing passes
            # on, ``_after``). A value left as one of them is no write or draw.
            handed = [values] if received is None else [values, received]
            entry = [_state_identities(given.state) for given in handed]
            if self.policy is not None:
                # JAX may run this after the declaration has exited (bwd): it is in force
                # again inside; the frozen values are the rule's own argument's.
                stack.enter_context(resumed(self.policy))
                pushed = self.policy.push(values, received=received, backward=not forward)
                self.policy_frames.append(pushed)
                stack.callback(self.policy_frames.pop)
                stack.callback(self.policy.pop, pushed)
            yield frame
            created = base.param_names() - before
            if created and current_site() is None:  # at init, made at the site on purpose
                raise new_parameters_error(self.where, created)
            if forward:
                self.end = Names.capture(frame)
                if rng is not None:
                    left = _leaf_ids(rng.internal_state)
                    drew = all(left != _leaf_ids(given.rng) for given in handed)
                    self.drew = bool(self.drew) or drew
                leaving = _state_identities(frame.state)
                changed = {n for n, ids in leaving.items() if all(e.get(n) != ids for e in entry)}
                if not self.finished:
                    self.changed |= changed
                else:
                    late = changed - self.changed
                    if self.policy is not None:
                        # Under a declaration a later run (optimistix's JVP rule, which
                        # calls lineax's jitted solve) may pass what it received on
                        # through a neutral jit as new values, which no identity tells
                        # from a write: only an entry it was not handed is one for sure.
                        late = {n for n in late if all(n not in e for e in entry)}
                    if late:
                        raise _late_write_error(self.where, late)

    # -- kit.RuleCall and kit.RuleBackward -------------------------------------------------

    def differentiated(self, values: Any) -> frozenset:
        """Names of the params and state being differentiated (``_differentiated``)."""
        return _differentiated(_split(values)[0], perturbed_leaves)

    def run(
        self, values: Any, fun: Callable[..., Any], args: Sequence[Any], refused: Any = None
    ) -> tuple[Any, Any]:
        """``fun(*args)`` in a fresh frame holding ``values``; returns ``(out, after)``."""
        with self.frame(values, refused or frozenset()) as frame:
            out = fun(*args)
            return out, _after(frame, self)

    def run_forward(
        self, values: Any, fun: Callable[..., Any], args: Sequence[Any], refused: Any
    ) -> tuple[Any, Any, Any]:
        """As ``run``; also the values as ``fun`` left them, which bwd runs from, and under
        ``jaxoverride.solve_state`` the values this call received (bwd re-evaluates from
        their frozen state: ``_rebased``)."""
        with self.frame(values, refused or frozenset()) as frame:
            out = fun(*args)
            after = _after(frame, self)
            forward_values = stateful.internal_state()
        entry = None if self.policy is None else _split(values)[0]
        return out, after, (forward_values, entry)

    def staged_values(self, values: Any, used: list[bool]) -> tuple[Any, list[bool]]:
        """The values a staged custom_jvp takes: the params its primal uses, all of the
        state and rng (a read of a param left out is refused: ``_refuse_left_out``)."""
        internal, received = _split(values)
        kept = _kept_params(internal, used)
        pruned = _without_params(internal, kept)
        self.left_out = frozenset(_full_names(internal.params) - _full_names(pruned.params))
        return (pruned if received is None else (pruned, received)), kept

    def refuse_differentiated_state(self, cotangent: Any) -> None:
        """Refuses a derivative of state that came out (``_refuse_differentiated_state``)."""
        _refuse_differentiated_state(self, cotangent[0])

    def run_backward(self, saved: Any, fun: Callable[..., Any], args: Sequence[Any]) -> Any:
        """``fun(*args)`` (bwd) in a fresh frame holding the values as fwd left them, every
        state write and rng draw refused (``pure_frame``)."""
        forward_values, entry = saved
        policy = self.policy
        if policy is not None:
            forward_values = _rebased(policy, forward_values, entry)
        with (
            self.frame(forward_values, forward=False),
            pure_frame(self.where, *_BACKWARD, policy=policy),
        ):
            return fun(*args)

    def _refuse_left_out(self, next_creator: Any, shape: Any, dtype: Any, init: Any, context: Any):
        if context.full_name in self.left_out:
            what = f"the Haiku parameter {context.full_name!r}"
            raise StagedPrimal.unused_read_error(self.where, what)
        return next_creator(shape, dtype, init)

    def finish(self, after: tuple[Any, Any]) -> None:
        state, rng = after
        changed: dict[str, dict[str, Any]] = {}
        for module, name in self.changed:
            changed.setdefault(module, {})[name] = state[module][name]
        rng = None if self.drew is False else rng
        left = InternalState(params=None, state=changed, rng=rng)
        update_state(left if self.policy is None else self.policy.written(left))
        self.finished = True
        if self.end is not None:
            self.end.restore_into(current_frame())


def _leaf_ids(tree: Any) -> list[int]:
    return [id(leaf) for leaf in jax.tree.leaves(tree)]


def _haiku_layer() -> contextlib.AbstractContextManager[Any]:
    """The Haiku overrides, entered if only ``install()`` provided them: a rule traced after
    the transform returned runs outside the installation's scope."""
    layer = _layer.installed_layer()
    if layer is not None and jo.resolve("custom_vjp") is not custom_vjp:
        return layer
    return contextlib.nullcontext()


def _kept_params(values: InternalState, used: list[bool]) -> list[bool]:
    """Per leaf of ``values``: whether it goes to the rule. Params only where ``used``;
    all of the state and rng, which the rule hands back."""
    count = len(jax.tree.leaves(values.params))
    return [u or index >= count for index, u in enumerate(used)]


def _without_params(values: InternalState, kept: list[bool]) -> InternalState:
    """``values`` without the params that ``kept`` leaves out (in leaf order)."""
    flags = iter(kept)
    params: dict[str, dict[str, Any]] = {}
    for module, bundle in sorted((values.params or {}).items()):
        for name in sorted(bundle):
            if next(flags):
                params.setdefault(module, {})[name] = bundle[name]
    return values._replace(params=params)


def _full_names(params: Any) -> set[str]:
    return {f"{module}/{name}" for module, bundle in (params or {}).items() for name in bundle}


def _run(
    bind: Callable[[Any], tuple[Any, Any]],
    call: _RuleCall,
    args: tuple[Any, ...],
) -> Any:
    """Calls JAX's rule on the caller's values and hands back what it wrote.

    ``bind(values)`` returns the rule and the values it takes (under a declaration, with
    what the evaluations before the call left: ``_handed``). A full block of rng keys
    is reserved first (the same rng structure in and out); a failure puts the caller's
    sequence back as it was.
    """
    sequence = current_frame().rng_stack.peek()
    saved = None if sequence is None else (sequence, sequence.internal_state)
    try:
        reserve_full_block()
        values = stateful.internal_state()
        rule, values = bind(values if call.policy is None else _handed(call.policy, values))
        out, after = rule(values, *args)
    except BaseException:
        if saved is not None:
            saved[0].replace_internal_state(saved[1])
        raise
    call.finish(after)
    return out


class HaikuRule(LiftedRule):
    """What the Haiku override of ``custom_vjp``/``custom_jvp`` builds for one stack.

    Outside a transform (or where Haiku state is unusable) a call is a call of the rule
    below; inside, Haiku's values are lifted into an explicit argument (module docstring).
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._rule is None or not state_usable():
            return self._plain(*args, **kwargs)
        called = self._call_arguments(args, kwargs)
        if called is None:  # JAX's own error about the call
            return self._plain(*args, **kwargs)
        args = called
        lifted = self._lifted_vjp if self._name == "custom_vjp" else self._lifted_jvp
        return init_once(
            lambda: lifted(args),
            lambda: init_safe_call(lambda: self._fun(*args), lambda: lifted(args)),
        )

    def _lifted_vjp(self, args: tuple[Any, ...]) -> Any:
        call = _RuleCall(self._where)
        rule = self._vjp_rule(call, call, args)
        return _run(lambda values: (rule, values), call, args)

    def _lifted_jvp(self, args: tuple[Any, ...]) -> Any:
        call = _RuleCall(self._where)
        return _run(self._jvp_binder(call, args), call, args)


_BUILDERS = HaikuRule.overrides()
custom_vjp = _BUILDERS["custom_vjp"]
custom_jvp = _BUILDERS["custom_jvp"]
