#!/usr/bin/env bash
# Issue 23's single-GPU runs (benchmarks/results/gpu_runs.md), one device call per step (carry .whl: fla-core and
# grpcio-tools wheels, benchmarks/results/gpu_runs.md "Carry what the image lacks"). From the repo root on the lent machine:
#   a  build; the empty-microbatch GPU test (DP padding on the fused paths); the FSDP2 path at
#      world size 1 (NCCL) against the unparallelised 24-layer ling-tiny microbatch   (~6 min)
#   b  build; CPUOffloadPolicy capacity: Qwen3.5-35B-A3B depths 4 and 6, one process each (~7 min)
# Everything is written under $OUT as it goes; each step's log is $OUT/<step>.log.
set -u
step=${1:?usage: issue23_runs.sh a|b}
OUT=${OUT:?set OUT (the device tool does)}
T=${HARTS_GPU_TMP:-/tmp}
build() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$T/site" .whl/*.whl || return 1
  rm -rf "$T/harts"
  PYTHONPATH=$T/site python3 -m pip install --no-build-isolation --no-deps --no-compile -q --target "$T/harts" . \
      > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; return 1; }
}
run() {
  build || exit 1
  export PYTHONPATH=$T/harts:$T/site PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$T/tc
  python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
  case "$step" in
    a) timeout 120 python3 benchmarks/gpu/run_gpu_tests.py -q -m gpu --import-mode=prepend \
         tests/parallel/test_empty_microbatch.py
       timeout 360 python3 benchmarks/parallel_single_gpu.py overhead --layers 24 --fast-autotune \
         --out "$OUT/ws1_overhead.json" ;;
    b) timeout 480 python3 benchmarks/parallel_single_gpu.py offload --search 4,6 --fast-autotune \
         --repeats 2 --out "$OUT/offload.json" ;;
    *) echo "unknown step $step: a or b"; exit 2 ;;
  esac
}
run 2>&1 | tee "$OUT/$step.log"
exit "${PIPESTATUS[0]}"
