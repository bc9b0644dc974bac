"""tinystate_adapter: every neutral jaxoverride function works inside ``tinystate.transform``.

The walkthrough of docs/writing-an-adapter.md, complete: a state source over tinystate's
frame (its state and rng key threaded, its parameters read-only), and the overrides the
kit builds on it, on public names only (``jaxoverride``, ``jaxoverride.adapter_kit``,
``jaxoverride.errors``). ``context()`` activates it; ``tinystate_record`` is its record.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import jaxoverride as jo, tinystate as ts, tinystate_adapter
  >>> def f(x):
  ...     w = ts.param("w", (), jax.nn.initializers.ones)
  ...     return jo.lax.fori_loop(0, 3, lambda i, h: h * w + ts.next_key()[0] * 0, x)
  >>> model = ts.transform(f)
  >>> with tinystate_adapter.context():
  ...     params, state = model.init(jax.random.PRNGKey(0), 1.0)
  >>> sorted(params)
  ['w']
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jaxoverride as jo
import tinystate
from jaxoverride import adapter_kit as kit, errors

LABEL = "tinystate_adapter"
"""The name of the adapter's layer: what ``tinystate_record``'s ``label`` names."""

FRAMEWORK = "tinystate"
"""The key ``jaxoverride.solve_state`` knows tinystate by (``Source.framework``)."""

active = tinystate.in_transform  # where the overrides act; elsewhere each is JAX's own


# -- The state source: read the state, run with it, write it back ----------------------


class _Recording(dict):  # type: ignore[type-arg]
    """The state during a creation pass: it remembers each new entry's first value."""

    def __init__(self, state: dict[str, Any]):
        super().__init__(state)
        self.created: dict[str, Any] = {}

    def __setitem__(self, name: str, value: Any) -> None:
        if name not in self:
            self.created[name] = value
        super().__setitem__(name, value)


class Source(kit.EnterLeaveSource):
    """tinystate's current frame as a ``kit.StateSource``, for one neutral call.

    What is threaded is ``(state, rng)``; parameters are read-only here and are closed
    over by the functions JAX traces. tinystate's names are the user's strings: it has no
    naming state, so ``names``/``restore_names`` keep the contract's defaults.
    """

    framework = FRAMEWORK  # "tinystate", for jaxoverride.solve_state: registered below

    def __init__(self, where: str):
        self.where = where
        self.frame = tinystate.current_frame()

    def parts(self, state: tuple[dict[str, Any], Any]) -> list[kit.StatePart]:
        """For ``solve_state``, per leaf: each state entry (an array) by name, the key."""
        rng = [kit.StatePart("rng", (), "rng")] if state[1] is not None else []
        return [kit.StatePart("state", (n,), n) for n in sorted(state[0])] + rng

    def read(self) -> tuple[dict[str, Any], Any]:
        return dict(self.frame.state), self.frame.rng

    def enter(self, state: tuple[dict[str, Any], Any]) -> tuple[Any, ...]:
        frame = self.frame
        token = (frame.state, frame.rng, set(frame.params))
        frame.state, frame.rng = dict(state[0]), state[1]
        return token

    def leave(self, token: tuple[Any, ...]) -> tuple[dict[str, Any], Any]:
        after = self.read()
        created = set(self.frame.params) - token[2]
        self.abandon(token)
        if created:
            raise errors.JaxoverrideError(
                f"{self.where}: parameters {sorted(created)} were created inside a traced "
                "function, where they would be tracers; create them at init, before the loop."
            )
        return after

    def abandon(self, token: tuple[Any, ...]) -> None:
        frame = self.frame
        frame.state, frame.rng = token[0], token[1]
        for name in set(frame.params) - token[2]:
            del frame.params[name]

    def write(self, state: tuple[dict[str, Any], Any]) -> None:
        self.frame.state, self.frame.rng = dict(state[0]), state[1]

    # -- the init part: is it initialising, and the creation pass --

    def initializing(self) -> bool:
        return self.frame.initializing

    def create(self, thunk: Callable[[], Any]) -> None:
        """Runs ``thunk`` once, keeping the parameters and state entries it created (at
        their first values) and nothing else: the state and the rng are put back, so the
        threaded call then draws the keys that apply draws."""
        frame = self.frame
        state, rng = frame.state, frame.rng
        frame.state = recording = _Recording(state)
        try:
            thunk()
        finally:
            frame.state, frame.rng = {**state, **recording.created}, rng


# -- The overrides the kit builds on the source ----------------------------------------

CONTROL_FLOW = kit.threaded_control_flow(active, Source, module=__name__)
kit.register_solve_source(FRAMEWORK, lambda: Source("solve_state") if active() else None)
_STATE = kit.source_transform_state(active, Source)


def _batched_state_error(where: str, err: Exception) -> errors.JaxoverrideError:
    return errors.JaxoverrideError(
        f"{where}: a tinystate state value or rng key written inside the mapped function "
        "depends on the mapped axis; state is shared across the batch. Reduce it over the "
        f"batch first, or return per-example values as outputs. JAX said: {err}"
    )


TRANSFORMS = kit.stateful_transforms(
    _STATE, _batched_state_error, mapped=("vmap", "pmap", "shard_map"), module=__name__
)


def jit(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
    """``jit``: inside a transform the function runs inline, in the enclosing trace.

    What compiles is the transform's own ``jax.jit(model.apply)``, so tinystate's state
    never crosses a separate trace (as ``jaxoverride_linen`` does); outside, JAX's jit.
    """
    plain = jo.next_impl("jit")(fun, *args, **kwargs)

    @kit.wraps(fun)
    def call(*call_args: Any, **call_kwargs: Any) -> Any:
        return (fun if active() else plain)(*call_args, **call_kwargs)

    def stage(method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if active():
            raise NotImplementedError(
                f"jaxoverride.jit(...).{method} inside tinystate.transform: the function "
                "runs inline there, so there is no program of its own; "
                f"call jax.jit(model.apply).{method}(...) instead."
            )
        return getattr(plain, method)(*args, **kwargs)

    return jo.jit_api(call, fun, stage=stage, jitted=lambda: [plain])


# -- Functions JAX converts into a jaxpr: reads only ------------------------------------


@contextlib.contextmanager
def _sealed(refuse: Callable[[str], Exception] | None) -> Iterator[None]:
    """The frame's state and rng as they were after the block; with ``refuse``, writes and
    draws inside are refused (nothing written there could come out)."""
    frame = tinystate.current_frame()
    saved = frame.state, frame.rng, frame.refuse
    frame.state = dict(frame.state)  # written in place by set_state: a copy, dropped after
    frame.refuse = refuse if refuse is not None else frame.refuse
    try:
        yield
    finally:
        frame.state, frame.rng, frame.refuse = saved


def _reads_only(where: str, fun: Callable[..., Any]) -> Callable[..., Any]:
    def refuse(what: str) -> Exception:
        return errors.PureFunctionWriteError(
            f"{where}: {what} inside a function that JAX turns into a pure jaxpr, where "
            "nothing written could come out; write or draw before the call, and pass it in "
            "(or, in a solver's map, declare jaxoverride.solve_state() around the solve)."
        )

    @kit.wraps(fun)
    def sealed(*args: Any, **kwargs: Any) -> Any:
        if not active():
            return fun(*args, **kwargs)
        with _sealed(refuse):
            return fun(*args, **kwargs)

    return sealed


def _converting(
    where: str, fun: Callable[..., Any], trace: Callable[..., Any], creation: Callable[[], Any]
) -> Any:
    return kit.init_safe(Source(where), creation, lambda: trace(_reads_only(where, fun)))


CONVERSIONS = kit.conversion_overrides(active, _converting, module=__name__, source=Source)


def eval_shape(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``eval_shape``: what the function writes or draws is discarded, as JAX discards it."""
    lower = jo.next_impl("eval_shape")
    if not active():
        return lower(fun, *args, **kwargs)

    @kit.wraps(fun)
    def discarding(*inner_args: Any, **inner_kwargs: Any) -> Any:
        with _sealed(None):  # put back before JAX's trace ends: no tracer stays behind
            return fun(*inner_args, **inner_kwargs)

    call = lambda: lower(discarding, *args, **kwargs)

    creation = lambda: fun(*kit.zeros_for(args), **kit.zeros_for(kwargs))
    return kit.init_safe(Source("jaxoverride.eval_shape"), creation, call)


class Rule(kit.LiftedRule):
    """``custom_vjp``/``custom_jvp``: inside a transform, JAX's rule built afresh per call
    (JAX would replay a cached trace with stale parameters) over the user's functions,
    which read parameters (closed over) and write nothing."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not active():
            return self._plain(*args, **kwargs)
        seal = functools.partial(_reads_only, self._where)

        def call() -> Any:
            rule = self._below(seal(self._fun), nondiff_argnums=self._nondiff)
            if self._rule is not None and self._name == "custom_vjp":
                fwd, bwd, zeros, remat = self._rule
                rule.defvjp(seal(fwd), seal(bwd), symbolic_zeros=zeros, optimize_remat=remat)
            elif self._rule is not None:
                rule.defjvp(seal(self._rule[0]), symbolic_zeros=self._rule[1])
            return rule(*args, **kwargs)

        creation = lambda: self._fun(*kit.as_jax_operands(args), **kwargs)
        return kit.init_safe(Source(self._where), creation, call)


TABLE = kit.OverrideTable(
    LABEL,
    {
        **CONTROL_FLOW,
        **TRANSFORMS,
        **CONVERSIONS,
        **Rule.overrides(),
        "jit": jit,
        "eval_shape": eval_shape,
    },
)
_CONTEXT = TABLE.context()  # one constant layer: entering it again reuses its builds


def context() -> jo.OverrideContext:
    """The adapter's layer: ``with tinystate_adapter.context(): model.init(...)``."""
    return _CONTEXT
