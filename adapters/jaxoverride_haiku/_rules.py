"""``custom_vjp`` and ``custom_jvp`` inside ``hk.transform``: Haiku's state as an argument.

JAX may trace ``fwd`` (or the JVP rule) after the transform returned (under
``jax.grad(jax.jit(apply))``), with no Haiku frame, so nothing of Haiku may be closed over.
Each call builds JAX's rule over a function taking ``(params, state, rng)`` as a leading
argument and returning ``(state, rng)`` after it:

* each function of the rule runs in a fresh frame made from that argument and a copy of
  the caller's module stack and naming counters, so names resolve as in the caller;
* writes and draws of the primal or ``fwd``/JVP rule come out once per call; only the
  entries the run replaced reach the caller, so untouched state keeps its derivatives; a
  derivative of state that came out of a ``custom_vjp`` is refused;
* ``bwd`` runs on the values as ``fwd`` left them; a write or draw there is refused at the
  write (``pure_frame``): a backward pass returns cotangents only;
* with ``symbolic_zeros=True`` the rule learns what is differentiated: reading such a
  value is refused, naming ``closure_convert``, not a silently zero gradient;
* at init a parameter the primal creates is made at the call's site (``_site``).
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

    The Haiku case of ``jaxoverride.errors.ClosedOverDifferentiationError``: the rule gives
    gradients for its explicit arguments only, so the value would get a silently zero
    gradient (``jaxoverride.closure_convert`` makes what a function reads arguments).

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

    The Haiku case of ``jaxoverride.errors.DifferentiatedStateError``: the rule's ``bwd``
    gives cotangents from that of its output only, so the state would get a zero gradient.

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
    """The identities of each state entry's leaves: a write stores new ones, moving state
    between frames keeps them (the run holds the values meanwhile)."""
    return {
        (module, name): tuple(_leaf_ids(pair))
        for module, bundle in (state or {}).items()
        for name, pair in bundle.items()
    }


def _mutable(bundles: Any) -> collections.defaultdict[str, dict[str, Any]]:
    return collections.defaultdict(dict, {module: dict(b) for module, b in bundles.items()})


def _split(values: Any) -> tuple[InternalState, InternalState | None]:
    """A rule's values and, under a declaration, what it received (``_run``)."""
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
        # A decoupled copy of the module stack and naming counters, which every function
        # of the rule starts from; no rng sequence (the caller's may hold JAX values).
        template = frame.evolve(params={}, state={}, rng=None)
        self.template = template._replace(rng_stack=data_structures.Stack())
        self.where = where
        # The refusal of rng draws in force at the call, or None: every function of the
        # rule keeps it, also one traced later, so all hand back rng of one structure.
        self.refuse = REFUSAL.get()
        # Full names of the params a staged rule does not take: a read is refused.
        self.left_out: frozenset[str] = frozenset()
        self.end: Names | None = None
        # Names of the state entries a forward run replaced: only these reach the caller,
        # so a value the rule did not touch keeps its own derivatives.
        self.changed: set[tuple[str, str]] = set()
        # Whether a forward run drew a key (None: none ran yet); the sequence reaches the
        # caller only then: from JAX 0.12 a custom_jvp staged with an unknown input has
        # only unknown outputs, so a sequence passed through would come back unknown.
        # Passing on what the run was handed (or ``received``) is no write or draw.
        self.drew: bool | None = None
        self.finished = False
        # The ``jaxoverride.solve_state`` at the call (bwd runs after it exited), and the
        # boundaries pushed for the runs now open.
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
            # A value left as one the run was handed (``received`` too) is no write.
            handed = [values] if received is None else [values, received]
            entry = [_state_identities(given.state) for given in handed]
            if self.policy is not None:
                # In force again inside (bwd runs after it exited), frozen at the argument.
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
                        # A later run may pass what it received on through a neutral
                        # jit as new values: only an entry it was not handed is a write.
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
        their frozen state)."""
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
        count = len(jax.tree.leaves(internal.params))
        kept = [u or index >= count for index, u in enumerate(used)]  # state and rng: all
        flags = iter(kept)
        params: dict[str, dict[str, Any]] = {}
        left_out = set()
        for module, bundle in sorted((internal.params or {}).items()):
            for name in sorted(bundle):
                if next(flags):
                    params.setdefault(module, {})[name] = bundle[name]
                else:
                    left_out.add(f"{module}/{name}")
        self.left_out = frozenset(left_out)
        pruned = internal._replace(params=params)
        return (pruned if received is None else (pruned, received)), kept

    def refuse_differentiated_state(self, cotangent: Any) -> None:
        """Refuses a derivative of state the rule replaced: ``bwd`` would give it none."""
        names = sorted(
            f"{module}/{name}"
            for module, name in self.changed
            if any(perturbed_leaves(cotangent[0][module][name].current))
        )
        if names:
            what = f"the Haiku state {', '.join(names)}"
            raise DifferentiatedStateError.came_out(self.where, what)

    def run_backward(self, saved: Any, fun: Callable[..., Any], args: Sequence[Any]) -> Any:
        """``fun(*args)`` (bwd) in a fresh frame holding the values as fwd left them, every
        state write and rng draw refused (``pure_frame``)."""
        forward_values, entry = saved
        policy = self.policy
        if policy is not None:
            # Frozen at what the call received, no value of the declaration's trace kept.
            frame = policy.push(entry)
            try:
                forward_values = policy.freeze(forward_values)
            finally:
                policy.pop(frame)
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


def _run(
    bind: Callable[[Any], tuple[Any, Any]],
    call: _RuleCall,
    args: tuple[Any, ...],
) -> Any:
    """Calls the rule ``bind(values)`` returns on the caller's values, and hands back what
    it wrote; a full rng block is reserved first (one structure in and out), put back on
    failure."""
    sequence = current_frame().rng_stack.peek()
    saved = None if sequence is None else (sequence, sequence.internal_state)
    try:
        reserve_full_block()
        values = stateful.internal_state()
        policy = call.policy
        if policy is not None:  # frozen, with what the evaluations before left (no params)
            received = policy.current(values)._replace(params={})
            values = (policy.freeze(values), received)
        rule, values = bind(values)
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
        return init_once(
            lambda: self._lifted(args),
            lambda: init_safe_call(lambda: self._fun(*args), lambda: self._lifted(args)),
        )

    def _lifted(self, args: tuple[Any, ...]) -> Any:
        call = _RuleCall(self._where)
        if self._name == "custom_vjp":
            rule = self._vjp_rule(call, call, args)
            return _run(lambda values: (rule, values), call, args)
        return _run(self._jvp_binder(call, args), call, args)


_BUILDERS = HaikuRule.overrides()
custom_vjp = _BUILDERS["custom_vjp"]
custom_jvp = _BUILDERS["custom_jvp"]
