"""``jit`` that keeps relative identity and carries non-array leaves as static data.

One ``jax.jit`` per plan (sharing pattern and static data), so the cache never sees an
object id. The hot path recognises a call shaped like the last one without encoding it:
``flatten_up_to`` against the last structure, an identity check of the static leaves, and
distinct ids of the traced leaves; whatever it cannot prove goes through the encoding.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from jax import tree_util as jtu

import jaxoverride as jo
from jaxoverride.adapter_kit import infer_argnums_and_argnames, jit_name
from jaxoverride_dag._axes import spread
from jaxoverride_dag._kinds import ARRAY, DYNAMIC_TYPES, KINDS, SCALAR, kind
from jaxoverride_dag._out import Packed
from jaxoverride_dag._plan import Plan, encode, run_picker
from jaxoverride_dag._shardings import positional_prefix, spread_shardings
from jaxoverride_dag._static_args import Layout, StaticArgs
from jaxoverride_dag._transfer import transfer_shared

_ENTRY_LIMIT = 256
_LABEL = "jit arguments"


class _TraceMismatch(Exception):  # noqa: N818  (a signal, not an error a user sees)
    """Raised inside a trace when the hot path handed JAX leaves of another structure;
    the hot path catches it and takes the slow path."""


def pack_output(out: Any, label: str) -> Any:
    """What a traced function returns: ``out`` itself if JAX can carry it unchanged."""
    plan, dyn = encode(out, label)
    if plan.unshared and not plan.statics:
        return out
    return Packed(tuple(dyn), plan)


def unpack_output(out: Any) -> Any:
    """The caller's view of what ``pack_output`` returned through a transform."""
    return out.unpack() if type(out) is Packed else out


def all_dynamic(leaves: Any) -> bool:
    """Whether every leaf is an array or a Python scalar."""
    for leaf in leaves:
        k = KINDS.get(type(leaf))
        if k is None:
            k = kind(leaf)
        if k not in (ARRAY, SCALAR):
            return False
    return True


def _leaf_shorthand(value: Any) -> bool:
    # A single sharding (or None) applies to every leaf, so it needs no spreading.
    return value is None or jtu.treedef_is_leaf(jtu.tree_structure(value))


class FastPathEntry(NamedTuple):
    """What the hot path needs from an entry whose plan shares nothing; unpacked per call."""

    layout: Layout | None
    flat: int  # the number of positional arguments if they are the traced leaves, else -1
    treedef: Any  # of the ``(args, kwargs)`` pair
    static_pick: Callable[[Sequence[Any]], Sequence[Any]]
    static_values: tuple[Any, ...]
    dyn_pick: Callable[[Sequence[Any]], Sequence[Any]] | None
    fn: Any
    # For a call of one dict of traced leaves: its size, and the getter of its values in
    # JAX's key order (see ``_one_dict``); 0 and None otherwise.
    dict_size: int
    dict_values: Callable[[dict[Any, Any]], tuple[Any, ...]] | None
    # The traced leaves that are not arguments themselves (all of them if None), and the
    # number that are: see ``_REFS_IN_LIST``.
    nested_pick: Callable[[Sequence[Any]], Sequence[Any]] | None
    arguments: int


def _one_dict(treedef: Any, n_dyn: int) -> Callable[[dict[Any, Any]], tuple[Any, ...]] | None:
    """The getter of the values of ``treedef``'s only argument, in JAX's key order, if the
    call is ``f(d)`` with ``d`` a plain dict of ``n_dyn >= 2`` traced leaves (a lookup
    costs a small fraction of flattening, which sorts the keys)."""
    args, kwargs = treedef.children()
    if n_dyn < 2 or kwargs.num_nodes != 1 or args.num_nodes != n_dyn + 2:
        return None
    children = args.children()
    if len(children) != 1:
        return None
    only = children[0]
    node_type, keys = only.node_data()
    if node_type is not dict or only.num_leaves != n_dyn or only.num_nodes != n_dyn + 1:
        return None
    return operator.itemgetter(*keys)


def _nested(plan: Plan) -> tuple[Callable[[Sequence[Any]], Sequence[Any]] | None, int]:
    """The picker of the traced leaves below the arguments, and the number of the others
    (the traced leaves that are arguments themselves)."""
    treedef, slots = plan.root
    top: list[bool] = []
    for part in treedef.children():  # the positional arguments, then the keyword ones
        for child in part.children():
            top += [child.num_nodes == 1 and child.num_leaves == 1] * child.num_leaves
    traced = [is_top for is_top, slot in zip(top, slots, strict=True) if slot < plan.n_dyn]
    arguments = [i for i, is_top in enumerate(traced) if is_top]
    if not arguments:
        return None, 0
    return run_picker([i for i in range(plan.n_dyn) if i not in arguments]), len(arguments)


class _Entry:
    """The compiled side of one plan: its ``jax.jit``, and the hot path's view of it."""

    __slots__ = ("fn", "hot", "layout", "plan")

    def __init__(self, fn: Any, plan: Plan, layout: Layout | None):
        self.fn = fn
        self.plan = plan
        self.layout = layout
        fast = plan.fast_info(skip=2)
        self.hot: FastPathEntry | None = None
        if fast is not None:
            self.hot = FastPathEntry(
                layout,
                fast.flat,
                fast.treedef,
                fast.static_pick,
                fast.static_values,
                fast.dyn_pick,
                fn,
                plan.n_dyn,
                _one_dict(fast.treedef, plan.n_dyn) if not fast.static_values else None,
                *_nested(plan),
            )


class DagJit:
    """Everything a jitted function keeps: options, one entry per plan, the last entry."""

    __slots__ = (
        "__weakref__",  # shared through jaxoverride.reuse_jit
        "_entries",
        "_hot",
        "donate",
        "fun",
        "general",
        "in_tree",
        "jit_kwargs",
        "last",
        "lower_jit",
        "one",
        "out_tree",
        "static",
    )

    def __init__(
        self, fun: Callable[..., Any], jit_kwargs: dict[str, Any], lower_jit: Callable[..., Any]
    ):
        if not callable(fun):
            raise TypeError(f"jaxoverride.jit: expected a callable value, got {fun!r}.")
        kwargs = dict(jit_kwargs)
        # A tree of shardings describes the caller's tree: it is laid over each plan's
        # traced leaves when the plan's entry is made. A single one applies as it is.
        self.in_tree = self.out_tree = None
        if "in_shardings" in kwargs and not _leaf_shorthand(kwargs["in_shardings"]):
            self.in_tree = kwargs.pop("in_shardings")
        if "out_shardings" in kwargs and not _leaf_shorthand(kwargs["out_shardings"]):
            self.out_tree = kwargs.pop("out_shardings")
        static = infer_argnums_and_argnames(
            fun, kwargs.pop("static_argnums", None), kwargs.pop("static_argnames", None)
        )
        self.donate = infer_argnums_and_argnames(
            fun, kwargs.pop("donate_argnums", None), kwargs.pop("donate_argnames", None)
        )
        self.fun = fun
        self.jit_kwargs = kwargs
        self.lower_jit = lower_jit
        self.static = StaticArgs(*static)
        self._entries: dict[Any, _Entry] = {}
        # The hot path's view of the last entry that has one, and of one per structure.
        self.last: FastPathEntry | None = None
        self._hot: dict[Any, FastPathEntry] = {}
        # Every call but one array (see ``_hot_path``); ``one_general`` is it for one.
        self.general = _general_path(self)
        # The last entry's ``jax.jit`` if it takes one array, for the commonest call;
        # else ``one_general``, so that the one-array call needs no test of it.
        self.one: Callable[[Any], Any] = self.one_general

    def resolve(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[_Entry, tuple[Any, ...], list[Any]]:
        """The entry for this call, the static prefix to pass, and the traced leaves."""
        layout: Layout | None = None
        static_values: tuple[Any, ...] = ()
        if self.static:
            layout, static_values, args, kwargs = self.static.split(args, kwargs)
        plan, dyn = encode((args, kwargs), _LABEL, "call")
        key = plan if layout is None else (layout, plan)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._make_entry(plan, layout, args, kwargs, (*static_values, *dyn))
            if len(self._entries) >= _ENTRY_LIMIT:
                self._entries.clear()
            self._entries[key] = entry
        return entry, static_values, dyn

    def compiled(self) -> list[Any]:
        """The ``jax.jit`` of every plan that a call may still run."""
        hot = [*list(self._hot.values()), *([self.last] if self.last is not None else [])]
        functions = [entry.fn for entry in list(self._entries.values())] + [h.fn for h in hot]
        return list({id(fn): fn for fn in functions}.values())

    def call_slow(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call the hot path could not take: another structure, sharing, a new entry."""
        found = self._hot_for_structure(args, kwargs)
        if found is not None:
            hot, prefix, dyn = found
            self._set_last(hot)
            return unpack_output(hot.fn(*prefix, *dyn))
        entry, prefix, dyn = self.resolve(args, kwargs)
        # A plan that the hot path cannot take leaves none to try: a call like this one
        # then comes straight here, instead of failing the last entry's checks or trace.
        self._set_last(entry.hot)
        if entry.hot is not None:
            if len(self._hot) >= _ENTRY_LIMIT:
                self._hot.clear()
            self._hot[(entry.layout, entry.hot.treedef)] = entry.hot
        if not entry.plan.unshared:
            dyn = transfer_shared(dyn, self.jit_kwargs)
        return unpack_output(entry.fn(*prefix, *dyn))

    def _set_last(self, hot: FastPathEntry | None) -> None:
        self.last = hot
        self.one = hot.fn if hot is not None and hot.flat == 1 else self.one_general

    def one_general(self, arg: Any) -> Any:
        """A call of one array while the last entry takes something else."""
        return self.general((arg,), {})

    def _hot_for_structure(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[FastPathEntry, tuple[Any, ...], Any] | None:
        # A structure seen before, unshared: one flatten and a lookup, instead of encoding.
        if not self._hot:
            return None
        layout: Layout | None = None
        prefix: tuple[Any, ...] = ()
        if self.static:
            layout, values, args, kwargs = self.static.split(args, kwargs)
            prefix = values
        leaves, treedef = jtu.tree_flatten((args, kwargs))
        hot = self._hot.get((layout, treedef))
        if hot is None:
            return None
        if hot.static_values and not all(
            map(operator.is_, hot.static_pick(leaves), hot.static_values)
        ):
            return None
        dyn = leaves if hot.dyn_pick is None else hot.dyn_pick(leaves)
        if len(set(map(id, dyn))) != len(dyn) or not all_dynamic(dyn):
            return None
        return hot, prefix, dyn

    def _make_entry(
        self,
        plan: Plan,
        layout: Layout | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        inputs: tuple[Any, ...],
    ) -> _Entry:
        fun, n = self.fun, plan.n_dyn
        # Each static value is a static argument of its own, so that JAX hashes (and
        # names, when it cannot) each one as it would under jax.jit.
        offset = 0 if layout is None else len(layout[1]) + len(layout[2])

        def traced(*inputs: Any) -> Any:
            dyn = inputs[offset:]
            if len(dyn) != n or not all_dynamic(dyn):
                raise _TraceMismatch
            rest, rest_kwargs = plan.decode_inside(dyn)
            if layout is not None:
                rest, rest_kwargs = StaticArgs.merge(layout, inputs[:offset], rest, rest_kwargs)
            return pack_output(fun(*rest, **rest_kwargs), "jit outputs")

        options = dict(self.jit_kwargs)
        if offset:
            options["static_argnums"] = tuple(range(offset))
        donated = self._donated(plan, layout, args, kwargs)
        if donated:
            options["donate_argnums"] = tuple(offset + i for i in donated)
        # Named as JAX names ``fun`` (a partial by its function), so lowerings match.
        traced.__name__ = jit_name(fun)
        traced.__qualname__ = getattr(fun, "__qualname__", traced.__name__)
        if self.in_tree is not None:
            options["in_shardings"] = self._in_shardings(plan, args, kwargs)
        if self.out_tree is not None:
            options["out_shardings"] = self._out_shardings(traced, options, inputs)
        return _Entry(self.lower_jit(traced, **options), plan, layout)

    def _in_shardings(
        self, plan: Plan, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, ...]:
        if kwargs:
            raise ValueError(
                "jaxoverride_dag.jit: keyword arguments cannot be passed when in_shardings "
                "is a tree (jax.jit does not support kwargs when in_shardings is specified). "
                "Fix: pass them positionally."
            )
        prefix = positional_prefix(self.in_tree, len(args), "jit", "in_shardings")
        return spread_shardings(plan, (prefix, {}), api="jit", what="in_shardings")

    def _out_shardings(
        self, traced: Callable[..., Any], options: dict[str, Any], inputs: tuple[Any, ...]
    ) -> Any:
        # ``jax.jit`` matches out_shardings against the output tree after tracing, but
        # with the plan in the tree's structure the tree of shardings must already hold
        # it: one abstract trace finds the output plan.
        out = self.lower_jit(traced, **options).eval_shape(*inputs)
        if type(out) is not Packed:
            return self.out_tree
        assert out.plan is not None
        return Packed(
            spread_shardings(out.plan, self.out_tree, api="jit", what="out_shardings"), out.plan
        )

    def _donated(
        self, plan: Plan, layout: Layout | None, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[int, ...]:
        nums, names = self.donate
        if not nums and not names:
            return ()
        count = layout[0] if layout is not None else len(args)
        positions = layout[1] if layout is not None else ()
        donated_positions = {i % count for i in nums if -count <= i < count}
        original = [i for i in range(count) if i not in positions]
        flags = (
            tuple(i in donated_positions for i in original),
            {name: name in names for name in kwargs},
        )
        marks = spread(
            plan, flags, api="jit", what="donate_argnums", noun="donation", merge=operator.or_
        )
        return tuple(i for i, flag in enumerate(marks) if flag)


def dag_jit(fun: Callable[..., Any], /, **options: Any) -> Callable[..., Any]:
    """The ``"jit"`` override: ``jax.jit``'s signature, identity-preserving result.

    The returned function has JAX's jitted-function API (``lower``, ``trace``,
    ``eval_shape``, ``clear_cache``), over the ``jax.jit`` of the arguments' plan.
    """
    below = jo.next_impl("jit")
    # One state per function and options, shared by every wrapper of them (as jax.jit
    # shares its cache): ``jo.jit(f)(x)`` built again compiles nothing again.
    options_key = tuple(sorted(options.items()))
    state = jo.reuse_jit(fun, (DagJit, options_key, below), lambda: DagJit(fun, options, below))

    def stage(method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        entry, prefix, dyn = state.resolve(args, kwargs)
        staged = getattr(entry.fn, method)(*prefix, *dyn)
        return unpack_output(staged) if method == "eval_shape" else staged

    hot_path = _hot_path if not state.static else _hot_path_static

    def direct(current: Any, stack: Any, fallback: Callable[..., Any]) -> Callable[..., Any]:
        return hot_path(state, (current, stack, fallback))

    jitted = jo.jit_api(hot_path(state), fun, stage=stage, jitted=state.compiled, direct=direct)
    jitted._jaxoverride_dag_state = state  # type: ignore[attr-defined]
    return jitted


# The hot paths keep the commonest call (one array) in one small frame, a few arrays in
# one frame more: each frame is a measurable share of a cache hit of a few microseconds.
# Each returns what the last entry computes, or falls back to ``call_slow``.
#
# Distinct traced leaves are proven by reference counts first (a set of ids costs twice
# as much). A leaf that ``flatten_up_to`` put into its fresh list once and that the tree
# holds once has ``_REFS_IN_LIST`` references (the tree, the list, getrefcount's
# argument), one more if also picked into a tuple; a leaf in the list twice has more, so
# ``max(refs) <= most`` proves none repeats, and a larger count only sends the check on to
# the set of ids. Leaves that are arguments themselves are also held by the frames' argument
# tuples, so only the other leaves are counted (two such arguments: the set of ids).
# Over three containers (list, picked tuple, tuple of the leaves below the arguments) a
# leaf occurring twice has at least 2 x 3 + 1 references, one occurring once 5: up to
# ``_MOST_OF_THREE`` proves it too, tolerating one holder more (``eqx.partition``'s).
_REFS_IN_LIST = 3
_MOST_OF_THREE = 6


def _dynamic(
    flatten: Callable[[Any], list[Any]],
    call: Any,
    static_pick: Any,
    static_values: Any,
    dyn_pick: Any,
) -> list[Any] | None:
    """The dynamic leaves of ``call`` (``(args, kwargs)``) when it matches the last
    trace: same structure, the same static objects, and no array passed twice (a new
    sharing); ``None`` when the slow path must decide."""
    try:
        leaves = flatten(call)
    except Exception:
        return None
    if static_values and not all(map(operator.is_, static_pick(leaves), static_values)):
        return None
    if dyn_pick is None:
        dyn, most = leaves, _REFS_IN_LIST
    else:
        dyn, most = dyn_pick(leaves), _REFS_IN_LIST + 1
    twice = len(dyn) > 1 and max(map(sys.getrefcount, dyn)) > most
    if twice and len(set(map(id, dyn))) != len(dyn):
        return None
    return dyn


def _recover(
    error: Exception,
    dyn: Sequence[Any],
    call_slow: Callable[[tuple[Any, ...], dict[str, Any]], Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """After the compiled call raised ``error``: JAX's own error (every argument was an
    array it accepts) is raised; anything else means that the last trace no longer fits,
    and the slow path decides."""
    if not isinstance(error, _TraceMismatch) and all_dynamic(dyn):
        raise error
    return call_slow(args, kwargs)


_NO_ARGUMENT: Any = object()
# ``(current, stack, fallback)`` of a direct call (see ``jaxoverride.jit_api``): the hot
# path then first checks that its stack is the caller's, in the same frame.
Direct = tuple[Callable[[], object], object, Callable[..., Any]]


def _hot_path(state: DagJit, direct: Direct | None = None) -> Callable[..., Any]:
    # The commonest call, one array, is taken in a frame of its own that holds nothing
    # else: a frame's cost grows with its free variables (copied in on every call) and
    # its locals (cleared on every return), and the one-array call is all frame. Taking
    # the first argument apart from the rest tests "one argument" and reads it in two
    # steps instead of five. Every other call goes on to ``state.general``, one call
    # further, with the arguments put back together.
    general = state.general
    dynamic_types = DYNAMIC_TYPES
    packed = Packed
    nothing = _NO_ARGUMENT
    current, stack, fallback = direct or (None, None, None)

    def jitted(first: Any = nothing, /, *args: Any, **kwargs: Any) -> Any:
        if current is not None and current() is not stack:
            args = args if first is nothing else (first, *args)
            return fallback(*args, **kwargs)  # type: ignore[misc]
        if not args and not kwargs and type(first) in dynamic_types:
            one = state.one  # the last entry's jax.jit, else ``general``'s
            out = one(first)
            return out.unpack() if type(out) is packed else out
        return general(args if first is nothing else (first, *args), kwargs)

    return jitted


def _general_path(state: DagJit) -> Callable[[tuple[Any, ...], dict[str, Any]], Any]:
    """What a call that is not one array costs: ``general(args, kwargs)``."""
    call_slow = state.call_slow
    dynamic_types = DYNAMIC_TYPES
    getrefcount = sys.getrefcount
    is_ = operator.is_
    packed = Packed

    def general(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        last = state.last
        if last is None:
            return call_slow(args, kwargs)
        (_, flat, treedef, static_pick, static_values, dyn_pick, fn, size, dict_values,
         nested_pick, arguments) = last  # fmt: skip
        dyn: Any = None
        if flat == len(args) and flat <= 8 and not kwargs:
            for arg in args:
                if type(arg) not in dynamic_types:
                    break
            else:
                dyn = args
                if flat > 1 and len(set(map(id, dyn))) != flat:
                    return call_slow(args, kwargs)
        elif (
            dict_values is not None
            and len(args) == 1
            and not kwargs
            and type(args[0]) is dict
            and len(args[0]) == size
        ):
            # A dict of the last call's keys: its values, in JAX's order, are the traced
            # leaves if each is one (else the trace raises _TraceMismatch). Each
            # value is held by the dict and the tuple alone unless it occurs twice.
            try:
                dyn = dict_values(args[0])
            except KeyError:
                return call_slow(args, kwargs)
            if max(map(getrefcount, dyn)) > _REFS_IN_LIST and len(set(map(id, dyn))) != size:
                return call_slow(args, kwargs)
        if dyn is None:
            # ``_dynamic``, inlined: a frame is a measurable share of a cache hit.
            try:
                leaves = treedef.flatten_up_to((args, kwargs))
            except Exception:
                return call_slow(args, kwargs)
            if static_values and not all(map(is_, static_pick(leaves), static_values)):
                return call_slow(args, kwargs)
            if dyn_pick is None:
                dyn, most = leaves, _REFS_IN_LIST
            else:
                dyn, most = dyn_pick(leaves), _REFS_IN_LIST + 1
            if len(dyn) > 1:
                if nested_pick is None:
                    nested = dyn
                else:
                    nested = nested_pick(dyn)
                    most = _MOST_OF_THREE if dyn_pick is not None else most + 1
                maybe_twice = arguments > 1 or max(map(getrefcount, nested), default=0) > most
                if maybe_twice and len(set(map(id, dyn))) != len(dyn):
                    return call_slow(args, kwargs)
        try:
            out = fn(*dyn)
        except (_TraceMismatch, TypeError) as error:
            return _recover(error, dyn, call_slow, args, kwargs)
        return out.unpack() if type(out) is packed else out

    return general


def _hot_path_static(state: DagJit, direct: Direct | None = None) -> Callable[..., Any]:
    call_slow = state.call_slow
    split = state.static.split
    current, stack, fallback = direct or (None, None, None)

    def jitted(*args: Any, **kwargs: Any) -> Any:
        if current is not None and current() is not stack:
            return fallback(*args, **kwargs)  # type: ignore[misc]
        last = state.last
        if last is None:
            return call_slow(args, kwargs)
        layout, _, treedef, static_pick, static_values, dyn_pick, fn, _, _, _, _ = last
        this_layout, values, rest, rest_kwargs = split(args, kwargs)
        if this_layout != layout:
            return call_slow(args, kwargs)
        call = (rest, rest_kwargs)
        dyn = _dynamic(treedef.flatten_up_to, call, static_pick, static_values, dyn_pick)
        if dyn is None:
            return call_slow(args, kwargs)
        try:
            out = fn(*values, *dyn)
        except (_TraceMismatch, TypeError) as error:
            return _recover(error, dyn, call_slow, args, kwargs)
        return out.unpack() if type(out) is Packed else out

    return jitted
