"""Multi-host: two ``jax.distributed`` processes of 4 CPU devices each, one global mesh.

The neutral API must pass through to JAX's multi-process machinery unchanged, and the
adapters must run on arrays that span processes. ``_multihost_worker.py`` does the
checks; this test starts the two processes on localhost and reads their reports.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parent / "_multihost_worker.py"
CHECKS = [
    "jit-shardings/idle",
    "shard_map/idle",
    "pmap-across-processes/idle",
    "jit-shardings/context",
    "shard_map/context",
    "pmap-across-processes/context",
    "haiku-apply-sharded",
    "nnx-track-sharded",
]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_two_processes_agree_with_raw_jax_on_a_global_mesh():
    port = str(_free_port())
    # Without the suite's compilation cache: both processes would write its entries at once.
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")
    }
    workers = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(process_id), port],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for process_id in (0, 1)
    ]
    outputs = []
    try:
        for worker in workers:
            output, _ = worker.communicate(timeout=240)
            outputs.append(output)
    finally:
        for worker in workers:
            worker.kill()
    for process_id, (worker, output) in enumerate(zip(workers, outputs, strict=True)):
        reported = [line[3:] for line in output.splitlines() if line.startswith("ok ")]
        assert worker.returncode == 0, f"process {process_id} failed:\n{output[-4000:]}"
        assert reported == CHECKS, f"process {process_id} reported {reported}"
        assert "done" in output.splitlines(), f"process {process_id} did not shut down cleanly"
