#!/usr/bin/env bash
# Issue 26's whole-step runs (benchmarks/results/gpu_runs.md), two device calls made back to back so /tmp stays warm.
# From the repo root on the lent machine:
#   a  carry .whl .fa4a   build; layer_speed moe, kda, kda_compact with their kernel profiles        (~3 min)
#   b  carry .whl .fa4b   FA4; 24-layer ling-tiny, both cores kept, fast autotune: the one-microbatch
#                         line, then the 8-microbatch slice (speedup, each microbatch, a never-seen
#                         step, the median and slowest profiles), then a new process's first
#                         microbatch with the cache the first two left, timed, then under cProfile (~8 min)
#   c  carry nothing      (after b) the 8-layer Qwen3.5-35B-A3B slice beside it (speedup, each microbatch)
#   d  carry .whl .fa4a   (after the RMSNorm launch fix) build; its GPU test and the fused-module /
#                         model GPU tests; layer_speed moe, kda_compact                            (~3 min)
#   e  carry .whl .fa4b   FA4; the 24-layer 8-microbatch slice again (two never-seen steps)         (~6 min)
#   f  carry .whl .fa4a   (after the programs-per-group fix) build; the RMSNorm GPU test            (~1.5 min)
#   g  carry .whl .fa4b   FA4; three never-seen 8-microbatch steps one after the other              (~4.5 min)
#   t  carry nothing      (after a FA4 call) the tuned one-microbatch line (cold full autotune); its Triton
#                         cache comes back as $OUT/tcache_tuned.tgz.0, .1, ... (15 MiB parts, the device
#                         tool's file limit; at most four) to carry later: cat tcache_tuned.tgz.* | tar xzf -
#                         (its autotune choices alone: benchmarks/results/issue26_gpu/tuned/autotune, which
#                         call_a.sh copies into the cache with HARTS_AUTOTUNE_SEED=that folder)
#   h  carry .whl .fa4a   (after the fused MoE and norm kernels) build; their GPU tests and the MoE's
#                         with the fused-module ones; layer_speed moe                              (~3.5 min)
#   i  carry .whl .fa4a   (after the router's tensor-core backward) build; whole models of the three
#                         families against transformers on CUDA with every new kernel           (~4 min)
# Everything is written under $OUT as it goes; each step's log is $OUT/<step>.log.
set -u
here=$(dirname "$0")
step=${1:?usage: issue26_runs.sh a|b|c|d|e|f|g|h|i|t}
OUT=${OUT:?set OUT (the device tool does)}
te() { timeout "$1" python3 benchmarks/train_eval.py --fast-autotune --keep attention,linear_attention "${@:2}"; }
S8="--slice-microbatches 8 --repeats 1 --sections speedup,microbatches,newshapes,breakdown"
case "$step" in
  a) bash "$here/call_a.sh" timeout 400 python3 benchmarks/layer_speed.py --fast-autotune \
       --cases moe,kda,kda_compact --no-readme --out "$OUT/layer_speed.json" ;;
  b) bash "$here/call_b.sh" bash -c "$(declare -f te); \
       te 150 --layers 24 --sections speedup --out $OUT/te24_mb1; \
       te 330 --layers 24 $S8 --out $OUT/te24_slice8; \
       te 60 --layers 24 --slice-microbatches 8 --sections first --out $OUT/te24_first; \
       te 90 --layers 24 --slice-microbatches 8 --sections first --first-profile --out $OUT/te24_first_profile" ;;
  c) bash "$here/call_b.sh" bash -c "$(declare -f te); te 420 --flavor qwen3.5-35b-a3b --layers 8 \
       --slice-microbatches 8 --repeats 1 --sections speedup,microbatches --out $OUT/te_qwen35_slice8" ;;
  d) bash "$here/call_a.sh" bash -c "timeout 200 python3 benchmarks/gpu/run_gpu_tests.py -q -m gpu \
       --import-mode=prepend tests/kernels/test_rms_norm.py tests/runtime/modules/test_fused_modules.py \
       tests/runtime/layers/test_moe_gpu.py; timeout 200 python3 benchmarks/layer_speed.py --fast-autotune \
       --cases moe,kda_compact --no-readme --out $OUT/layer_speed.json" ;;
  e) bash "$here/call_b.sh" bash -c "$(declare -f te); \
       te 420 --layers 24 $S8 --out $OUT/te24_slice8; \
       te 60 --layers 24 --slice-microbatches 8 --sections first --out $OUT/te24_first" ;;
  f) bash "$here/call_a.sh" timeout 120 python3 benchmarks/gpu/run_gpu_tests.py -q -m gpu \
       --import-mode=prepend tests/kernels/test_rms_norm.py ;;
  g) bash "$here/call_b.sh" bash -c "$(declare -f te); te 330 --layers 24 --slice-microbatches 8 \
       --sections newshapes --newshape-steps 3 --repeats 1 --out $OUT/te24_newshapes" ;;
  t) TRITON_CACHE_DIR=${HARTS_GPU_TMP:-/tmp}/tc_tuned bash "$here/call_b.sh" bash -c "\
       timeout 540 python3 benchmarks/train_eval.py --keep attention,linear_attention --layers 24 \
       --sections speedup --out $OUT/te24_tuned; rc=\$?; \
       tar czf ${HARTS_GPU_TMP:-/tmp}/tcache_tuned.tgz -C \$(dirname \$TRITON_CACHE_DIR) tc_tuned; \
       split -b 15m -d -a 1 ${HARTS_GPU_TMP:-/tmp}/tcache_tuned.tgz $OUT/tcache_tuned.tgz.; \
       [ \$(ls $OUT/tcache_tuned.tgz.* | wc -l) -le 4 ] || rm $OUT/tcache_tuned.tgz.*; exit \$rc" ;;
  h) bash "$here/call_a.sh" bash -c "timeout 240 python3 benchmarks/gpu/run_gpu_tests.py -q -m gpu \
       --import-mode=prepend tests/kernels/test_moe_kernels.py tests/runtime/layers/test_moe_gpu.py \
       tests/runtime/modules/test_fused_modules.py; \
       timeout 150 python3 benchmarks/layer_speed.py --fast-autotune --cases moe --no-readme \
       --out $OUT/layer_speed.json" ;;
  i) bash "$here/call_a.sh" timeout 330 python3 benchmarks/gpu/run_gpu_tests.py -q -m gpu \
       --import-mode=prepend tests/runtime/models/test_families_gpu.py ;;
  *) echo "unknown step $step: a to i, or t"; exit 2 ;;
esac 2>&1 | tee "$OUT/$step.log"
exit "${PIPESTATUS[0]}"
