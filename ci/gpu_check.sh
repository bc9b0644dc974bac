#!/usr/bin/env bash
# The device checks of a GPU machine (the workplace's CUDA image: python3 with jax, Flax and
# the Equinox family, but no Haiku or jaxopt, carried as wheels in .whl/). Run from the
# repository root; writes into $OUT. Steps: "tests" runs `make test`'s selection on this
# machine's JAX on the CPU backend (16 cores); "bench" runs `make bench` on the GPU
# (`benchmarks/run.py --gpu`, rows after each suite into $OUT/results-gpu.json; the suites
# that start after 55% of its limit run with --quick, and their rows say so);
# "quick" the same with --quick. Each step has its own time limit in seconds.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/src:$PWD/adapters:/tmp/site PYTHONUNBUFFERED=1
python3 - <<'PY' 2>&1 | tee "$OUT/versions.txt"
import importlib.metadata as m, platform, jax
print(platform.python_version(), jax.devices())
for d in ["jax", "jaxlib", "flax", "dm-haiku", "equinox", "optimistix", "lineax", "diffrax",
          "optax", "jaxopt", "hypothesis", "numpy"]:
    try:
        print(d, m.version(d))
    except m.PackageNotFoundError:
        print(d, "missing")
PY
for step in "$@"; do
    name=${step%%:*}; limit=${step#*:}
    start=$(date +%s)
    case $name in
        tests) JAX_PLATFORMS=cpu timeout "$limit" python3 -m pytest -n 14 -m "not slow" -q \
                   -p no:cacheprovider -rfE > "$OUT/tests.log" 2>&1 ;;
        bench) timeout "$limit" python3 -m benchmarks.run --gpu --results "$OUT/results-gpu.json" \
                   --deadline $(( limit * 55 / 100 )) > "$OUT/bench.log" 2>&1
               cp docs/benchmark-report-gpu.md "$OUT/" 2>/dev/null ;;
        quick) timeout "$limit" python3 -m benchmarks.run --gpu --quick \
                   --results "$OUT/quick-gpu.json" > "$OUT/quick.log" 2>&1 ;;
    esac
    echo "$name: rc $? in $(( $(date +%s) - start )) s"
    tail -5 "$OUT/$name.log" 2>/dev/null
done
