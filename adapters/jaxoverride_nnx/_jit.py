"""The ``jit`` override: one inner ``jax.jit`` per tracked set, fed the Variables' values.

On a cache hit a call reads the lifted Variables' raw values into a flat list, calls the
inner jitted function with that list prepended to the arguments, and stores back only
the values that the trace showed to change (returned as a dict, so an unchanged
Variable costs nothing on the way out). No graph traversal happens per call: the
tracked set was walked when ``track`` was entered. The inner function is keyed on the
tracked set's ``TrackKey`` (root identities and graph fingerprint) in a table that
holds no module, so weights are never baked in as constants, a changed tracked set
gets its own trace and a dead module's entries are pruned.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

import jaxoverride as jo
from jaxoverride.adapter_kit import infer_argnums_and_argnames, jit_name, shift_argnums
from jaxoverride_nnx import _scope
from jaxoverride_nnx._graph import RAW, is_graph_object
from jaxoverride_nnx._lift import (
    call_plain,
    from_refs,
    run_lifted,
    to_refs,
    with_arguments,
    write_back,
)
from jaxoverride_nnx._scope import ACTIVE, Tracked
from jaxoverride_nnx._threads import NeedsState, check_given, module_of, referenced

_WHERE = "jaxoverride.jit"
_GET = RAW.__get__
_SET = RAW.__set__
_JIT_SIGNATURE = inspect.signature(jax.jit)
_PLAIN_TYPES = frozenset(
    {type(jnp.zeros(())), np.ndarray, int, float, bool, complex, np.float32, np.int32}
)
_CLEAN_LIMIT = 256
# ``hot`` of a call with nothing to serve: no tracked set is this object, no epoch is -1.
_COLD = (object(), -1, None, ())


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
        self._plain = below(fun, *args, **kwargs)
        options = dict(_JIT_SIGNATURE.bind(fun, *args, **kwargs).arguments)
        del options["fun"]
        static = infer_argnums_and_argnames(
            fun, options.pop("static_argnums", None), options.pop("static_argnames", None)
        )
        donate = infer_argnums_and_argnames(
            fun, options.pop("donate_argnums", None), options.pop("donate_argnames", None)
        )
        self._static_nums, self._static_names = static
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
        self._deaths = _scope.deaths()
        self._clean: set[Any] = set()
        functools.update_wrapper(self, fun, updated=())  # type: ignore[arg-type]
        self.call = self._make_call()

    # -- the call ---------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call(*args, **kwargs)

    def _make_call(self) -> Callable[..., Any]:
        """The callable that ``jaxoverride.jit`` runs: the hot path as a plain closure
        (cheaper to call than an object), with JAX's jitted-function API."""
        plain, cache, compile_, clean, with_nodes, retry = (
            self._plain,
            self._cache,
            self._compile,
            self._clean_arguments,
            self._call_with_nodes,
            self._retry,
        )
        # The last key and its build: one tuple, replaced whole, so that another thread
        # reads one pair or the other, never a key with another key's build.
        last: list[Any] = [(None, None)]
        # The last call that took the general path to the plain jitted call: (tracked
        # set, structure epoch, build, the Variables it reads). A call with the same
        # tracked set, no structural change since and plain positional arguments is
        # served straight from it: it still reads every Variable (a write that bypasses
        # NNX's checks, or nnx.jit's own, leaves no other trace).
        hot: list[Any] = [_COLD]
        per_arity = self._per_arity
        active_get = ACTIVE.get
        plain_types = _PLAIN_TYPES

        def call(*args: Any, **kwargs: Any) -> Any:
            tracked = active_get()
            served = hot[0]
            if served[0] is tracked and served[1] == _scope._epoch and not kwargs:
                assert tracked is not None  # _COLD's first item is no tracked set
                for arg in args:
                    if type(arg) not in plain_types:
                        break
                else:
                    build = served[2]
                    try:
                        # The attribute, not the slot descriptor's ``__get__``: the
                        # interpreter's specialised slot read is about twice as fast, and
                        # ``general`` checked that it reads that very slot.
                        result = build.jitted([v._raw_value for v in served[3]], *args)
                    except NeedsState as error:
                        if error.owner is not build:
                            raise
                        hot[0] = _COLD
                        return general(args, kwargs)
                    updates = result[1]
                    if updates:
                        variables = tracked.variables
                        for index, value in updates.items():
                            if isinstance(value, Tracer):  # all or none are
                                write_back(tracked, updates, _WHERE)
                                break
                            _SET(variables[index], value)
                    if len(result) == 3:  # the output holds tracked modules: map them back
                        return from_refs(result[0], tracked)
                    return result[0]
            return general(args, kwargs)

        def general(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            tracked = ACTIVE.get()
            if tracked is not None and tracked.epoch != _scope._epoch and tracked.owner:
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
            key = tracked.key if per_arity is None else (tracked.key, len(args))
            pair = last[0]
            if key is pair[0]:
                build = pair[1]
            else:
                build = cache.get(key) or compile_(key)
                last[0] = (key, build)
            variables = tracked.variables
            try:
                if tracked.owner is None:  # inside a neutral transform: see _call_hidden
                    values = build.read(tracked)
                    result = _call_hidden(build.jitted, tracked, values, args, kwargs)
                else:
                    if build.attrs:
                        values = build.read(tracked)
                    else:
                        # A structurally equal tracked set (a submodule replaced by a like
                        # one) shares the build: read its own Variables, not the build's.
                        reads = build.variables_of(tracked)
                        values = list(map(_GET, reads))
                        if (
                            per_arity is None
                            and tracked.epoch == _scope._epoch
                            and _reads_the_slot(reads)
                        ):
                            hot[0] = (tracked, tracked.epoch, build, reads)
                    result = build.jitted(values, *args, **kwargs)
            except NeedsState as error:
                if error.owner is not build:
                    raise
                hot[0] = _COLD
                retry(key, tracked, error)
                last[0] = (None, None)
                return general(args, kwargs)
            out, updates = result[0], result[1]
            if updates:
                # One jitted call's outputs are all concrete or all tracers of one trace.
                for index, value in updates.items():
                    if isinstance(value, Tracer):
                        write_back(tracked, updates, _WHERE)  # checks the trace level first
                        break
                    _SET(variables[index], value)
            if len(result) == 3:  # the output holds tracked modules: map them back
                out = from_refs(out, tracked)
            return out

        call.tracked_jit = self  # type: ignore[attr-defined]
        functools.update_wrapper(call, self._fun, updated=())
        return jo.jit_api(call, self._fun, stage=self._stage, jitted=self._jitted)

    def _retry(self, key: Any, tracked: Tracked, error: NeedsState) -> None:
        """The function touched a module it was not given: give it that one too."""
        build = self._cache[key]
        self._cache[key] = self._build(key, tracked, build.given | module_of(tracked, error.index))

    def _call_with_nodes(
        self, tracked: Tracked | None, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        originals = (args, kwargs)
        view, args, kwargs = self._lift_arguments(tracked, args, kwargs)
        result = self._on_build(self._key(view, args), view, None, args, kwargs, originals)
        out, updates = result[0], result[1]
        if updates:
            write_back(view, updates, _WHERE)
        return from_refs(out, view) if len(result) == 3 else out

    def _lift_arguments(
        self, tracked: Tracked | None, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Tracked, tuple[Any, ...], dict[str, Any]]:
        static = self._static_positions(len(args))
        dynamic_args = [a for i, a in enumerate(args) if i not in static]
        dynamic_kwargs = {k: v for k, v in kwargs.items() if k not in self._static_names}
        view = with_arguments(tracked, dynamic_args, dynamic_kwargs)
        assert view is not None
        new_args = tuple(a if i in static else to_refs(a, view)[0] for i, a in enumerate(args))
        new_kwargs = {
            k: v if k in self._static_names else to_refs(v, view)[0] for k, v in kwargs.items()
        }
        return view, new_args, new_kwargs

    def _static_positions(self, count: int) -> set[int]:
        return {n % count if n < 0 else n for n in self._static_nums if -count <= n < count}

    def _clean_arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """True when no dynamic argument holds an NNX graph node (checked cheaply)."""
        if not kwargs:
            for arg in args:
                if type(arg) not in _PLAIN_TYPES:
                    break
            else:
                return True
        static = self._static_positions(len(args)) if self._static_nums else ()
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

    def _compile(self, key: Any, tracked: Tracked | None = None, arguments: Any = ()) -> _Build:
        if self._deaths != _scope.deaths():
            self._deaths = _scope.deaths()
            for stale in [k for k in self._cache if not _alive(k)]:
                del self._cache[stale]
        tracked = tracked or ACTIVE.get()
        assert tracked is not None
        build = self._build(key, tracked, referenced(tracked, [self._fun, arguments]))
        self._cache[key] = build
        return build

    def _build(self, key: Any, tracked: Tracked | None, given: frozenset[int]) -> _Build:
        """A ``jax.jit`` of the function given the tracked values ``given`` (see
        ``_threads``: at first none; a module it touches is added when found)."""
        options = self._options
        if self._per_arity is not None:
            count = key[1]
            dynamic = count - len(self._static_positions(count))
            options = {**options, "in_shardings": (None, *[self._per_arity] * dynamic)}
        assert tracked is not None
        build = _Build(tracked, given)
        build.jitted = self._below(self._lifted(build), **options)
        return build

    def _lifted(self, build: _Build) -> Callable[..., Any]:
        fun = self._fun
        sharded_out = self._sharded_out
        order = build.order

        def lifted(values: list[Any], *args: Any, **kwargs: Any) -> Any:
            tracked = ACTIVE.get() or _HIDDEN.get()
            assert tracked is not None
            args, kwargs = from_refs((args, kwargs), tracked)
            given = dict(zip(order, values, strict=True))
            out, after = run_lifted(tracked, given, fun, args, kwargs, _WHERE, owner=build)
            out, has_refs = to_refs(out, tracked)
            updates = {i: after[i] for i in build.var_order if after[i] is not given[i]}
            # The arity says whether the output holds NodeRefs: a static fact of the trace
            # that costs nothing to read on a cache hit. With ``out_shardings`` the arity
            # is fixed (the shardings are a prefix of the output), and ``from_refs`` runs.
            if has_refs or sharded_out:
                return out, updates, None
            return out, updates

        # Named as JAX names ``fun`` (a partial by its function, an object as unnamed), so
        # compilations and lowerings carry the user's name.
        lifted.__name__ = lifted.__qualname__ = jit_name(fun)
        for attribute in ("__qualname__", "__module__", "__doc__"):
            value = getattr(fun, attribute, None)
            if isinstance(value, str):
                setattr(lifted, attribute, value)
        return lifted

    # -- the jitted function's other entry points -------------------------------------
    def _entry(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, Tracked | None, tuple[Any, ...], dict[str, Any]]:
        tracked = _scope.current()
        if self._clean_arguments(args, kwargs):
            if tracked is None:
                return None, None, args, kwargs
            return self._key(tracked, args), tracked, args, kwargs
        view, args, kwargs = self._lift_arguments(tracked, args, kwargs)
        return self._key(view, args), view, args, kwargs

    def _on_build(
        self,
        key: Any,
        view: Tracked,
        method: str | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        arguments: Any = (),
    ) -> Any:
        """``build.jitted(values, ...)`` (or its ``method``), adding each module the function
        touches; ``arguments``, the call's own, guide a first build (see ``_compile``)."""
        while True:
            build = self._cache.get(key) or self._compile(key, view, arguments)
            token = ACTIVE.set(view)
            try:
                jitted = build.jitted if method is None else getattr(build.jitted, method)
                return jitted(build.read(view), *args, **kwargs)
            except NeedsState as error:
                if error.owner is not build:
                    raise
                self._cache[key] = self._build(
                    key, view, build.given | module_of(view, error.index)
                )
            finally:
                ACTIVE.reset(token)

    def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
        """Output shapes, as ``jax.jit(fun).eval_shape``; tracked modules are not changed."""
        key, view, args, kwargs = self._entry(args, kwargs)
        if view is None:
            return self._plain.eval_shape(*args, **kwargs)
        result = self._on_build(key, view, "eval_shape", args, kwargs)
        return from_refs(result[0], view) if len(result) == 3 else result[0]

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """Lowers the lifted function: its first argument is the list of Variable values."""
        return self._staged("lower", args, kwargs)

    def trace(self, *args: Any, **kwargs: Any) -> Any:
        """Traces the lifted function: its first argument is the list of Variable values."""
        return self._staged("trace", args, kwargs)

    def _stage(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if method == "eval_shape":
            return self.eval_shape(*args, **kwargs)
        return self._staged(method, args, kwargs)

    def _jitted(self) -> list[Any]:
        return [self._plain, *(build.jitted for build in self._cache.values())]

    def _staged(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        key, view, args, kwargs = self._entry(args, kwargs)
        if view is None:
            return getattr(self._plain, method)(*args, **kwargs)
        return self._on_build(key, view, method, args, kwargs)

    def __repr__(self) -> str:
        return f"<jaxoverride_nnx jit of {self._fun!r}>"


class _Build:
    """One ``jax.jit`` of the lifted function, for one tracked set and the tracked values
    it is given (``given``: indices, Variables first, then array attributes), which it
    takes as a list in ``order``. It marks the probes of its traces (``_threads``)."""

    __slots__ = ("attrs", "given", "jitted", "order", "source", "var_order", "variables")

    def __init__(self, tracked: Tracked, given: frozenset[int]):
        count = len(tracked.variables)
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

    def read(self, tracked: Tracked) -> list[Any]:
        """The given values, now (probes of an enclosing call refused)."""
        if not self.order:
            return []
        if self.attrs:
            everything = tracked.read()
            values = [everything[i] for i in self.order]
        else:
            values = [_GET(tracked.variables[i]) for i in self.order]
        if tracked.owner is None:
            check_given(values)
        return values


# The tracked set of a jitted call made inside a neutral transform, for ``lifted`` to find
# while ``ACTIVE`` is cleared (see ``_call_hidden``).
_HIDDEN: contextvars.ContextVar[Tracked | None] = contextvars.ContextVar(
    "jaxoverride_nnx_jit_hidden", default=None
)


def _call_hidden(
    jitted: Any, tracked: Tracked, values: list[Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Calls ``jitted`` with the tracked set visible to ``lifted`` only.

    Inside a neutral transform (``jo.grad``: JAX's linearize) the Variables hold that
    transform's tracers. JAX may lower the jitted function during the call, and lowering
    runs the Python implementation of primitives such as Equinox's (``lineax``'s linear
    solve): neutral loops in it would carry the Variables' values into the lowering as
    constants ("No constant handler for type: LinearizeTracer"). A primitive's
    implementation is pure, so it runs with nothing tracked; ``lifted``, traced by the
    same call, still finds the tracked set.
    """
    hidden = _HIDDEN.set(tracked)
    token = ACTIVE.set(None)
    try:
        return jitted(values, *args, **kwargs)
    finally:
        ACTIVE.reset(token)
        _HIDDEN.reset(hidden)


_SLOT_READERS: dict[type, bool] = {}


def _reads_the_slot(variables: list[Any]) -> bool:
    """Whether ``variable._raw_value`` is the slot ``RAW`` reads, for each of ``variables``
    (a Variable subclass could shadow the name)."""
    for kind in {type(variable) for variable in variables}:
        exact = _SLOT_READERS.get(kind)
        if exact is None:
            exact = (
                inspect.getattr_static(kind, "_raw_value", None) is RAW
                and kind.__getattribute__ is object.__getattribute__
            )
            if len(_SLOT_READERS) < _CLEAN_LIMIT:
                _SLOT_READERS[kind] = exact
        if not exact:
            return False
    return True


def _alive(key: Any) -> bool:
    return (key[0] if type(key) is tuple else key).alive()


def jit(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
    """The ``"jit"`` override: ``jax.jit``'s signature; returns ``NnxJit(...).call``.

    One ``NnxJit`` per function and options, shared by every wrapper of them (as
    ``jax.jit`` shares its cache): ``jo.jit(f)(x)`` built again compiles nothing again.
    """
    below = jo.next_impl("jit")
    key = (NnxJit, args, tuple(sorted(kwargs.items())), below)
    return jo.reuse_jit(fun, key, lambda: NnxJit(fun, args, kwargs, below)).call
