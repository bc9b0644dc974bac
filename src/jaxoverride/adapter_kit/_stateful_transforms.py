"""Transforms that trace their function once per call, a framework's state passed through.

``vmap``, ``pmap``, ``shard_map``, the ``grad``-like transforms, ``checkpoint``/``remat``,
``jvp``, ``vjp`` and ``linearize`` have one shape: the function runs with the
framework's state installed and returns what it left as an auxiliary output that JAX
does not map, differentiate or batch; the caller's state is updated once after the
call (a counter increments once per call, not per basis vector). A framework describes
how with a ``TransformState``; the builders here make the overrides, with JAX's
signatures.

Stability: semi-public, as the rest of the kit.
"""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax.sharding import PartitionSpec

import jaxoverride as jo
from jaxoverride.adapter_kit._argnums import shift_argnums
from jaxoverride.adapter_kit._mapped import INFER_SPECS, shard_block_arguments
from jaxoverride.adapter_kit._operands import traced_arguments, unbatched_arguments
from jaxoverride.adapter_kit._state_source import StateSource
from jaxoverride.adapter_kit._state_threading import Threaded, init_safe, wraps

Thunk = Callable[[], Any]


class StatefulCall:
    """One call of a function that a JAX transform traces, the framework's state passed.

    A framework subclasses it and defines ``traced`` and ``finish``; ``state`` is the
    caller's state when the call began.

    Example:
      >>> from jaxoverride.adapter_kit import StatefulCall
      >>> class Stateless(StatefulCall):
      ...     def traced(self, state, thunk):
      ...         return thunk(), state
      >>> Stateless({}).run(len, ("abc",), {})
      (3, {})
    """

    __slots__ = ("state",)

    def __init__(self, state: Any):
        self.state = state

    def run(
        self,
        fun: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        state: Any = None,
    ) -> tuple[Any, Any]:
        """``fun(*args, **kwargs)`` with ``state`` (``self.state`` if None) installed;
        returns ``(out, what_it_left)``."""
        return self.traced(self.state if state is None else state, lambda: fun(*args, **kwargs))

    def traced(self, state: Any, thunk: Thunk) -> tuple[Any, Any]:
        """``thunk()`` with ``state`` installed; returns ``(out, what_it_left)``."""
        raise NotImplementedError

    def finish(self, left: Any) -> None:
        """Updates the caller's state with what the traced function left."""
        raise NotImplementedError

    def left_axes(self, axis: int) -> Any:
        """``vmap``'s ``out_axes`` for the state left: None (shared across the batch),
        or a prefix of it that maps the state first written inside along ``axis``."""
        del axis
        return None


class TransformState(NamedTuple):
    """How a framework passes its state through a transform that traces once per call.

    Attributes:
      active: whether the framework's state is usable here (else the override is the
        implementation below it, untouched).
      begin: ``begin(where)`` starts one call (``where`` is the neutral name).
      init_safe: ``init_safe(where, creation, apply)`` returns ``apply()``, after the
        creation pass ``creation()`` where the framework needs one.
      init_safe_fresh: as ``init_safe``, for a function that may write state that did not
        exist before (Linen's ``sow``): ``apply`` runs again with a place for it. None:
        ``init_safe``.
    """

    active: Callable[[], bool]
    begin: Callable[[str], StatefulCall]
    init_safe: Callable[[str, Thunk, Thunk], Any]
    init_safe_fresh: Callable[[str, Thunk, Thunk], Any] | None = None

    def init_safe_allowing_fresh(self, where: str, creation: Thunk, apply: Thunk) -> Any:
        """``init_safe_fresh`` where the framework has one, else ``init_safe``."""
        run = self.init_safe_fresh or self.init_safe
        return run(where, creation, apply)


class _SourceCall(StatefulCall):
    """A ``StatefulCall`` over a ``StateSource``."""

    __slots__ = ("thread",)

    def __init__(self, source: StateSource, where: str):
        self.thread = Threaded(source, 1, where)
        super().__init__(self.thread.read())

    def traced(self, state: Any, thunk: Thunk) -> tuple[Any, Any]:
        return self.thread.run(0, state, thunk)

    def finish(self, left: Any) -> None:
        self.thread.finish(left)
        self.state = None  # JAX may cache the traced function, and so this call

    def left_axes(self, axis: int) -> Any:
        return self.thread.source.fresh_axes(axis)


# The source that init_safe_fresh shares across its retries, for the next call begun.
_shared_source: contextvars.ContextVar[StateSource | None] = contextvars.ContextVar(
    "jaxoverride_kit_shared_source", default=None
)


def source_transform_state(
    active: Callable[[], bool],
    source: Callable[[str], StateSource],
    fresh_source: Callable[[str], StateSource] | None = None,
) -> TransformState:
    """The ``TransformState`` of a framework that describes its state as a ``StateSource``.

    Args:
      active: whether the framework's state is usable here.
      source: ``source(where)`` is the state source of the code running now.
      fresh_source: ``fresh_source(where)``, a source that records state first written
        inside a transformed function (and, with its ``fresh_axes(axis)``, maps it along
        ``vmap``'s axis), for ``init_safe_fresh``; None: no such state.

    Returns:
      Calls threaded by the kit's ``Threaded``, with the source's creation pass at init.

    Example:
      >>> from jaxoverride import adapter_kit as kit
      >>> state = kit.source_transform_state(lambda: False, lambda where: kit.DictStateSource({}))
      >>> state.active()
      False
    """

    def begin(where: str) -> StatefulCall:
        shared = _shared_source.get()
        if shared is None:
            return _SourceCall(source(where), where)
        _shared_source.set(None)  # for this call only: calls nested in it read their own
        return _SourceCall(shared, where)

    def init_safe_fresh(where: str, creation: Thunk, apply: Thunk) -> Any:
        assert fresh_source is not None
        shared = fresh_source(where)

        def apply_sharing() -> Any:
            token = _shared_source.set(shared)
            try:
                return apply()
            finally:
                _shared_source.reset(token)

        return init_safe(shared, creation, apply_sharing)

    return TransformState(
        active,
        begin,
        lambda where, creation, apply: init_safe(source(where), creation, apply),
        None if fresh_source is None else init_safe_fresh,
    )


def _named(transform: Callable[..., Any], name: str) -> Callable[..., Any]:
    transform.__name__ = transform.__qualname__ = name
    return transform


Prepare = Callable[
    [Callable[..., Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]],
    Callable[[tuple[Any, ...], dict[str, Any]], Any],
]


def _function_transform(state: TransformState, name: str, prepare: Prepare) -> Callable[..., Any]:
    """The override of ``name(fun, *args, **kwargs)``, which returns a function: JAX's
    (the one below) where ``state`` is not active, else the function that
    ``prepare(below, fun, args, kwargs)`` returns, given ``(call_args, call_kwargs)``."""

    def transform(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
        below = jo.next_impl(name)
        plain = below(fun, *args, **kwargs)
        active_call = prepare(below, fun, args, kwargs)

        @wraps(fun)
        def transformed(*call_args: Any, **call_kwargs: Any) -> Any:
            if not state.active():
                return plain(*call_args, **call_kwargs)
            return active_call(call_args, call_kwargs)

        return transformed

    return _named(transform, name)


def _options(
    signature: inspect.Signature, fun: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> inspect.BoundArguments:
    """The transform's arguments bound to ``signature``, all but the function."""
    bound = signature.bind(fun, *args, **kwargs)
    del bound.arguments[next(iter(signature.parameters))]
    return bound


def _mapping(
    state: TransformState, name: str, batched_state_error: Callable[[str, Exception], Exception]
) -> Callable[..., Callable[..., Any]]:
    """The override of ``vmap`` or ``pmap`` (the state in unmapped, out unbatched) or of
    ``shard_map`` (in and out replicated); the creation pass sees the first slice (block)."""
    if name == "shard_map":
        return _function_transform(state, name, _sharded(state))
    signature = inspect.signature(getattr(jax, name))
    where = f"jaxoverride.{name}"

    def prepare(below: Callable[..., Any], fun: Any, args: Any, kwargs: Any) -> Any:
        bound = _options(signature, fun, args, kwargs)
        bound.apply_defaults()
        options = dict(bound.arguments)
        in_axes, out_axes = options["in_axes"], options["out_axes"]

        def mapped(call_args: tuple[Any, ...], call_kwargs: dict[str, Any]) -> Any:
            def call() -> Any:
                traced = state.begin(where)
                pure = wraps(fun)(lambda *a, **k: traced.run(fun, a, k))
                try:
                    left_axes = traced.left_axes(0)
                    out, left = below(pure, **{**options, "out_axes": (out_axes, left_axes)})(
                        *call_args, **call_kwargs
                    )
                except ValueError as err:
                    if "out_axes" in str(err) and "None" in str(err):
                        raise batched_state_error(where, err) from err
                    raise
                traced.finish(left)
                return out

            creation = lambda: fun(*unbatched_arguments(call_args, in_axes), **call_kwargs)
            return state.init_safe_allowing_fresh(where, creation, call)

        return mapped

    return _function_transform(state, name, prepare)


def _sharded(state: TransformState) -> Prepare:
    """``shard_map``'s ``prepare`` (``_mapping``): its options are keywords."""
    where = "jaxoverride.shard_map"

    def prepare(below: Callable[..., Any], fun: Any, args: Any, options: Any) -> Any:
        specs = {**options, "out_specs": (options["out_specs"], PartitionSpec())}
        in_specs = options.get("in_specs", INFER_SPECS)

        def sharded(call_args: tuple[Any, ...], call_kwargs: dict[str, Any]) -> Any:
            def call() -> Any:
                traced = state.begin(where)
                pure = wraps(fun)(lambda *a, **k: traced.run(fun, a, k))
                out, left = below(pure, *args, **specs)(*call_args, **call_kwargs)
                traced.finish(left)
                return out

            # At init, the first device's block creates the variables, once.
            block = lambda: shard_block_arguments(call_args, in_specs, options.get("mesh"))
            creation = lambda: fun(*traced_arguments(block()), **call_kwargs)
            return state.init_safe(where, creation, call)

        return sharded

    return prepare


def _split_aux(has_aux: bool, out: Any, left: Any) -> tuple[Any, Any]:
    value, aux = out if has_aux else (out, None)
    return value, (aux, left)


def _differentiation(
    state: TransformState, name: str, value_first: bool
) -> Callable[..., Callable[..., Any]]:
    """The override of a ``grad``-like transform: run with ``has_aux=True``, state in aux;
    ``value_first`` for ``value_and_grad``."""
    signature = inspect.signature(getattr(jax, name))
    where = f"jaxoverride.{name}"

    def prepare(below: Callable[..., Any], fun: Any, args: Any, kwargs: Any) -> Any:
        bound = _options(signature, fun, args, kwargs)
        has_aux = bool(bound.arguments.get("has_aux", False))
        options = {**bound.arguments, "has_aux": True}
        argnums = bound.arguments.get("argnums", 0)
        differentiated_at = {argnums} if isinstance(argnums, int) else set(argnums)

        def differentiated(call_args: tuple[Any, ...], call_kwargs: dict[str, Any]) -> Any:
            def call() -> Any:
                traced = state.begin(where)
                pure = wraps(fun)(lambda *a, **k: _split_aux(has_aux, *traced.run(fun, a, k)))
                result = below(pure, **options)(*call_args, **call_kwargs)
                if value_first:  # value_and_grad: ((value, (aux, left)), grads)
                    (value, (aux, left)), grads = result
                    traced.finish(left)
                    return ((value, aux), grads) if has_aux else (value, grads)
                derivative, (aux, left) = result
                traced.finish(left)
                return (derivative, aux) if has_aux else derivative

            # As JAX hands them: the differentiated arguments as arrays, the rest as given.
            count = len(call_args)
            given = [i for i in range(count) if not {i, i - count} & differentiated_at]
            creation = lambda: fun(*traced_arguments(call_args, given), **call_kwargs)
            return state.init_safe_allowing_fresh(where, creation, call)

        return differentiated

    return _function_transform(state, name, prepare)


def _with_aux(state: TransformState, name: str) -> Callable[..., Any]:
    """The override of ``vjp`` or ``linearize``: ``(out, fn[, aux])``, the state in aux."""

    def call_impl(
        fun: Callable[..., Any], *primals: Any, has_aux: bool = False, **kwargs: Any
    ) -> Any:
        below = jo.next_impl(name)
        if not state.active():
            return below(fun, *primals, has_aux=has_aux, **kwargs)
        with_aux = lambda pure: below(pure, *primals, has_aux=True, **kwargs)
        return _aux_call(state, name, fun, has_aux, primals, with_aux)

    return _named(call_impl, name)


def _aux_call(
    state: TransformState,
    name: str,
    fun: Callable[..., Any],
    has_aux: bool,
    primals: Any,
    with_aux: Callable[[Callable[..., Any]], tuple[Any, Any, Any]],
) -> Any:
    """``vjp``/``linearize``/``jvp``: ``with_aux(pure)`` is JAX's call with ``has_aux=True``,
    which returns ``(out, second, (aux, left))``."""
    where = f"jaxoverride.{name}"

    def call() -> Any:
        traced = state.begin(where)
        pure = wraps(fun)(lambda *a: _split_aux(has_aux, *traced.run(fun, a, {})))
        out, second, (aux, left) = with_aux(pure)
        traced.finish(left)
        return (out, second, aux) if has_aux else (out, second)

    creation = lambda: fun(*traced_arguments(tuple(primals)))
    return state.init_safe_allowing_fresh(where, creation, call)


def _jvp(state: TransformState) -> Callable[..., Any]:
    """The override of ``jvp``: ``(out, tangent_out[, aux])``, the state in aux."""

    def jvp(fun: Callable[..., Any], primals: Any, tangents: Any, has_aux: bool = False) -> Any:
        below = jo.next_impl("jvp")
        if not state.active():
            return below(fun, primals, tangents, has_aux=has_aux)
        with_aux = lambda pure: below(pure, primals, tangents, has_aux=True)
        return _aux_call(state, "jvp", fun, has_aux, primals, with_aux)

    return jvp


def _rematerialization(state: TransformState, name: str) -> Callable[..., Any]:
    """The override of ``checkpoint`` or ``remat``: the state an argument, as ``hk.remat``
    (closed over, JAX could rebuild a scalar integer state value as a Python literal)."""
    where = f"jaxoverride.{name}"

    def prepare(below: Callable[..., Any], fun: Any, args: Any, kwargs: Any) -> Any:
        # ``checkpoint``'s options for the function given the state as a leading argument.
        bound = inspect.signature(below).bind_partial(fun, *args, **kwargs)
        static_argnums = bound.arguments.get("static_argnums")
        if static_argnums is not None:
            numbers = (static_argnums,) if isinstance(static_argnums, int) else static_argnums
            bound.arguments["static_argnums"] = shift_argnums(numbers)
        static_argnums = static_argnums or ()
        shifted_args, shifted_kwargs = bound.args[1:], bound.kwargs

        def rematerialized(call_args: tuple[Any, ...], call_kwargs: dict[str, Any]) -> Any:
            def call() -> Any:
                traced = state.begin(where)
                pure = wraps(fun)(lambda given, *a, **k: traced.run(fun, a, k, given))
                out, left = below(pure, *shifted_args, **shifted_kwargs)(
                    traced.state, *call_args, **call_kwargs
                )
                traced.finish(left)
                return out

            # As JAX hands them: arrays, but for the static arguments.
            traced = lambda: traced_arguments(call_args, static_argnums)
            return state.init_safe(where, lambda: fun(*traced(), **call_kwargs), call)

        return rematerialized

    return _function_transform(state, name, prepare)


def stateful_transforms(
    state: TransformState,
    batched_state_error: Callable[[str, Exception], Exception],
    mapped: tuple[str, ...] = ("vmap",),
    module: str | None = None,
) -> dict[str, Callable[..., Any]]:
    """Every override built here, for one framework: ``{neutral name: override}``.

    Args:
      state: the framework's ``TransformState``.
      batched_state_error: ``batched_state_error(where, err)``, the error to raise when JAX
        says that the state a ``vmap``/``pmap``'d function left depends on the mapped axis.
      mapped: the mapping transforms to include (``"vmap"``, ``"pmap"``, ``"shard_map"``).
      module: the adapter's module, which call logs (``jaxoverride_debug``) then name
        as the overrides' (``module.grad``); the kit's own if None.

    Returns:
      The overrides of ``mapped``, ``grad``, ``value_and_grad``, ``jacfwd``, ``jacrev``,
      ``hessian``, ``vjp``, ``linearize``, ``jvp``, ``checkpoint`` and ``remat``.

    Example:
      >>> import jaxoverride as jo
      >>> from jaxoverride import adapter_kit as kit
      >>> state = kit.source_transform_state(lambda: True, lambda w: kit.DictStateSource({}))
      >>> sorted(kit.stateful_transforms(state, lambda where, err: err))[:4]
      ['checkpoint', 'grad', 'hessian', 'jacfwd']
    """
    table: dict[str, Callable[..., Any]] = {
        name: _mapping(state, name, batched_state_error) for name in mapped
    }
    for name in ("grad", "value_and_grad", "jacfwd", "jacrev", "hessian"):
        table[name] = _differentiation(state, name, value_first=name == "value_and_grad")
    for name in ("vjp", "linearize"):
        table[name] = _with_aux(state, name)
    table["jvp"] = _jvp(state)
    for name in ("checkpoint", "remat"):
        table[name] = _rematerialization(state, name)
    if module is not None:
        for override in table.values():
            override.__module__ = module
    return table
