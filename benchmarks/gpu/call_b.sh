#!/usr/bin/env bash
# On the lent machine, the call right after call_a.sh (carry .whl .fa4b): install FlashAttention-4
# into /tmp/site_fa4 (the small wheels with pip first: pip --target --upgrade would replace the
# shared nvidia_cutlass_dsl/ folder; then the compiler library unpacked into it), put it on the
# path (a --target folder's .pth is not read) with its disk compile cache on, then run "$@".
# site_fa4/.complete marks a finished install: a call that failed part-way is redone whole.
# HARTS_GPU_TMP (default /tmp) moves every /tmp path (tests/benchmarks/test_gpu_call_scripts.py).
set -u
T=${HARTS_GPU_TMP:-/tmp}
[ -f "$T/fa4/part.00" ] && [ -d "$T/harts/harts_runtime" ] || { echo "cold machine: run call_a.sh first"; exit 3; }
if [ ! -f "$T/site_fa4/.complete" ]; then
    rm -rf "$T/site_fa4"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$T/site_fa4" \
        "$T"/fa4/*.whl || exit 1
    cat "$T/fa4/part.00" .fa4b/part.* | tar xJf - -C "$T/site_fa4" || exit 1
    touch "$T/site_fa4/.complete"
fi
export PYTHONPATH=$T/harts:$T/site:$T/site_fa4:$T/site_fa4/nvidia_cutlass_dsl/dsl_packages
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$T/tc}
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=$T/fa4cache
[ $# -eq 0 ] || "$@"
