"""JAX's next implementations of custom rules and remat, behind flags that will flip.

JAX declares ``jax_custom_vjp3`` (``custom_vjp`` becomes ``custom_vjp3``; from jax 0.9.1),
``jax_remat3`` (the next ``checkpoint``; from 0.10.2) and ``jax_custom_jvp3`` (the same for
``custom_jvp``; added to JAX's main branch after 0.11.0) with ``upgrade=True``: each becomes
the default one day. The
parity suites run with them on through ``pytest --jax-next=all`` (see ``tests/conftest.py``
and "JAX's next flags" in ``docs/design.md``); the session header says which of them this
JAX has and which are on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import jax

NEXT_FLAGS = ("jax_custom_vjp3", "jax_custom_jvp3", "jax_remat3")
"""Every flag of JAX's next implementations that the suites know, in the order reported."""


def available() -> tuple[str, ...]:
    """The flags of ``NEXT_FLAGS`` that this JAX declares.

    Returns:
      The names, in ``NEXT_FLAGS`` order.

    Example::

        >>> set(available()) <= set(NEXT_FLAGS)
        True
    """
    return tuple(flag for flag in NEXT_FLAGS if flag in jax.config.values)


def selected(option: str) -> tuple[str, ...]:
    """The flags that ``--jax-next=OPTION`` turns on in this JAX.

    Args:
      option: ``"none"``, ``"all"`` (every flag this JAX has) or a comma-separated list of
        names from ``NEXT_FLAGS``.

    Returns:
      The flags to turn on, each one this JAX has.

    Raises:
      ValueError: a name that is not in ``NEXT_FLAGS``, or one that this JAX lacks (a run
        that asked for a flag must not pass without it).

    Example::

        >>> selected("none")
        ()
    """
    if option == "none":
        return ()
    if option == "all":
        return available()
    names = tuple(name.strip() for name in option.split(",") if name.strip())
    if unknown := [name for name in names if name not in NEXT_FLAGS]:
        raise ValueError(
            f"--jax-next: unknown flags {unknown}; expected 'all', 'none' or names from "
            f"{', '.join(NEXT_FLAGS)}"
        )
    if absent := [name for name in names if name not in available()]:
        raise ValueError(
            f"--jax-next: jax {jax.__version__} has no {', '.join(absent)}; it has "
            f"{', '.join(available()) or 'none of them'} (use --jax-next=all for those it has)"
        )
    return names


@contextlib.contextmanager
def turned_on(flags: Sequence[str]) -> Iterator[None]:
    """Turns each flag of ``flags`` on for the block; puts back every value after it.

    JAX's caches are cleared after the block, so that nothing traced under the flags is
    reused without them.

    Args:
      flags: names this JAX declares (``available()``).

    Example::

        >>> with turned_on(available()):
        ...     all(jax.config.values[flag] for flag in available())
        True
    """
    before = {flag: jax.config.values[flag] for flag in flags}
    try:
        for flag in flags:
            jax.config.update(flag, True)
        yield
    finally:
        for flag, value in before.items():
            jax.config.update(flag, value)
        jax.clear_caches()


def record() -> str:
    """One line naming this JAX, each next flag it has with its value, and those it lacks.

    Example::

        >>> record().startswith(f"jax {jax.__version__}: next flags")
        True
    """
    values = [f"{flag}={'on' if jax.config.values[flag] else 'off'}" for flag in available()]
    absent = [flag for flag in NEXT_FLAGS if flag not in available()]
    text = f"jax {jax.__version__}: next flags {', '.join(values) or 'none'}"
    return f"{text}; absent: {', '.join(absent)}" if absent else text
