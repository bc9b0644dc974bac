"""``jit_api``: the attributes of ``jax.jit(f)`` on what an adapter's ``"jit"`` override returns.

An override of ``"jit"`` runs ``jax.jit`` objects of its own (over a function that threads
state, or over a plan of the arguments), so ``.lower``, ``.trace``, ``.eval_shape`` and
``.clear_cache()`` must describe *that* computation, not a stateless ``jax.jit(f)`` beside
it. ``reuse_jit`` shares an override's per-function state between ``jaxoverride.jit``
objects of one function, as ``jax.jit`` objects share their cache.
"""

from __future__ import annotations

import threading
import types
import weakref
from collections.abc import Callable, Hashable, Iterable
from typing import Any, NamedTuple, TypeVar

F = TypeVar("F")
T = TypeVar("T")

STAGES = ("lower", "trace", "eval_shape")
"""The methods of a jitted function that stage it for given arguments."""

_DIRECT = "_jaxoverride_direct"
"""The attribute of an override's jitted function that holds ``jit_api``'s ``direct``."""


# ``direct(current, stack, fallback)`` and ``checked_direct(current, stack, fallback,
# captured)``: see ``jit_api``.
MakeDirect = Callable[[Callable[[], object], object, Callable[..., Any]], Callable[..., Any]]
MakeCheckedDirect = Callable[
    [Callable[[], object], object, Callable[..., Any], Callable[[], Any]], Callable[..., Any]
]


class Directs(NamedTuple):
    """``jit_api``'s ``direct`` and ``checked_direct``, and a weak reference to their owner."""

    make: MakeDirect | None
    checked: MakeCheckedDirect | None
    owner: weakref.ref[Any]


def directs_of(built: object) -> Directs | None:
    """The ``Directs`` that ``jit_api`` set on ``built`` itself, if any: not those of a
    function that a wrapper forwards attributes to (``__getattr__``) or copied the
    ``__dict__`` of (``functools.wraps``), whose direct call would skip the wrapper."""
    holder = getattr(built, _DIRECT, None)
    return holder if type(holder) is Directs and holder.owner() is built else None


Stage = Callable[[str, tuple[Any, ...], dict[str, Any]], Any]  # see ``jit_api``


def _staging(stage: Stage, method: str, fun: Callable[..., Any]) -> Callable[..., Any]:
    def staged(*args: Any, **kwargs: Any) -> Any:
        return stage(method, args, kwargs)

    name = getattr(fun, "__name__", "f")
    staged.__name__ = staged.__qualname__ = method
    staged.__doc__ = f"``jax.jit(f).{method}`` of what a call with these arguments runs ({name!r})."
    return staged


def jit_api(
    call: F,
    fun: Callable[..., Any],
    *,
    stage: Stage,
    jitted: Callable[[], Iterable[Any]],
    clear: Callable[[], None] | None = None,
    direct: MakeDirect | None = None,
    checked_direct: MakeCheckedDirect | None = None,
) -> F:
    """Gives what an override of ``"jit"`` returns the API of a ``jax.jit(fun)`` object.

    Sets ``lower``, ``trace`` and ``eval_shape`` (each calls ``stage``), ``clear_cache``
    and ``_cache_size`` (over the ``jax.jit`` objects that ``jitted`` lists) and
    ``__wrapped__`` (``fun``) on ``call``, and returns it. ``call`` stays what the caller
    gave (a plain function keeps its fast call); it must accept attributes.

    Args:
      call: the function (or object with a ``__dict__``) that the override returns.
      fun: the user's function, as passed to ``jax.jit``.
      stage: ``stage(method, args, kwargs)`` with ``method`` one of ``"lower"``,
        ``"trace"``, ``"eval_shape"``: calls that method of the ``jax.jit`` object that
        ``call(*args, **kwargs)`` would run, with the arguments it would pass it (the
        threaded state included), and returns the result. For ``"eval_shape"`` it returns
        the output as the caller of ``call`` would see it.
      jitted: returns every ``jax.jit`` object built so far (those ``call`` may run).
        ``clear_cache()`` clears each; ``_cache_size()`` sums theirs.
      clear: called by ``clear_cache()`` after that, for caches of the adapter's own that
        a fresh compilation must not skip.
      direct: optional, where one Python frame matters: ``direct(current, stack,
        fallback)`` returns a new function that behaves as ``call`` while ``current() is
        stack`` (tested first, in its own frame), else returns ``fallback(*args,
        **kwargs)``. ``jaxoverride.jit(f)`` built in ``stack`` then calls it without its
        own dispatch, until the process goes idle, a guarded adapter is installed or the
        build is dropped. ``current`` is a C-level getter of the caller's stack.
      checked_direct: optional, ``direct`` under the missing-adapter check, for an adapter
        that covers captured state: ``checked_direct(current, stack, fallback, captured)``
        may skip the check only while ``captured()`` returns the token (not None) of a
        call that passed it and its ``covers`` predicate would answer as then.

    Returns:
      ``call``, with the attributes set.

    Example:
      >>> import jax, jax.numpy as jnp, jaxoverride as jo
      >>> def logging_jit(fun, **options):
      ...     inner = jo.next_impl("jit")(fun, **options)
      ...     def call(*args, **kwargs):
      ...         return inner(*args, **kwargs)
      ...     stage = lambda method, args, kwargs: getattr(inner, method)(*args, **kwargs)
      ...     return jo.jit_api(call, fun, stage=stage, jitted=lambda: [inner])
      >>> with jo.override_context({"jit": logging_jit}):
      ...     double = jo.jit(lambda x: 2 * x)
      ...     text = double.lower(jnp.ones(2)).as_text()
      ...     double(jnp.ones(2)).tolist(), double._cache_size()
      ([2.0, 2.0], 1)
      >>> text.startswith("module")
      True
    """

    def clear_cache() -> None:
        for function in list(jitted()):
            function.clear_cache()
        if clear is not None:
            clear()

    def cache_size() -> int:
        return sum(function._cache_size() for function in list(jitted()))

    clear_cache.__doc__ = "Clears the compiled code of every ``jax.jit`` this function runs."
    cache_size.__doc__ = "The number of compiled entries, summed over those ``jax.jit``s."
    attributes: dict[str, Any] = {name: _staging(stage, name, fun) for name in STAGES}
    attributes.update(clear_cache=clear_cache, _cache_size=cache_size, __wrapped__=fun)
    if direct is not None or checked_direct is not None:
        try:
            attributes[_DIRECT] = Directs(direct, checked_direct, weakref.ref(call))
        except TypeError:
            pass  # no weak reference to it: it is dispatched, which is as right
    for name, value in attributes.items():
        setattr(call, name, value)
    return call


_HOLDER = "__jaxoverride_jit_builds__"
"""The attribute of a Python function that holds its shared builds (see ``reuse_jit``)."""


class _Builds(dict):  # type: ignore[type-arg]
    """A function's shared builds, keyed by ``reuse_jit``'s ``key``; ``owner`` is a weak
    reference to the function. Never copied or pickled with the function (cloudpickle
    copies a function's ``__dict__``): a copy starts empty, owned by no function."""

    __slots__ = ("owner",)

    def __init__(self, owner: weakref.ref[Any] | None = None):
        super().__init__()
        self.owner = owner

    def __reduce__(self) -> tuple[Any, ...]:  # copy, deepcopy and pickle: a new, empty one
        return (_Builds, ())


_shared: weakref.WeakValueDictionary[Hashable, Any] = weakref.WeakValueDictionary()
_shared_lock = threading.Lock()


def reuse_jit(fun: Callable[..., Any], key: Hashable, make: Callable[[], T]) -> T:
    """What ``make()`` returned for an equal ``fun`` and ``key`` before, else ``make()``.

    ``jax.jit(f)(x)`` in a loop compiles once, since ``jax.jit`` objects of one function
    share a cache; an override of ``"jit"`` shares its own compiled functions the same way
    by building them through this. For a Python function the state lives as long as the
    function; for another callable, while anything holds it. An unhashable ``fun`` or
    ``key`` is built afresh each time.

    Args:
      fun: the user's function, as passed to ``jax.jit``.
      key: every other input of ``make`` that changes what it builds: the type of the state
        (so that two adapters stacked on one function never share a build), the options
        and the implementation below (``jaxoverride.next_impl("jit")``).
      make: builds the state (an object that accepts weak references).

    Returns:
      The shared state.

    Example:
      >>> import jaxoverride as jo
      >>> class State: pass
      >>> built = []
      >>> make = lambda: built.append(1) or State()
      >>> double = lambda x: 2 * x
      >>> jo.reuse_jit(double, ("options",), make) is jo.reuse_jit(double, ("options",), make)
      True
      >>> len(built)
      1
    """
    try:
        hash(key)
    except TypeError:
        return make()
    table: Any = _shared
    if isinstance(fun, types.FunctionType):
        with _shared_lock:
            table = fun.__dict__.get(_HOLDER)
            # functools.wraps copies a function's __dict__: a holder copied onto a wrapper
            # is the wrapped function's, never the wrapper's.
            if type(table) is not _Builds or table.owner is None or table.owner() is not fun:
                table = _Builds(weakref.ref(fun))
                setattr(fun, _HOLDER, table)
    else:
        try:
            key = (fun, key)
            hash(key)
        except TypeError:
            return make()
    with _shared_lock:
        state = table.get(key)
    if state is None:
        made = make()  # outside the lock: it runs the adapter's and the user's code
        with _shared_lock:
            state = table.setdefault(key, made)
    return state
