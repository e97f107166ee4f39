#!/usr/bin/env bash
# Issue 26's whole-step runs (benchmarks/results/gpu_runs.md), two device calls made back to back so /tmp stays warm.
# From the repo root on the lent machine:
#   a  carry .whl .fa4a   build; layer_speed moe, kda, kda_compact with their kernel profiles        (~3 min)
#   b  carry .whl .fa4b   FA4; 24-layer ling-tiny, both cores kept, fast autotune: the one-microbatch
#                         line, then the 8-microbatch slice (speedup, each microbatch, a never-seen
#                         step, the median and slowest profiles), then a new process's first
#                         microbatch with the cache the first two left                              (~7 min)
#   c  carry nothing      (after b) the 8-layer Qwen3.5-35B-A3B slice beside it
# Everything is written under $OUT as it goes; each step's log is $OUT/<step>.log.
set -u
here=$(dirname "$0")
step=${1:?usage: issue26_runs.sh a|b|c}
OUT=${OUT:?set OUT (the device tool does)}
te() { timeout "$1" python3 benchmarks/train_eval.py --fast-autotune --keep attention,linear_attention "${@:2}"; }
S8="--slice-microbatches 8 --repeats 1 --sections speedup,microbatches,newshapes,breakdown"
case "$step" in
  a) bash "$here/call_a.sh" timeout 400 python3 benchmarks/layer_speed.py --fast-autotune \
       --cases moe,kda,kda_compact --no-readme --out "$OUT/layer_speed.json" ;;
  b) bash "$here/call_b.sh" bash -c "$(declare -f te); \
       te 150 --layers 24 --sections speedup --out $OUT/te24_mb1; \
       te 330 --layers 24 $S8 --out $OUT/te24_slice8; \
       te 60 --layers 24 --slice-microbatches 8 --sections first --out $OUT/te24_first" ;;
  c) bash "$here/call_b.sh" bash -c "$(declare -f te); \
       te 500 --flavor qwen3.5-35b-a3b --layers 8 $S8 --out $OUT/te_qwen35_slice8" ;;
  *) echo "unknown step $step: a, b or c"; exit 2 ;;
esac 2>&1 | tee "$OUT/$step.log"
exit "${PIPESTATUS[0]}"
