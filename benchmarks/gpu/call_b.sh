#!/usr/bin/env bash
# On the lent machine, the call right after call_a.sh (carry .whl .fa4b): install FlashAttention-4
# into /tmp/site_fa4 (the small wheels with pip first: pip --target --upgrade would replace the
# shared nvidia_cutlass_dsl/ folder; then the compiler library unpacked into it), put it on the
# path (a --target folder's .pth is not read) with its disk compile cache on, then run "$@".
set -u
[ -f /tmp/fa4/part.00 ] && [ -d /tmp/harts/harts_runtime ] || { echo "cold machine: run call_a.sh first"; exit 3; }
if [ ! -d /tmp/site_fa4/flash_attn ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_fa4 \
        /tmp/fa4/*.whl || exit 1
    cat /tmp/fa4/part.00 .fa4b/part.* | tar xJf - -C /tmp/site_fa4 || exit 1
fi
export PYTHONPATH=/tmp/harts:/tmp/site:/tmp/site_fa4:/tmp/site_fa4/nvidia_cutlass_dsl/dsl_packages
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tc}
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4cache
[ $# -eq 0 ] || "$@"
