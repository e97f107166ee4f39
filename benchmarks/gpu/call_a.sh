#!/usr/bin/env bash
# On the lent machine, first of two calls (carry .whl .fa4a): keep FlashAttention-4's first half in
# /tmp/fa4, install the carried wheels (.whl: fla, grpcio-tools) into /tmp/site, build HARTS into
# /tmp/harts, then run "$@" (optional) with those on the path. benchmarks/results/gpu_runs.md has the recipe.
# HARTS_GPU_TMP (default /tmp) moves every /tmp path (tests/benchmarks/test_gpu_call_scripts.py).
# HARTS_AUTOTUNE_SEED=DIR copies a kept tuned run's autotune choices (Triton's *.autotune.json files,
# e.g. benchmarks/results/issue26_gpu/tuned/autotune) into the Triton cache first, so a tuned run
# compiles the chosen configs instead of benchmarking every config (docs/gpu.md, "The caches").
set -u
T=${HARTS_GPU_TMP:-/tmp}
[ -z "${HARTS_AUTOTUNE_SEED:-}" ] || [ -d "$HARTS_AUTOTUNE_SEED" ] || { echo "HARTS_AUTOTUNE_SEED: no folder $HARTS_AUTOTUNE_SEED"; exit 1; }
mkdir -p "$T/fa4" && cp .fa4a/* "$T/fa4/" || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$T/site" .whl/*.whl || exit 1
rm -rf "$T/harts"
PYTHONPATH=$T/site python3 -m pip install --no-build-isolation --no-deps --no-compile -q --target "$T/harts" . \
    > "${OUT:-$T}/build.log" 2>&1 || { tail -30 "${OUT:-$T}/build.log"; exit 1; }
export PYTHONPATH=$T/harts:$T/site PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$T/tc}
[ -z "${HARTS_AUTOTUNE_SEED:-}" ] || { mkdir -p "$TRITON_CACHE_DIR" && cp -R "$HARTS_AUTOTUNE_SEED/." "$TRITON_CACHE_DIR/"; } || exit 1
[ $# -eq 0 ] || "$@"
