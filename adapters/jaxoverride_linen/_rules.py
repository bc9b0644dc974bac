"""``custom_vjp``, ``custom_jvp`` and the implicit-differentiation names inside bound Linen
modules (``IMPLICIT_OVERRIDES``; ``_convert``: the pure functions).

JAX refuses (as a leaked tracer) a value being differentiated that a rule closes over, and
a function calling Linen submodules closes over the whole scope. So each call builds JAX's
rule over a function taking Linen's values ``(params, state, received)`` as a leading
argument (``state``: the mutable collections and one key per rng stream, as loops thread
them; ``received``: under ``jaxoverride.solve_state``, what the evaluations before the call
left where it differs from the frozen ``state``) and returning ``state`` after it:

* the rule's functions see those values through the scopes (params via
  ``_guards.lifted_reads``), so submodules are found and named as in the caller;
* writes and draws of the primal or ``fwd``/JVP rule come out once per call; a derivative
  of a variable that came out of a ``custom_vjp`` is refused (``DifferentiatedStateError``);
* ``bwd`` sees the values as ``fwd`` left them and may not write or draw
  (``PureFunctionWriteError``);
* with ``symbolic_zeros=True`` the rule learns what is differentiated: reading such a value
  is refused (``ClosedOverDifferentiationError``), not a silently zero gradient;
* at init a creation pass runs the primal once, creating variables under apply's names.

Unlike ``nn.custom_vjp`` the functions may call any submodule and read any variable; there
is a ``custom_jvp`` too.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from jaxoverride import adapter_kit as kit
from jaxoverride_linen import _convert, _declared, _source, _trees as trees
from jaxoverride_linen._convert import init_safe, pure_scope
from jaxoverride_linen._declared import SOLVE_STATE_FIX
from jaxoverride_linen._errors import DifferentiatedStateError
from jaxoverride_linen._guards import hidden_rngs, lifted_params, lifted_reads, pure

_BACKWARD = (
    "the backward rule (bwd)",
    "A backward rule returns cotangents only, so nothing it writes or draws could come out, "
    "and the value would be silently lost. Write the variable (or draw the key) in the "
    "primal function or in fwd, where {where} threads it out once per call, and pass what "
    "bwd needs as a residual; bwd reads the variables as fwd left them. A solver whose "
    "backward pass calls your function again (jaxopt's implicit_diff=True) needs a function "
    "that writes nothing; or use its unrolled mode (implicit_diff=False). " + SOLVE_STATE_FIX,
)


_DRAW = (
    "a custom rule's function",
    "{where} threads the rule's Linen variables through JAX, but no rng key: threading one "
    "would draw a key from the caller's stream on every call, even where nothing is drawn "
    "(a rule called inside a loop's condition could not run). Draw the key before the call "
    "and pass it in as an argument. " + SOLVE_STATE_FIX,
)


def _params(source: Any) -> list[Any]:
    """Each root's ``params`` collection, as a tree of plain dicts, as reads see it now."""
    trees = []
    for root in source.roots:
        lifted = lifted_params(root.variables)
        trees.append(_as_dicts(root.variables.get("params", {})) if lifted is None else lifted)
    return trees


def _as_dicts(tree: Any) -> Any:
    if hasattr(tree, "items"):
        return {key: _as_dicts(value) for key, value in tree.items()}
    return tree


def _perturbed(collections: Any) -> frozenset[tuple[str, ...]]:
    """The paths ``(collection, *path)`` holding a leaf being differentiated."""
    return frozenset(
        (col, *path)
        for col, tree in collections.items()
        for path, value in trees.paths(tree)
        if any(kit.perturbed_leaves(value))
    )


@contextlib.contextmanager
def _valid(source: Any) -> Iterator[None]:
    """The root scopes valid again: JAX may trace ``fwd`` or the JVP rule after ``apply``
    returned (``jax.grad(jax.jit(model.apply))``); the scope only routes the rule's values."""
    invalid = [root.scope for root in source.roots if root.scope._invalid]
    for scope in invalid:
        scope._invalid = False
    try:
        yield
    finally:
        for scope in invalid:
            scope._invalid = True


class _Call:
    """One call of a lifted rule (a kit ``RuleCall``): the caller's source and its threading."""

    __slots__ = (
        "__weakref__",
        "backward",
        "evaluated",
        "forward",
        "kept",
        "left_out",
        "policy",
        "received_at",
        "roots",
        "source",
        "where",
    )

    def __init__(self, source: Any, where: str):
        self.source = source
        self.where = where
        self.roots = [root.variables for root in source.roots]
        self.forward = kit.Threaded(source, 1, where)
        # A ``jaxoverride.solve_state`` around the call: the forward functions run on the
        # rule's frozen argument, not the entry snapshot; bwd (run after the declaration
        # exited) keeps the one found now, its writes dropped.
        self.policy = self.forward.policy
        self.forward.policy = None
        self.evaluated = False  # whether a forward run evaluated anything (``kit.Threaded``)
        # Under a declaration, the state leaves where what the evaluations before the call
        # left differs from the frozen argument: the rule's third value (``_call``), which
        # a forward run that evaluates nothing passes on.
        self.received_at: tuple[int, ...] = ()
        self.backward = kit.Threaded(source, 1, where, backward=True)
        self.backward.policy = self.policy
        # Per leaf of the threaded state: left as it came in by every forward run so far.
        self.kept: list[bool] | None = None
        # Per root, the params paths a staged custom_jvp was not given (``staged_values``).
        self.left_out: list[frozenset[tuple[str, ...]]] | None = None

    def note_kept(self, state: Any, after: Any) -> None:
        """Records which leaves of ``state`` a forward run left as they were (the same
        object in ``after``)."""
        kept = [a is b for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(after), strict=True)]
        self.kept = (
            kept if self.kept is None else [k and o for k, o in zip(kept, self.kept, strict=True)]
        )

    def written(self, before: Any, after: Any) -> Any:
        """``after`` with each leaf that no forward run wrote taken from ``before``.

        From JAX 0.12 a ``custom_jvp`` staged in a partial evaluation with an unknown input
        has only unknown outputs, so inside ``jax.linearize`` a variable merely carried
        would come back unknown ("Linearization failed to produce known values").
        """
        kept = self.kept
        if kept is None or not any(kept):
            return after
        leaves, tree = jax.tree.flatten(after)
        old = jax.tree.leaves(before)
        return jax.tree.unflatten(
            tree, [o if k else a for o, k, a in zip(old, kept, leaves, strict=True)]
        )

    @contextlib.contextmanager
    def reading(self, params: Any, refused: Sequence[frozenset] | None = None) -> Iterator[None]:
        """The scopes showing ``params`` (reads of ``refused`` paths refused), no rng key,
        and valid even after the call returned."""
        refused = refused or [frozenset()] * len(self.roots)
        roots = self.source.roots
        with lifted_reads(self.roots, params, refused, self.where, self.left_out):
            with hidden_rngs(roots), _valid(self.source):
                yield

    def differentiated(self, values: Any) -> list[frozenset[tuple[str, ...]]]:
        """Per root, the paths being differentiated (``kit.RuleCall``)."""
        params, state = values[0], values[1]
        return [
            _perturbed({"params": tree, **cols})
            for tree, (cols, *_) in zip(params, state, strict=True)
        ]

    def run(
        self, values: Any, fun: Callable[..., Any], args: Sequence[Any], refused: Any = None
    ) -> tuple[Any, Any]:
        """``fun(*args)`` with the scopes showing ``values`` (``(params, state, received)``,
        see ``received_at``); returns ``(out, state)``.

        An rng draw inside is refused: the rule threads no key (see ``_DRAW``).
        """
        params, state, received = values
        source, where = self.source, self.where

        policy = self.policy
        allowed = _declared.allowed(policy)

        def drawing_refused() -> Any:
            with pure(source.roots, where, *_DRAW, writes=False, allowed=allowed):
                return fun(*args)

        if policy is None:
            with self.reading(params, refused):
                out, after = self.forward.run(0, state, drawing_refused)
            self.note_kept(state, after)
            return out, after
        # The state argument was frozen at the call's read: inside the rule's trace it
        # stands for the entry state (``rebased``).
        handed = self._received(state, received)
        frame = policy.push(state, received=handed)
        with policy.rebased(state):
            try:
                with self.reading(params, refused):
                    with _declared.evaluating(policy, source.roots):
                        out, after = self.forward.run(0, state, drawing_refused)
            finally:
                policy.pop(frame)
            if frame.last is not None or not policy.untouched(after):
                self.evaluated = True
            after = policy.left(after, frame)
        self.note_kept(handed, after)
        return out, after

    def run_forward(
        self, values: Any, fun: Callable[..., Any], args: Sequence[Any], refused: Any
    ) -> tuple[Any, Any, Any]:
        """As ``run``; also the params and the state ``bwd`` reads (as fwd left them)."""
        out, after = self.run(values, fun, args, refused)
        return out, after, (values[0], after)

    def staged_values(self, values: Any, used: list[bool]) -> tuple[Any, list[bool]]:
        """The values a staged custom_jvp takes: the params whose leaves ``used`` marks (a
        variable partly read kept whole), all of the state; per leaf, whether it is kept."""
        params, state, received = values
        flags = iter(used)
        kept: list[bool] = []
        pruned, left_out = [], []
        for tree in params:
            taken: dict[str, Any] = {}
            dropped = set()
            variables = jax.tree_util.tree_flatten_with_path(
                tree, is_leaf=lambda node: not isinstance(node, dict)
            )[0]
            for keys, variable in variables:
                path = tuple(key.key for key in keys)
                reads = [next(flags) for _ in jax.tree.leaves(variable)]
                keep = not reads or any(reads)
                kept += [keep] * len(reads)
                if keep:
                    trees.put_path(taken, path, variable)
                else:
                    dropped.add(path)
            pruned.append(taken)
            left_out.append(frozenset(dropped))
        kept += [True for _ in flags]  # the state, and what came before the call
        self.left_out = left_out
        return (pruned, state, received), kept

    def _received(self, state: Any, received: Sequence[Any]) -> Any:
        """What the evaluations before the call left: ``state`` with the leaves at
        ``received_at`` taken from ``received``."""
        if not received:
            return state
        leaves, tree = jax.tree.flatten(state)
        for index, value in zip(self.received_at, received, strict=True):
            leaves[index] = value
        return jax.tree.unflatten(tree, leaves)

    def run_backward(self, saved: Any, fun: Callable[..., Any], args: Sequence[Any]) -> Any:
        """``fun(*args)`` as ``run``, on the params and state ``saved`` (``run_forward``),
        every write and draw refused; returns ``out``."""
        params, state = saved
        source, where = self.source, self.where

        policy = self.backward.policy
        allowed = _declared.allowed(policy)

        def refusing() -> Any:
            with pure_scope(source, where, *_BACKWARD, allowed=allowed):
                return fun(*args)

        with self.reading(params), _declared.evaluating(policy, source.roots):
            out, _ = self.backward.run(0, state, refusing)
        return out


class _Backward:
    """What the backward rule keeps of a call: its name, and the call and modules weakly.

    JAX keeps ``bwd`` after the differentiating trace ended, while the caller's scopes hold
    its tracers: a strong reference would keep that trace alive (``jax.checking_leaks``).
    Where no module is left, ``bwd`` has no variable to read or write, and runs as it is.
    """

    __slots__ = ("call", "modules", "where")

    def __init__(self, call: _Call):
        self.call = weakref.ref(call)
        self.modules = [weakref.ref(module) for module in call.source.modules]
        self.where = call.where

    def refuse_differentiated_state(self, cotangent: Any) -> None:
        """Refuses a derivative, silently zero, of a variable that came out
        (``kit.RuleBackward``)."""
        names = sorted("/".join(p) for cols, *_ in cotangent for p in _perturbed(cols))
        if names:
            what = f"the Linen state {', '.join(names)}"
            raise DifferentiatedStateError.came_out(self.where, what)

    def run_backward(self, saved: Any, fun: Callable[..., Any], args: Sequence[Any]) -> Any:
        """``fun(*args)`` as ``_Call.run_backward`` while the caller's modules live."""
        call = self.call()
        if call is None:
            modules = [ref() for ref in self.modules]
            if any(module is None for module in modules):
                return fun(*args)  # the scopes are gone: nothing for bwd to route
            source = _source.LinenSource(self.where, modules=modules)
            call = _Call(source, self.where)
        return call.run_backward(saved, fun, args)


class LinenRule(kit.LiftedRule):
    """What the Linen override of ``custom_vjp``/``custom_jvp`` builds for one stack.

    Outside a bound module a call is a call of the rule below; inside, Linen's values
    are lifted into an explicit argument (module docstring).
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._rule is None or not _source.in_bound_module():
            return self._plain(*args, **kwargs)
        called = self._call_arguments(args, kwargs)
        if called is None:  # JAX's own error about the call
            return self._plain(*args, **kwargs)
        args = called
        source = _source.source(self._where)
        # The creation pass sees the arguments as JAX's rule does: arrays, nondiff ones
        # as given.
        creation = lambda: self._fun(*kit.traced_arguments(args, self._nondiff))
        return init_safe(source, creation, lambda: self._lifted(source, args))

    def _lifted(self, source: Any, args: tuple[Any, ...]) -> Any:
        """Calls JAX's rule on the caller's values."""
        call = _Call(source, self._where)
        bind: Callable[[Any], tuple[Any, Any]]
        if self._name == "custom_vjp":
            rule = self._vjp_rule(call, _Backward(call), args)  # bwd holds the call weakly
            bind = lambda values: (rule, values)
        else:
            bind = self._jvp_binder(call, args)
        with hidden_rngs(source.roots):  # the state without keys (see _DRAW)
            state = source.read()
        policy = call.policy
        received: list[Any] = []
        carried = state  # what a leaf that no forward run wrote comes out as
        if policy is not None:
            carried = policy.current(state)
            before = jax.tree.leaves(carried)
            state = policy.freeze(state)
            # An argument, not a closure: the rule's functions may be traced after the call.
            call.received_at = tuple(
                i
                for i, (a, b) in enumerate(zip(before, jax.tree.leaves(state), strict=True))
                if a is not b
            )
            received = [before[i] for i in call.received_at]
        rule, values = bind((_params(source), state, received))
        out, after = rule(values, *args)
        after = call.written(carried, after)
        if policy is not None:
            after = policy.written(after, backward=not call.evaluated)
        call.forward.finish(after)
        return out


IMPLICIT_OVERRIDES: dict[str, Callable[..., Any]] = {
    **LinenRule.overrides(),
    # Listed after the transforms' make_jaxpr in the layer: a write inside is refused.
    **_convert.CONVERSIONS,
    # Not a threaded eval_shape, which would draw a key: equinox calls eval_shape
    # inside its loops' conditions, where no key may be drawn.
    "eval_shape": _convert.eval_shape,
}
"""Neutral name -> Linen override, for the implicit-differentiation names."""
