"""Shared test setup: 8 CPU devices, a persistent compilation cache per xdist worker, a
check that no test leaves overrides behind, and ``--jax-next`` (JAX's next flags,
``tests/_next_flags.py``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

# Must precede the first import of jax anywhere in the test session.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# A persistent XLA compilation cache, one folder per pytest-xdist worker, which the fresh
# interpreters a worker starts share (they inherit the environment). The suite compiles the
# same small programs over and over: inside jax.checking_leaks() JAX keeps nothing in its
# in-memory caches, and every fresh interpreter starts cold. One folder per worker because
# two processes that write one entry at once may hand a third a torn file. JAX records its
# compile event around the cache lookup too, so the tests that count compilations count a
# program read back from the cache as one. JAXOVERRIDE_TEST_COMPILE_CACHE=off turns it off.
if os.environ.get("JAXOVERRIDE_TEST_COMPILE_CACHE", "on") != "off":
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(
        Path(__file__).resolve().parent.parent
        / ".jax-cache"
        / os.environ.get("PYTEST_XDIST_WORKER", "main")
    )
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"


import contextlib

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import _next_flags
import jaxoverride as jo
from jaxoverride import _stack

jax.config.update("jax_enable_x64", False)

_NEXT_FLAGS_ON = contextlib.ExitStack()


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--jax-next``: JAX's next custom rules and remat on for the whole session."""
    parser.addoption(
        "--jax-next",
        default="none",
        metavar="FLAGS",
        help="turn on JAX's next flags for the session, before any test module is imported: "
        f"'all' (each of {', '.join(_next_flags.NEXT_FLAGS)} that this JAX has), 'none' "
        "(the default) or a comma-separated list; meant for tests/test_parity_*.py",
    )


def pytest_configure(config: pytest.Config) -> None:
    try:
        flags = _next_flags.selected(str(config.getoption("--jax-next")))
    except ValueError as error:
        raise pytest.UsageError(str(error)) from None
    _NEXT_FLAGS_ON.enter_context(_next_flags.turned_on(flags))


def pytest_unconfigure(config: pytest.Config) -> None:
    _NEXT_FLAGS_ON.close()


def pytest_report_header(config: pytest.Config) -> str:
    """The record of JAX's next flags: which this JAX has, which are on, which it lacks."""
    return _next_flags.record()


@pytest.fixture(autouse=True)
def _no_leftover_overrides():
    """Every test must leave the stack, the installed adapters and the jit key as it found them."""
    installed_before = _stack.installed
    yield
    assert _stack.context_snapshot() is _stack.ROOT, (
        f"test left a context entered: {jo.current_stack()}"
    )
    assert _stack.installed == installed_before, (
        f"test left adapters installed: {jo.current_stack()}"
    )


@pytest.fixture
def linen_installed() -> Iterator[None]:
    """The Linen adapter installed for the test, and uninstalled after it, even on failure.

    A Linen test module marks all its tests with
    ``pytestmark = pytest.mark.usefixtures("linen_installed")``, or a test requests it.
    """
    # Imported here, not at the top, so that only the tests that use Linen import Flax.
    import jaxoverride_linen as jol

    jol.install()
    try:
        yield
    finally:
        jol.uninstall()


@pytest.fixture(scope="session")
def mesh() -> Mesh:
    """All 8 CPU devices as one ``"data"`` axis (Auto axes, unlike ``jax.make_mesh``'s)."""
    assert jax.device_count() == 8, "XLA_FLAGS above must give this process 8 CPU devices"
    return Mesh(np.array(jax.devices()), ("data",))
