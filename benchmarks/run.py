"""``make bench``: run every suite in its own process and write the report.

Writes ``benchmarks/results/results.json`` (every row) and ``benchmarks/results/report.md``
(one table per suite: times, ratios, targets and whether each is met).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

SUITES = ["bench_core", "bench_haiku", "bench_nnx", "bench_dag"]
HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def _run_suite(suite: str, quick: bool) -> list[dict]:
    if not (HERE / f"{suite}.py").exists():
        return []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        command = [sys.executable, "-m", f"benchmarks.{suite}", "--json", str(out)]
        if quick:
            command.append("--quick")
        env = dict(os.environ)
        env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
        subprocess.run(command, check=True, cwd=HERE.parent, env=env)
        return json.loads(out.read_text())


def _markdown(rows: list[dict], header: str) -> str:
    lines = [header, ""]
    for suite in dict.fromkeys(row["suite"] for row in rows):
        lines += [
            f"## {suite}",
            "",
            "| case | ours | baseline | ours (µs) | baseline (µs) | ratio | target | met |",
            "|---|---|---|---:|---:|---:|---|---|",
        ]
        for row in (r for r in rows if r["suite"] == suite):
            met = {True: "yes", False: "**no**", None: ""}[row["met"]]
            lines.append(
                f"| {row['case']} | {row['ours']} | {row['baseline']} | {row['ours_us']:.2f} | "
                f"{row['baseline_us']:.2f} | {row['ratio']:.3f} | {row['target']} | {met} |"
            )
            if row["note"]:
                lines[-1] += f" {row['note']}"
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    quick = "--quick" in sys.argv
    rows: list[dict] = []
    for suite in SUITES:
        rows += _run_suite(suite, quick)
    RESULTS.mkdir(exist_ok=True)
    import jax

    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = (
        f"# jaxoverride benchmark report\n\n{stamp}; jax {jax.__version__}; "
        f"Python {platform.python_version()}; {platform.machine()}, {os.cpu_count()} cores; "
        "CPU backend. Ratios are medians of per-round ratios over interleaved rounds "
        "(lower is faster for ours)."
    )
    (RESULTS / "results.json").write_text(json.dumps(rows, indent=1))
    (RESULTS / "report.md").write_text(_markdown(rows, header))
    print(f"wrote {RESULTS / 'report.md'}")


if __name__ == "__main__":
    main()
