"""What the kit tells adapters about libraries still holding raw import-time transforms."""

from __future__ import annotations

from collections.abc import Sequence

from jaxoverride import _raw

SOLVER_LIBRARIES: tuple[str, ...] = _raw.SOLVER_LIBRARIES


def raw_import_time_transforms(packages: Sequence[str] | None = None) -> dict[str, list[str]]:
    """The transforms that imported packages built with raw JAX while they were imported.

    Such transforms (a ``jax.jit`` made by a module's body, an ``eqx.filter_jit``
    wrapper, a ``jax.custom_vjp`` object) keep calling raw JAX whatever is interposed
    later, so adapters do not apply inside them. Packages that are not imported are
    skipped, never imported.

    Args:
      packages: import names to look at; by default ``SOLVER_LIBRARIES`` (equinox,
        optimistix, lineax, diffrax, jaxopt, optax).

    Returns:
      ``{package: ["module.attribute", ...]}`` for each imported package holding any.

    Example:
      >>> from jaxoverride import adapter_kit
      >>> adapter_kit.raw_import_time_transforms(["no_such_package"])
      {}
    """
    return _raw.held_by_imported(SOLVER_LIBRARIES if packages is None else tuple(packages))


def interpose_fix(packages: Sequence[str]) -> str:
    """The ``interpose_on_import`` call that makes ``packages`` neutral from their first
    import, naming also the packages whose code built their raw transforms.

    Args:
      packages: import names, such as those ``raw_import_time_transforms`` returned.

    Returns:
      The call, as a message would print it.

    Example:
      >>> from jaxoverride import adapter_kit
      >>> adapter_kit.interpose_fix(["my_solvers"])  # a package not imported yet
      "jaxoverride.interpose_on_import('my_solvers') before their first import"
    """
    found = _raw.held_by_imported(tuple(packages))
    builders = _raw.builders([name for names in found.values() for name in names])
    return _raw.fix_for([*packages, *builders])
