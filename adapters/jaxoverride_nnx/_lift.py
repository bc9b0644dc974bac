"""Lifting: run stateful NNX code inside a JAX trace as a function of explicit values.

Outside the trace an override reads the lifted Variables' values and passes them through
the JAX transform as inputs, carries or constants. Inside, ``run_lifted`` points each
Variable at its traced value with a trace state valid at this level (so NNX lets it be
written), runs the function, collects the new values and restores every Variable, also on
an exception; ``write_back`` stores those that changed. The Variable objects are never
replaced, so shared references and module identities are kept. Graph nodes passed as
arguments are ``NodeRef`` placeholders inside (pytree nodes with no leaves).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.errors import TraceContextError
from flax.nnx import tracers

from jaxoverride_nnx._errors import StructureChangeError, explain, structure_changed
from jaxoverride_nnx._graph import RAW, TRACE, is_graph_object
from jaxoverride_nnx._probes import NeedsState, probe_for
from jaxoverride_nnx._solve import entering, leaving, written
from jaxoverride_nnx._tracked import ACTIVE, Tracked, empty
from jaxoverride_nnx._write import write_back as write_back


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, slots=True)
class NodeRef:
    """Stands for a lifted module (``kind="n"``) or Variable (``"v"``) inside a trace."""

    kind: str
    index: int

    def __repr__(self) -> str:
        return f"NodeRef({self.kind}{self.index})"


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, slots=True)
class Flag:
    """A boolean that leaves a trace as static output (in the treedef, not as an array)."""

    value: bool


NO_REFS = Flag(False)
HAS_REFS = Flag(True)


def _is_ref_or_object(x: Any) -> bool:
    # Modules are pytrees too: stop at them, or tree_map would rebuild them as copies.
    return type(x) is NodeRef or is_graph_object(x)


def _signature(value: Any) -> tuple[Any, ...]:
    leaves, treedef = jax.tree_util.tree_flatten(value)
    return (treedef, tuple((tuple(np.shape(leaf)), jnp.result_type(leaf)) for leaf in leaves))


def _describe(signature: tuple[Any, ...]) -> str:
    treedef, leaves = signature
    parts = [f"{np.dtype(dtype).name}{list(shape)}" for shape, dtype in leaves]
    text = ", ".join(parts) if parts else "no arrays"
    return text if treedef.num_leaves == 1 and treedef.num_nodes == 1 else f"{treedef} of {text}"


def check_unchanged_structure(
    tracked: Tracked, before: Sequence[Any], after: Sequence[Any], where: str
) -> None:
    """Raises if a Variable's value changed shape, dtype or pytree structure."""
    # ``before`` may be longer: it also holds array attributes, which are read only.
    for index, (old, new) in enumerate(zip(before, after, strict=False)):
        if old is not new:
            old_sig, new_sig = _signature(old), _signature(new)
            if old_sig != new_sig:
                raise structure_changed(
                    tracked.path(index), _describe(old_sig), _describe(new_sig), where
                )


def _received(
    policy: Any,
    values: Mapping[int, Any],
    received: Sequence[Any] | Mapping[int, Any] | None,
    live: Sequence[Any],
) -> dict[int, Any]:
    """By index, what the evaluations before a boundary left: ``received`` (a cached
    trace's argument, in ``values``' order), else read from the caller's live values (a
    trace made anew at each call, which may close over them)."""
    if isinstance(received, Mapping):
        return {i: received.get(i, values[i]) for i in values}
    if received is not None:
        return dict(zip(values, received, strict=True))
    return policy.current({i: live[i] for i in values})


def run_lifted(
    tracked: Tracked,
    values: Sequence[Any] | Mapping[int, Any] | None,
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    where: str,
    owner: object = None,
    policy: Any = None,
    rebase: bool = False,
    received: Sequence[Any] | Mapping[int, Any] | None = None,
) -> tuple[Any, list[Any]]:
    """Calls ``fn`` with the lifted Variables holding ``values`` (or their current values).

    Must be called inside the trace of the transform that ``where`` names; nested
    neutral calls inside ``fn`` see ``tracked`` (frozen) as the tracked set.

    Args:
      owner: a ``Threads`` call's mark: ``values`` is then ``{index: value}`` of the
        values given, every other tracked value holds a ``Probe`` of ``owner``, and a
        write of one raises ``NeedsState`` too (it must be threaded).
      policy: a ``jaxoverride.solve_state`` participant (``_solve``): ``fn`` receives
        the frozen values (``rebase``: frozen at the call's read already; ``received``,
        in ``values``' order, what the evaluations before the call left) and what it
        leaves is the declaration's.

    Returns:
      ``(fn's output, the Variables' values after the call)``; every Variable is restored
      to its state before the call, also when ``fn`` raises.
    """
    variables = tracked.variables
    count = len(variables)
    saved_values = list(map(RAW.__get__, variables))
    saved_traces = list(map(TRACE.__get__, variables))
    attrs = tracked.attrs
    saved_attrs = [getattr(ref(), name) for ref, name in attrs] if attrs else None
    frame = None
    if policy is not None:
        if owner is not None:
            assert isinstance(values, Mapping)
            before = _received(policy, values, received, saved_values)
            values, frame = entering(policy, tracked, values, rebase, before)
        else:
            assert not isinstance(values, Mapping)
            base = saved_values if values is None else values
            start = dict(enumerate(base[:count]))
            before = _received(policy, start, received, saved_values)
            frozen, frame = entering(policy, tracked, start, rebase, before)
            values = [frozen[i] for i in range(count)] + list(base[count:])
    given: Mapping[int, Any] = {}
    if owner is not None:
        assert isinstance(values, Mapping)
        given = values
        current = saved_values + (saved_attrs or [])
        listed: Sequence[Any] | None = [
            given[i] if i in given else probe_for(owner, i, value)
            for i, value in enumerate(current)
        ]
    else:
        assert not isinstance(values, Mapping)
        listed = values
    state = tracers.TraceState()
    token = ACTIVE.set(tracked.frozen)
    try:
        if listed is not None:
            for variable, value in zip(variables, listed[:count], strict=True):
                RAW.__set__(variable, value)
            for (ref, name), value in zip(attrs, listed[count:], strict=True):
                object.__setattr__(ref(), name, value)
        for variable in variables:
            TRACE.__set__(variable, state)
        try:
            out = fn(*args, **kwargs)
        except TraceContextError as error:
            clearer = explain(error, tracked, where)
            if clearer is error:
                raise
            raise clearer from error
        after = list(map(RAW.__get__, variables))
        if frame is not None:
            assert policy is not None
            indices = [i for i in (given if owner is not None else range(count)) if i < count]
            after, frame = leaving(policy, frame, after, indices), None
    finally:
        if frame is not None and policy is not None:
            policy.pop(frame)
        ACTIVE.reset(token)
        for variable, value, trace in zip(variables, saved_values, saved_traces, strict=True):
            RAW.__set__(variable, value)
            TRACE.__set__(variable, trace)
        if saved_attrs is not None:
            for (ref, name), value in zip(attrs, saved_attrs, strict=True):
                object.__setattr__(ref(), name, value)
    if owner is not None:
        assert listed is not None
        for index, (old, new) in enumerate(zip(listed, after, strict=False)):
            if index not in given and new is not old:
                raise NeedsState(owner, index)  # a write: it must be threaded
    check_unchanged_structure(tracked, saved_values if listed is None else listed, after, where)
    return out, after


def call_plain(
    fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], where: str
) -> Any:
    """Calls the untracked path, turning NNX's bare trace-level error into a clear one."""
    try:
        return fn(*args, **kwargs)
    except TraceContextError as error:
        clearer = explain(error, empty(), where)
        if clearer is error:
            raise
        raise clearer from error


def changed(before: Sequence[Any], after: Sequence[Any]) -> dict[int, Any]:
    """``{index: new value}`` for the Variables whose value object changed.

    ``before`` may be longer than ``after``: it can end with array attributes' values.
    """
    pairs = enumerate(zip(before, after, strict=False))
    return {index: new for index, (old, new) in pairs if new is not old}


def run_given(
    view: Tracked,
    values: dict[int, Any],
    fun: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    where: str,
    owner: object,
    policy: Any = None,
) -> tuple[Any, dict[int, Any], Flag]:
    """Inside a trace: ``fun`` on arguments holding ``NodeRef``s, with the given tracked
    ``values`` (``run_lifted``'s ``owner``): ``(output with NodeRefs, {index: value}
    of the Variables written, whether the output holds refs)``."""
    args, kwargs = from_refs((args, kwargs), view)
    out, after = run_lifted(view, values, fun, args, kwargs, where, owner=owner, policy=policy)
    out, has_refs = to_refs(out, view)
    count = len(view.variables)  # the indices above are array attributes, read only
    updates = {i: after[i] for i in values if i < count and after[i] is not values[i]}
    return out, updates, HAS_REFS if has_refs else NO_REFS


def land(
    view: Tracked, result: tuple[Any, dict[int, Any], Flag], where: str, policy: Any = None
) -> Any:
    """Writes back what the JAX call of a ``run_given`` returned; returns its output."""
    out, updates, refs = result
    write_back(view, written(policy, view, updates), where)
    return from_refs(out, view) if refs.value else out


def static_positions(static: Sequence[int], count: int) -> set[int]:
    """``static`` argnums (negative ones from the end) that exist in a call of ``count``."""
    return {n % count if n < 0 else n for n in static if -count <= n < count}


def named_like(call: Callable[..., Any], fun: Callable[..., Any]) -> Callable[..., Any]:
    """``call`` under ``fun``'s names, module and docstring, so JAX's messages and
    lowerings name the user's function."""
    for attribute in ("__name__", "__qualname__", "__module__", "__doc__"):
        value = getattr(fun, attribute, None)
        if isinstance(value, str):
            setattr(call, attribute, value)
    return call


# -- graph nodes as arguments ---------------------------------------------------------


def graph_objects(tree: Any) -> list[Any]:
    """The distinct graph nodes and Variables in ``tree``, in order of appearance."""
    seen: set[int] = set()
    found = []
    for leaf in jax.tree_util.tree_leaves(tree, is_leaf=is_graph_object):
        if is_graph_object(leaf) and id(leaf) not in seen:
            seen.add(id(leaf))
            found.append(leaf)
    return found


def refuse_modules(tree: Any, where: str, place: str, fix: str) -> None:
    """Raises ``TypeError`` if ``tree`` (``place``: "in xs", "among its primals") holds an
    NNX module or Variable where ``where`` takes only arrays; ``fix`` says what to do."""
    if graph_objects(tree):
        raise TypeError(f"jaxoverride_nnx: {where} got an NNX module or Variable {place}. {fix}")


def with_arguments(tracked: Tracked | None, *trees: Any) -> Tracked | None:
    """The tracked set extended by the graph nodes found in ``trees`` (if any)."""
    objects = []
    for tree in trees:
        objects += graph_objects(tree)
    if not objects:
        return tracked
    base = tracked if tracked is not None else empty()
    fresh = [obj for obj in objects if not base.contains(obj)]
    if not fresh:
        return base.frozen if base.owner is not None else base
    names = [f"{type(obj).__name__}(argument {i})" for i, obj in enumerate(fresh)]
    return base.derive(fresh, names)


def to_refs(tree: Any, tracked: Tracked) -> tuple[Any, bool]:
    """Replaces lifted modules and Variables in ``tree`` by ``NodeRef``s."""
    found = False

    def replace(x: Any) -> Any:
        nonlocal found
        if is_graph_object(x):
            index = tracked.node_index(x)
            if index is not None:
                found = True
                return NodeRef("n", index)
            index = tracked.var_index(x)
            if index is not None:
                found = True
                return NodeRef("v", index)
        return x

    out = jax.tree_util.tree_map(replace, tree, is_leaf=is_graph_object)
    return out, found


def from_refs(tree: Any, tracked: Tracked) -> Any:
    """Replaces ``NodeRef``s in ``tree`` by the objects they stand for."""

    def resolve(x: Any) -> Any:
        if type(x) is NodeRef:
            return tracked.node(x.index) if x.kind == "n" else tracked.variables[x.index]
        return x

    return jax.tree_util.tree_map(resolve, tree, is_leaf=_is_ref_or_object)


def refs_of(tree: Any) -> list[NodeRef]:
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=_is_ref_or_object)
    return [leaf for leaf in leaves if type(leaf) is NodeRef]


def check_same_refs(before: Any, after: Any, what: str, where: str) -> None:
    """A loop carry must hold the same modules, in the same places, on every iteration."""
    old, new = refs_of(before), refs_of(after)
    if old != new:
        raise StructureChangeError(
            f"jaxoverride_nnx: the {what} of {where} held the modules/Variables {old} on "
            f"entry but {new} on return. A carry must hold the same NNX objects in the "
            "same places on every iteration: return the module you were given (its "
            "Variables carry the state), not a new or different one."
        )


def lift_arguments(
    tracked: Tracked | None,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    static: Collection[int] = (),
    static_names: Collection[str] = (),
) -> tuple[Tracked | None, tuple[Any, ...], dict[str, Any]]:
    """``tracked`` extended by the graph nodes in the dynamic arguments (all but the
    positions ``static`` and the names ``static_names``), and the arguments with those
    nodes as ``NodeRef``s; ``(None, args, kwargs)`` where there is nothing to track."""
    dynamic = [a for i, a in enumerate(args) if i not in static]
    view = with_arguments(tracked, dynamic, {k: kwargs[k] for k in kwargs if k not in static_names})
    if view is None:
        return None, tuple(args), kwargs
    refs = lambda x: to_refs(x, view)[0]
    new_args = tuple(a if i in static else refs(a) for i, a in enumerate(args))
    return view, new_args, {k: v if k in static_names else refs(v) for k, v in kwargs.items()}
