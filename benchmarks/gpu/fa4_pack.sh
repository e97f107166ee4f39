#!/usr/bin/env bash
# Here (with a network): pack FlashAttention-4 for the lent H200 (benchmarks/results/gpu_runs.md), whose image lacks it.
# Its CUDA-13 compiler library (92 MB) does not fit one 64 MiB carry: .fa4a/ holds every small
# wheel and the first part of the xz-compressed library, .fa4b/ the rest. Carry .fa4a in one call
# (call_a.sh) and .fa4b in the next, made at once (the machine keeps /tmp only while warm).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
dl=$(mktemp -d)
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d "$dl" \
    flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
    nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 \
    'apache-tvm-ffi<0.2,>=0.1.11' torch-c-dlpack-ext quack-kernels==0.6.5
rm -rf .fa4a .fa4b && mkdir -p .fa4a .fa4b "$dl/cu13"
for d in .fa4a .fa4b; do grep -qx "/$d/" .git/info/exclude || echo "/$d/" >> .git/info/exclude; done
(cd "$dl/cu13" && $PY -m zipfile -e "$dl"/nvidia_cutlass_dsl_libs_cu13-*.whl .)
rm "$dl"/nvidia_cutlass_dsl_libs_cu13-*.whl
mv "$dl"/*.whl .fa4a/
tar cf - -C "$dl/cu13" . | xz -9e -T0 > "$dl/cu13.tar.xz"
split -b 31000000 -d "$dl/cu13.tar.xz" "$dl/part."
mv "$dl/part.00" .fa4a/ && mv "$dl"/part.0[1-9] .fa4b/
rm -rf "$dl"
du -sh .fa4a .fa4b
