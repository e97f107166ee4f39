#!/usr/bin/env bash
# On the lent machine, first of two calls (carry .whl .fa4a): keep FlashAttention-4's first half in
# /tmp/fa4, install the carried wheels (.whl: fla, grpcio-tools) into /tmp/site, build HARTS into
# /tmp/harts, then run "$@" (optional) with those on the path. docs/gpu.md has the recipe.
set -u
mkdir -p /tmp/fa4 && cp .fa4a/* /tmp/fa4/ || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
rm -rf /tmp/harts
PYTHONPATH=/tmp/site python3 -m pip install --no-build-isolation --no-deps --no-compile -q --target /tmp/harts . \
    > "${OUT:-/tmp}/build.log" 2>&1 || { tail -30 "${OUT:-/tmp}/build.log"; exit 1; }
export PYTHONPATH=/tmp/harts:/tmp/site PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tc}
[ $# -eq 0 ] || "$@"
