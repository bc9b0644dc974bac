"""The implicit-differentiation errors of the Linen adapter: each subclasses the
``jaxoverride.errors`` class of its name, so a handler of that class catches it."""

from __future__ import annotations

import jaxoverride.errors as joe


class ClosedOverDifferentiationError(joe.ClosedOverDifferentiationError):
    """A custom rule reads a Linen variable that is being differentiated.

    The rule gives gradients for its explicit arguments only, so the variable would get a
    silently zero gradient (``jaxoverride.closure_convert`` makes reads arguments).

    Example:
      >>> import jax, flax.linen as nn, jaxoverride as jo, jaxoverride_linen
      >>> class Scale(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x):
      ...         w = lambda: self.param("w", nn.initializers.ones, ())
      ...         f = jo.custom_vjp(lambda x: x * w())
      ...         f.defvjp(lambda x: (f(x), None), lambda _, g: (g,))
      ...         return f(x)
      >>> with jaxoverride_linen.context():
      ...     v = Scale().init(jax.random.key(0), 1.0)
      ...     jax.grad(lambda v: Scale().apply(v, 1.0))(v)
      Traceback (most recent call last):
      ...
      jaxoverride_linen.ClosedOverDifferentiationError: jaxoverride.custom_vjp: ...
    """


class DifferentiatedStateError(joe.DifferentiatedStateError):
    """A Linen variable that came out of a custom rule is differentiated after it.

    The rule's ``bwd`` gives cotangents from that of the rule's output only, so the
    variable would get a silently zero gradient.

    Example:
      >>> import jax, flax.linen as nn, jaxoverride as jo, jaxoverride_linen
      >>> class Cached(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x):
      ...         last = self.variable("cache", "last", lambda: 0.0)
      ...         def primal(x):
      ...             last.value = 3.0 * x
      ...             return x
      ...         f = jo.custom_vjp(primal)
      ...         f.defvjp(lambda x: (primal(x), None), lambda _, g: (g,))
      ...         return f(x) + last.value
      >>> with jaxoverride_linen.context():
      ...     v = Cached().init(jax.random.key(0), 1.0)
      ...     jax.grad(lambda x: Cached().apply(v, x, mutable=["cache"])[0])(1.0)
      Traceback (most recent call last):
      ...
      jaxoverride_linen.DifferentiatedStateError: jaxoverride.custom_vjp: ...
    """


class PureFunctionWriteError(joe.PureFunctionWriteError):
    """A Linen variable write or rng draw inside a function that JAX makes pure.

    Raised by ``closure_convert``, ``make_jaxpr``, the custom solves and a custom rule's
    backward pass inside a bound Linen module: nothing written or drawn could come out.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxoverride as jo, jaxoverride_linen
      >>> class Counted(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x):
      ...         calls = self.variable("counters", "calls", lambda: jnp.zeros(()))
      ...         def g(v):
      ...             calls.value += 1
      ...             return v
      ...         return jo.closure_convert(g, x)[0](x)
      >>> with jaxoverride_linen.context():
      ...     Counted().init(jax.random.key(0), jnp.ones(2))
      Traceback (most recent call last):
      ...
      jaxoverride_linen.PureFunctionWriteError: jaxoverride.closure_convert: ...
    """
