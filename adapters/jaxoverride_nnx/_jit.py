"""The ``jit`` override: one inner ``jax.jit`` per tracked set, fed the Variables' values.

A call reads the lifted Variables' raw values into a flat list, passes it first to the
inner jitted function and stores back only the values the trace showed to change. Builds
are keyed on the tracked set's ``TrackKey`` in a table that holds no module, so weights
are never baked in and a dead module's entries are pruned. A repeated call is served
from the flat plan (``_plan``) that the general path last kept; every trace of a build
returns the first's layout (``_Build.layout``), else it gets a general build that
returns ``(output, {index: value})``.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

import jaxoverride as jo
from jaxoverride.adapter_kit import (
    TraceAbort,
    declarations_entered,
    infer_argnums_and_argnames,
    jit_name,
    shift_argnums,
)
from jaxoverride_nnx import _tracked
from jaxoverride_nnx._compat import RAW_VALUE
from jaxoverride_nnx._errors import untracked_static
from jaxoverride_nnx._graph import RAW, holds_state, is_graph_object
from jaxoverride_nnx._lift import (
    call_plain,
    from_refs,
    lift_arguments,
    named_like,
    run_lifted,
    static_positions,
    to_refs,
    write_back,
)
from jaxoverride_nnx._probes import NeedsState, check_given
from jaxoverride_nnx._reach import reached
from jaxoverride_nnx._solve import declared_values, frozen_key, policy_for, written
from jaxoverride_nnx._touched import check_carried, module_of, referenced
from jaxoverride_nnx._tracked import ACTIVE, Tracked

_WHERE = "jaxoverride.jit"
_GET = RAW.__get__
_SET = RAW.__set__
_JIT_SIGNATURE = inspect.signature(jax.jit)
_ARRAY = type(jnp.zeros(()))
_PLAIN_TYPES = frozenset({_ARRAY, np.ndarray, int, float, bool, complex, np.float32, np.int32})
_READ = operator.attrgetter(RAW_VALUE)
_CLEAN_LIMIT = 256
# ``hot`` of a call with nothing to serve: no tracked set is this object, no epoch is -1.
_COLD = (object(), -1, None, (), (), False, None)


class NnxJit:
    """What ``jaxoverride.jit(fun)`` runs while the NNX overrides are active."""

    def __init__(
        self,
        fun: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        below: Callable[..., Any],
    ):
        self._fun = fun
        self._below = below
        options = dict(_JIT_SIGNATURE.bind(fun, *args, **kwargs).arguments)
        del options["fun"]
        static = infer_argnums_and_argnames(
            fun, options.pop("static_argnums", None), options.pop("static_argnames", None)
        )
        donate = infer_argnums_and_argnames(
            fun, options.pop("donate_argnums", None), options.pop("donate_argnames", None)
        )
        self._static_nums, self._static_names = static
        # A trace is cached by its static arguments: what they reach is checked where it
        # is traced (``_check_static``), never per call.
        self._plain = below(self._checking_static(fun) if any(static) else fun, *args, **kwargs)
        options["static_argnums"] = shift_argnums(static[0])
        options["static_argnames"] = static[1]
        if donate[0] or donate[1]:
            options["donate_argnums"] = shift_argnums(donate[0])
            options["donate_argnames"] = donate[1]
        # The Variables' values come first and keep their own placement (``None``); the
        # user's shardings apply to the user's arguments and outputs only. A single
        # sharding stands for one per positional argument, so it needs the arity: such a
        # jit keeps one trace per (tracked set, argument count).
        in_shardings = options.get("in_shardings")
        self._per_arity: Any = None
        if isinstance(in_shardings, (tuple, list)):
            options["in_shardings"] = (None, *in_shardings)
        elif in_shardings is not None:
            self._per_arity = in_shardings
        self._sharded_out = "out_shardings" in options
        if self._sharded_out:
            options["out_shardings"] = (options["out_shardings"], None, None)
        self._options = options
        self._cache: dict[Any, Any] = {}
        self._deaths = _tracked.deaths()
        self._clean: set[Any] = set()
        functools.update_wrapper(self, fun, updated=())  # type: ignore[arg-type]
        self.call = self._make_call()

    # -- the call ---------------------------------------------------------------------
    def _make_call(self) -> Callable[..., Any]:
        """What ``jaxoverride.jit`` runs: a closure (cheaper to call than an object)."""
        fun, plain, cache, compile_, clean, with_nodes, retry = (
            self._fun,
            self._plain,
            self._cache,
            self._compile,
            self._clean_arguments,
            self._call_with_nodes,
            self._retry,
        )
        # ``last`` (key, build) and ``hot`` (the plan) are tuples replaced whole, so another
        # thread reads one or the other, never a mix. A plan serves calls with its tracked
        # set, no structural change since and plain positional arguments.
        last: list[Any] = [(None, None)]
        hot: list[Any] = [_COLD]
        per_arity = self._per_arity
        active_get = ACTIVE.get
        any_declaration = declarations_entered
        plain_types = _PLAIN_TYPES
        scope = _tracked

        def serving(
            miss: Callable[[tuple[Any, ...], dict[str, Any]], Any],
            direct: tuple[Any, ...] | None = None,
            mark: list[Any] | None = None,
        ) -> Callable[..., Any]:
            """The hot path; with ``direct``, of a ``checked_direct`` call: it serves only
            in its stack, while ``captured()`` is what ``mark`` says passed the check."""
            current, stack, fallback, captured = direct or (None, None, None, None)

            def hot_call(*args: Any, **kwargs: Any) -> Any:
                if any_declaration():  # under jaxoverride.solve_state: no flat plan (see general)
                    return miss(args, kwargs)
                plan = hot[0]
                tracked, epoch, jitted, reads, writes, refs, build = plan
                if current is not None:
                    if current() is not stack:
                        return fallback(*args, **kwargs)  # type: ignore[misc]
                    marked = mark[0]  # type: ignore[index]
                    if marked[0] is not plan or marked[1] is not captured():  # type: ignore[misc]
                        return miss(args, kwargs)
                if tracked is active_get() and epoch == scope._epoch and not kwargs:
                    for arg in args:
                        if type(arg) not in plain_types:
                            break
                    else:
                        try:
                            result = jitted(list(map(_READ, reads)), *args)
                        except (NeedsState, LayoutChanged) as error:
                            if error.owner is not build:
                                raise
                            error.release()
                            hot[0] = _COLD
                            return miss(args, kwargs)
                        if not writes:
                            return from_refs(result, tracked) if refs else result
                        out, values = result
                        if type(values[0]) is not _ARRAY and isinstance(values[0], Tracer):
                            write_back(tracked, build.unpack(result)[1], _WHERE)  # all or none
                        elif len(writes) == 1:  # a counter, a step: the usual case, no loop
                            _SET(writes[0], values[0])
                        else:
                            for variable, value in zip(writes, values, strict=True):
                                _SET(variable, value)
                        return from_refs(out, tracked) if refs else out
                return miss(args, kwargs)

            return hot_call

        def checked_direct(
            current: Callable[[], object],
            stack: object,
            fallback: Callable[..., Any],
            captured: Callable[[], Any],
        ) -> Callable[..., Any]:
            # (plan, the check's token) once a call passed the check with the plan's
            # tracked set active at its epoch: the captured object is then known covered.
            mark: list[Any] = [(_COLD, _COLD)]

            def checked(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                out = fallback(*args, **kwargs)
                token = captured()
                plan = hot[0]
                if token is not None and plan[0] is active_get() and plan[1] == scope._epoch:
                    mark[0] = (plan, token)
                return out

            return serving(checked, (current, stack, fallback, captured), mark)

        def general(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            tracked = ACTIVE.get()
            if tracked is not None and tracked.epoch != _tracked._epoch and tracked.owner:
                tracked.owner.refresh(tracked)
            if kwargs:
                if not clean(args, kwargs):
                    return with_nodes(tracked, args, kwargs)
            else:
                for arg in args:
                    if type(arg) not in _PLAIN_TYPES:
                        if not clean(args, kwargs):
                            return with_nodes(tracked, args, kwargs)
                        break
            if tracked is None:
                return call_plain(plain, args, kwargs, _WHERE)
            key: Any = tracked.key if per_arity is None else (tracked.key, len(args))
            # Under jaxoverride.solve_state the values are frozen at this read and the
            # trace leaves the declaration's state: a build of its own, per frozen set.
            policy = policy_for(tracked)
            if policy is not None:
                marker = frozen_key(policy, tracked)
                key = (tracked.key, marker) if per_arity is None else (*key, marker)
            pair = last[0]
            if key is pair[0]:
                build = pair[1]
            else:
                build = cache.get(key) or compile_(key, tracked)
                last[0] = (key, build)
            reads = None
            try:
                if tracked.owner is None:  # inside a neutral transform: see _call_hidden
                    values = build.read(tracked, (fun, args, kwargs))
                    if policy is not None:
                        values = declared_values(policy, tracked, build.order, values)
                    result = _call_hidden(build.jitted, tracked, values, args, kwargs)
                else:
                    if build.attrs:
                        values = build.read(tracked, (fun, args, kwargs))
                    else:
                        # A structurally equal tracked set (a submodule replaced by a like
                        # one) shares the build: read its own Variables, not the build's.
                        reads = build.variables_of(tracked)
                        values = list(map(_GET, reads))
                        check_carried(tracked, build.var_order, values, (fun, args, kwargs))
                    if policy is not None:
                        values = declared_values(policy, tracked, build.order, values)
                    result = build.jitted(values, *args, **kwargs)
            except (NeedsState, LayoutChanged) as error:
                if error.owner is not build:
                    raise
                error.release()
                hot[0] = _COLD
                retry(key, tracked, error)
                last[0] = (None, None)
                return general(args, kwargs)
            out, updates, refs = build.unpack(result)
            if policy is not None:
                updates = written(policy, tracked, updates or {})
            if updates:
                # One jitted call's outputs are all concrete or all tracers of one trace.
                if isinstance(next(iter(updates.values())), Tracer):
                    write_back(tracked, updates, _WHERE)  # checks the trace level first
                else:
                    variables = tracked.variables
                    for index, value in updates.items():
                        _SET(variables[index], value)
            if (
                reads is not None
                and policy is None
                and per_arity is None
                and tracked.epoch == _tracked._epoch
                and build.layout is not None
                and _reads_the_slot(reads)
            ):
                hot[0] = _plan(tracked, build, reads)
            return from_refs(out, tracked) if refs else out

        call = serving(general)
        call.tracked_jit = self  # type: ignore[attr-defined]
        functools.update_wrapper(call, self._fun, updated=())
        return jo.jit_api(
            call,
            self._fun,
            stage=self._stage,
            jitted=self._jitted,
            checked_direct=checked_direct if per_arity is None else None,
        )

    def _retry(self, key: Any, tracked: Tracked, error: NeedsState | LayoutChanged) -> None:
        """Rebuilds with the module a probe found, or general after a ``LayoutChanged``."""
        build = self._cache[key]
        if isinstance(error, LayoutChanged):
            self._cache[key] = self._build(key, tracked, build.given, general=True)
        else:
            self._cache[key] = self._build(
                key, tracked, build.given | module_of(tracked, error.index), build.general
            )

    def _call_with_nodes(
        self, tracked: Tracked | None, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        originals = (args, kwargs)
        key, view, args, kwargs = self._lift_arguments(tracked, args, kwargs)
        policy = policy_for(view)
        if policy is not None:
            key = (*(key if type(key) is tuple else (key,)), frozen_key(policy, view))
        result, build = self._on_build(key, view, None, args, kwargs, originals, policy)
        out, updates, refs = build.unpack(result)
        if policy is not None:
            updates = written(policy, view, updates or {})
        if updates:
            write_back(view, updates, _WHERE)
        return from_refs(out, view) if refs else out

    def _lift_arguments(
        self, tracked: Tracked | None, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, Tracked, tuple[Any, ...], dict[str, Any]]:
        """The build key, the tracked set with the graph nodes among the dynamic arguments,
        and the arguments with those as ``NodeRef``s."""
        static = static_positions(self._static_nums, len(args))
        view, args, kwargs = lift_arguments(tracked, args, kwargs, static, self._static_names)
        assert view is not None
        return self._key(view, args), view, args, kwargs

    def _check_static(
        self, tracked: Tracked | None, args: Sequence[Any], kwargs: dict[str, Any]
    ) -> None:
        """Raises if a static argument reaches NNX state that ``tracked`` does not hold.

        Called where JAX traces, so only once per cache entry: JAX caches the trace by
        the static arguments, and what they reach is read there as constants.
        """
        if not (self._static_nums or self._static_names):
            return
        positions = sorted(static_positions(self._static_nums, len(args)))
        statics = [(f"static argument {i}", args[i]) for i in positions]
        statics += [
            (f"static argument {k!r}", v) for k, v in kwargs.items() if k in self._static_names
        ]
        for name, found in reached(statics):
            if (tracked is None or not tracked.contains(found)) and holds_state(found):
                raise untracked_static(
                    _WHERE, name, found, tracked is not None and bool(tracked.variables)
                )

    def _checking_static(self, fun: Callable[..., Any]) -> Callable[..., Any]:
        """``fun``, checking its static arguments first (see ``_check_static``): the
        function that the untracked path's ``jax.jit`` traces."""
        check = self._check_static

        def checked(*args: Any, **kwargs: Any) -> Any:
            check(None, args, kwargs)
            return fun(*args, **kwargs)

        # Named as JAX names ``fun`` (a partial by its function), with its signature.
        checked.__name__ = checked.__qualname__ = jit_name(fun)
        functools.update_wrapper(checked, fun, updated=())
        return checked

    def _clean_arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """True when no dynamic argument holds an NNX graph node (checked cheaply: the
        call's plain arrays are tested by ``general`` before)."""
        static = static_positions(self._static_nums, len(args)) if self._static_nums else ()
        dynamic = (
            [a for i, a in enumerate(args) if i not in static],
            {k: v for k, v in kwargs.items() if k not in self._static_names},
        )
        try:
            treedef = jax.tree_util.tree_structure(dynamic)
            if treedef in self._clean:
                return True
        except Exception:  # an argument that is not a pytree: let the slow path decide
            treedef = None
        leaves = jax.tree_util.tree_leaves(dynamic, is_leaf=is_graph_object)
        if any(is_graph_object(leaf) for leaf in leaves):
            return False
        if treedef is not None and len(self._clean) < _CLEAN_LIMIT:
            self._clean.add(treedef)
        return True

    # -- building ---------------------------------------------------------------------
    def _key(self, tracked: Tracked, args: tuple[Any, ...]) -> Any:
        return tracked.key if self._per_arity is None else (tracked.key, len(args))

    def _compile(self, key: Any, tracked: Tracked, arguments: Any = ()) -> _Build:
        if self._deaths != _tracked.deaths():
            self._deaths = _tracked.deaths()
            for stale in [k for k in self._cache if not (k[0] if type(k) is tuple else k).alive()]:
                del self._cache[stale]
        build = self._build(key, tracked, referenced(tracked, [self._fun, arguments]))
        self._cache[key] = build
        return build

    def _build(
        self, key: Any, tracked: Tracked, given: frozenset[int], general: bool = False
    ) -> _Build:
        """A ``jax.jit`` of the function given the tracked values ``given`` (see
        ``_touched``: at first none; a module it touches is added when found), returning
        the general layout where ``general`` or the output has shardings."""
        options = self._options
        if self._per_arity is not None:
            count = key[1]
            dynamic = count - len(static_positions(self._static_nums, count))
            options = {**options, "in_shardings": (None, *[self._per_arity] * dynamic)}
        build = _Build(tracked, given, general or self._sharded_out)
        build.jitted = self._below(self._lifted(build), **options)
        return build

    def _lifted(self, build: _Build) -> Callable[..., Any]:
        fun = self._fun
        sharded_out = self._sharded_out
        order = build.order
        check_static = self._check_static

        def lifted(values: list[Any], *args: Any, **kwargs: Any) -> Any:
            tracked = ACTIVE.get() or _HIDDEN.get()
            assert tracked is not None
            check_static(tracked, args, kwargs)
            args, kwargs = from_refs((args, kwargs), tracked)
            policy = policy_for(tracked)
            received = None
            if policy is not None:  # the caller hands (frozen, received): declared_values
                values, received = values
                received = values if received is None else received
            given = dict(zip(order, values, strict=True))
            out, after = run_lifted(
                tracked,
                given,
                fun,
                args,
                kwargs,
                _WHERE,
                owner=build,
                policy=policy,
                rebase=True,
                received=received,
            )
            out, has_refs = to_refs(out, tracked)
            written = tuple(i for i in build.var_order if after[i] is not given[i])
            if build.general:
                updates = {i: after[i] for i in written}
                # The arity says whether the output holds NodeRefs. With ``out_shardings``
                # it is fixed (the shardings are a prefix of the output).
                if has_refs or sharded_out:
                    return out, updates, None
                return out, updates
            build.settle((written, has_refs))
            return (out, tuple(after[i] for i in written)) if written else out

        # Named as JAX names ``fun`` (a partial by its function, an object as unnamed), so
        # compilations and lowerings carry the user's name.
        lifted.__name__ = lifted.__qualname__ = jit_name(fun)
        return named_like(lifted, fun)

    # -- the jitted function's other entry points -------------------------------------
    def _entry(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, Tracked | None, tuple[Any, ...], dict[str, Any]]:
        tracked = _tracked.current()
        if self._clean_arguments(args, kwargs):
            if tracked is None:
                return None, None, args, kwargs
            return self._key(tracked, args), tracked, args, kwargs
        return self._lift_arguments(tracked, args, kwargs)

    def _on_build(
        self,
        key: Any,
        view: Tracked,
        method: str | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        arguments: Any = (),
        policy: Any = None,
    ) -> tuple[Any, _Build]:
        """``build.jitted(values, ...)`` (or its ``method``), adding each module the function
        touches, and the build that ran; ``arguments``, the call's own, guide a first
        build (see ``_compile``)."""
        while True:
            build = self._cache.get(key) or self._compile(key, view, arguments)
            token = ACTIVE.set(view)
            try:
                jitted = build.jitted if method is None else getattr(build.jitted, method)
                values = build.read(view, (self._fun, args, kwargs))
                if policy is not None:
                    values = declared_values(policy, view, build.order, values)
                return jitted(values, *args, **kwargs), build
            except (NeedsState, LayoutChanged) as error:
                if error.owner is not build:
                    raise
                error.release()
                self._retry(key, view, error)
            finally:
                ACTIVE.reset(token)

    def _stage(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``lower``, ``trace`` or ``eval_shape`` of the lifted function, whose first
        argument is the list of Variable values; ``eval_shape`` changes no module."""
        key, view, args, kwargs = self._entry(args, kwargs)
        if view is None:
            return getattr(self._plain, method)(*args, **kwargs)
        result, build = self._on_build(key, view, method, args, kwargs)
        if method != "eval_shape":
            return result
        out, _, refs = build.unpack(result)
        return from_refs(out, view) if refs else out

    def _jitted(self) -> list[Any]:
        return [self._plain, *(build.jitted for build in self._cache.values())]

    def __repr__(self) -> str:
        return f"<jaxoverride_nnx jit of {self._fun!r}>"


class LayoutChanged(TraceAbort):
    """A trace of a build returned another layout than its first (``_Build.settle``); a
    ``TraceAbort``, never seen outside the adapter."""

    def __init__(self, owner: _Build):
        super().__init__(owner)
        self.owner = owner


_LAYOUT_LOCK = threading.Lock()


class _Build:
    """One ``jax.jit`` of the lifted function for a tracked set, given the tracked values
    ``given`` (as a list in ``order``). ``layout``: ``(indices written, whether the
    output holds modules)`` of its first trace, which later traces must match unless
    ``general`` (then it returns ``(out, {index: value}[, refs])``)."""

    __slots__ = (
        "attrs",
        "general",
        "given",
        "jitted",
        "layout",
        "order",
        "source",
        "var_order",
        "variables",
    )

    def __init__(self, tracked: Tracked, given: frozenset[int], general: bool = False):
        count = len(tracked.variables)
        self.general = general
        self.layout: tuple[tuple[int, ...], bool] | None = None
        self.given = given
        self.order = tuple(sorted(given))
        self.var_order = tuple(i for i in self.order if i < count)
        self.source = tracked.variables
        self.variables = [tracked.variables[i] for i in self.var_order]
        self.attrs = len(self.var_order) != len(self.order)
        self.jitted: Any = None

    def variables_of(self, tracked: Tracked) -> list[Any]:
        """The given Variables of ``tracked``: the build is keyed on the tracked set's
        structure, which a set of other, like Variables shares."""
        variables = tracked.variables
        if variables is self.source:
            return self.variables
        return [variables[i] for i in self.var_order]

    def settle(self, layout: tuple[tuple[int, ...], bool]) -> None:
        """Records the layout of a trace; raises ``LayoutChanged`` if it is not the first's."""
        with _LAYOUT_LOCK:
            if self.layout is None:
                self.layout = layout
                return
        if self.layout != layout:
            raise LayoutChanged(self)

    def unpack(self, result: Any) -> tuple[Any, dict[int, Any] | None, bool]:
        """``(output, {index: new value} or None, whether the output holds refs)``."""
        if self.general:
            return result[0], result[1], len(result) == 3
        assert self.layout is not None  # set by the trace that made ``result``
        written, refs = self.layout
        if not written:
            return result, None, refs
        return result[0], dict(zip(written, result[1], strict=True)), refs

    def read(self, tracked: Tracked, reach: Sequence[Any]) -> list[Any]:
        """The given values, now (probes of an enclosing call refused), for a call whose
        function and arguments are ``reach`` (see ``check_carried``)."""
        if not self.order:
            return []
        if self.attrs:
            everything = tracked.read()
            values = [everything[i] for i in self.order]
        else:
            values = [_GET(tracked.variables[i]) for i in self.order]
        if tracked.owner is None:
            check_given(values)
        check_carried(tracked, self.order, values, reach)
        return values


# The tracked set of a jitted call made inside a neutral transform, for ``lifted`` to find
# while ``ACTIVE`` is cleared (see ``_call_hidden``).
_HIDDEN: contextvars.ContextVar[Tracked | None] = contextvars.ContextVar(
    "jaxoverride_nnx_jit_hidden", default=None
)


def _call_hidden(
    jitted: Any, tracked: Tracked, values: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Calls ``jitted`` with the tracked set visible to ``lifted`` only.

    Inside a neutral transform the Variables hold its tracers, and JAX may lower the
    jitted function during the call, running primitives' Python implementations (such
    as lineax's linear solve): their neutral loops would carry those tracers into the
    lowering as constants ("No constant handler for type: LinearizeTracer").
    """
    hidden = _HIDDEN.set(tracked)
    token = ACTIVE.set(None)
    try:
        return jitted(values, *args, **kwargs)
    finally:
        ACTIVE.reset(token)
        _HIDDEN.reset(hidden)


def _plan(tracked: Tracked, build: _Build, reads: list[Any]) -> tuple[Any, ...]:
    """``(tracked set, epoch, jitted, Variables read, Variables written in the layout's
    order, whether the output holds refs, build)``: what a repeated call needs, flat."""
    assert build.layout is not None
    written, refs = build.layout
    variables = tracked.variables
    writes = tuple(variables[index] for index in written)
    return (tracked, tracked.epoch, build.jitted, tuple(reads), writes, refs, build)


_SLOT_READERS: dict[type, bool] = {}


def _reads_the_slot(variables: list[Any]) -> bool:
    """Whether ``variable._raw_value`` (what ``_READ`` reads) is the slot ``RAW`` reads, for
    each of ``variables`` (a Variable subclass could shadow the name)."""
    for kind in {type(variable) for variable in variables}:
        exact = _SLOT_READERS.get(kind)
        if exact is None:
            exact = (
                inspect.getattr_static(kind, RAW_VALUE, None) is RAW
                and kind.__getattribute__ is object.__getattribute__
            )
            if len(_SLOT_READERS) < _CLEAN_LIMIT:
                _SLOT_READERS[kind] = exact
        if not exact:
            return False
    return True


def jit(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
    """The ``"jit"`` override: ``jax.jit``'s signature; returns ``NnxJit(...).call``.

    One ``NnxJit`` per function and options, shared by every wrapper of them (as
    ``jax.jit`` shares its cache): ``jo.jit(f)(x)`` built again compiles nothing again.
    """
    below = jo.next_impl("jit")
    key = (NnxJit, args, tuple(sorted(kwargs.items())), below)
    return jo.reuse_jit(fun, key, lambda: NnxJit(fun, args, kwargs, below)).call
