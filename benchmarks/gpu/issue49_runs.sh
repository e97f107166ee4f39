#!/usr/bin/env bash
# Issue 49's device calls (benchmarks/results/gpu_runs.md, "Issue 49"): context parallelism in both
# modes and the whole GRPO step on 1, 2, 4 and 8 GPUs of one node. Run from a clean export of the
# commit being measured:
#   here:   rm -rf .gpurun && mkdir .gpurun && git archive HEAD | tar x -C .gpurun
#   device: cp -r .whl .fa4a .gpurun/ && cd .gpurun && bash benchmarks/gpu/issue49_runs.sh STEP
#           (carry .whl .fa4a .gpurun; every step builds first: a fresh machine each call is fine)
# Steps (kind; the sum of each step's timeouts stays under the 600 s a call may run):
#   1   any one-GPU kind   world size 1 on NCCL: both scripts end to end on the 2-layer Qwen3.5-35B-A3B
#                          (the check before a multi-GPU lease; at most 170 s after the build)
#   2a  nvidia-h100-x2     cp = 2, heads / states / auto, against one GPU holding the whole microbatch:
#                          Qwen3.5-35B-A3B and Kimi-Linear-48B-A3B, 4 layers, real widths, 64k-row trees
#   2b  nvidia-h100-x2     the longest tree at cp = 2 (256k, then 512k rows; no single-GPU reference)
#   2c  nvidia-h100-x2     the GRPO step: Qwen3.5-35B-A3B, 8 layers, FSDP2 + EP2, agentic trees; cp2-auto
#   4a  nvidia-h100-x4     cp = 4 both modes and dp_shard 2 x cp 2 (states), 64k rows, fidelity
#   4b  nvidia-h100-x4     256k / 512k / 1M rows at cp = 4 (states, auto), optimizer state over dp_shard x cp
#   4c  nvidia-h100-x4     the GRPO step: 16 layers, FSDP2 + EP4
#   8a  nvidia-h100-x8     cp = 8 both modes (past Qwen3.5's 2 KV heads: heads mode may be refused,
#                          recorded as skipped) and dp_shard 2 x cp 4 (states), 64k rows, fidelity
#   8b  nvidia-h100-x8     512k and 1M rows at cp = 8 (states, auto, heads)
#   8c  nvidia-h100-x8     the GRPO step: Qwen3.5-35B-A3B at full depth (40 layers), FSDP2 + EP8
#   8d  nvidia-h100-x8     (when 8c does not fit or time out) 24 layers, and the paper's DP4/TP2/SP/EP8 neighbour
# Each torchrun writes $OUT/<name>.json (parallel_eval.py / grpo_step.py) and its log $OUT/<name>.log;
# the step's whole output is $OUT/<step>.log. NVLink multicast stays off in every process.
set -u
here=$(dirname "$0")
step=${1:?usage: issue49_runs.sh 1|2a|2b|2c|4a|4b|4c|8a|8b|8c|8d}
OUT=${OUT:?set OUT (the device tool does)}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
Q="--flavor qwen3.5-35b-a3b"
K="--flavor kimi-linear-48b-a3b"
# tr SECONDS GPUS NAME SCRIPT ARGS...: one torchrun, its JSON and log under $OUT
tr() {
  local s=$1 n=$2 name=$3 script=$4
  shift 4
  timeout "$s" python3 -m torch.distributed.run --standalone --nproc-per-node "$n" "benchmarks/$script.py" \
    --fast-autotune --out "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc $rc"; grep -E "^\||speedup|rank [0-9]+:|skipped|refused|Error" "$OUT/$name.log" | tail -40
  return $rc
}
PE="--no-fp32-reference --iters 2 --warmup 1"
case "$step" in
  1) bash "$here/call_a.sh" bash -c "$(declare -f tr); Q='$Q'; OUT=$OUT; \
       nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt; \
       tr 90 1 pe_w1 parallel_eval \$Q --layers 2 --tree-rows 16k --configs dp_shard=1 --no-fp32-reference \
         --iters 1 --warmup 0; \
       tr 80 1 gs_w1 grpo_step \$Q --layers 2 --preset tiny --capacity 8192 --configs dp_shard=1 --iters 1 --warmup 0" ;;
  2a) bash "$here/call_a.sh" bash -c "$(declare -f tr); OUT=$OUT; \
       tr 250 2 pe_cp2_qwen parallel_eval $Q --layers 4 --tree-rows 64k --configs 'cp2;cp2-states;cp2-auto' $PE; \
       tr 250 2 pe_cp2_kimi parallel_eval $K --layers 4 --tree-rows 64k --configs 'cp2;cp2-states;cp2-auto' $PE" ;;
  2b) bash "$here/call_a.sh" bash -c "$(declare -f tr); OUT=$OUT; \
       tr 240 2 pe_cp2_256k parallel_eval $Q --layers 4 --tree-rows 256k --no-fidelity --no-baseline \
         --configs 'cp2-states;cp2-auto' --iters 1 --warmup 1; \
       tr 240 2 pe_cp2_512k parallel_eval $Q --layers 4 --tree-rows 512k --no-fidelity --no-baseline \
         --configs 'cp2-states' --iters 1 --warmup 1" ;;
  2c) bash "$here/call_a.sh" bash -c "$(declare -f tr); OUT=$OUT; \
       tr 300 2 gs_ep2 grpo_step $Q --layers 8 --preset swe-like --configs ep2; \
       tr 200 2 gs_cp2 grpo_step $Q --layers 4 --tree-rows 64k --configs cp2-auto" ;;
  4a) bash "$here/call_a.sh" bash -c "$(declare -f tr); OUT=$OUT; \
       tr 250 4 pe_cp4_qwen parallel_eval $Q --layers 4 --tree-rows 64k \
         --configs 'cp4;cp4-states;cp4-auto;dp2-cp2-states' $PE; \
       tr 250 4 pe_cp4_kimi parallel_eval $K --layers 4 --tree-rows 64k --configs 'cp4;cp4-states;cp4-auto' $PE" ;;
  4b) bash "$here/call_a.sh" bash -c "$(declare -f tr); OUT=$OUT; \
       for rows in 256k 512k 1M; do tr 160 4 pe_cp4_\$rows parallel_eval $Q --layers 4 --tree-rows \$rows \
         --no-fidelity --no-baseline --configs 'cp4-states;cp4-auto' --iters 1 --warmup 1; done" ;;
  4c) bash "$here/call_a.sh" bash -c "$(declare -f tr); OUT=$OUT; \
       tr 500 4 gs_ep4 grpo_step $Q --layers 16 --preset swe-like --configs dp4-ep4" ;;
  8a) bash "$here/call_a.sh" bash -c "$(declare -f tr); OUT=$OUT; \
       tr 250 8 pe_cp8_qwen parallel_eval $Q --layers 4 --tree-rows 64k \
         --configs 'cp8;cp8-states;cp8-auto;dp2-cp4-states' $PE; \
       tr 250 8 pe_cp8_kimi parallel_eval $K --layers 4 --tree-rows 64k --configs 'cp8;cp8-states;cp8-auto' $PE" ;;
  8b) bash "$here/call_a.sh" bash -c "$(declare -f tr); OUT=$OUT; \
       tr 240 8 pe_cp8_512k parallel_eval $Q --layers 4 --tree-rows 512k --no-fidelity --no-baseline \
         --configs 'cp8-states;cp8-auto;cp8' --iters 1 --warmup 1; \
       tr 240 8 pe_cp8_1M parallel_eval $Q --layers 4 --tree-rows 1M --no-fidelity --no-baseline \
         --configs 'cp8-states;cp8-auto' --iters 1 --warmup 1" ;;
  8c) bash "$here/call_a.sh" bash -c "$(declare -f tr); OUT=$OUT; \
       tr 490 8 gs_ep8_40 grpo_step $Q --layers 40 --preset swe-like --configs dp8-ep8 --iters 1" ;;
  8d) bash "$here/call_a.sh" bash -c "$(declare -f tr); OUT=$OUT; \
       tr 300 8 gs_ep8_24 grpo_step $Q --layers 24 --preset swe-like --configs dp8-ep8 --iters 1; \
       tr 190 8 gs_table4 grpo_step $Q --layers 8 --preset swe-like --configs table4-8gpu --iters 1" ;;
  *) echo "unknown step $step: 1, 2a-2c, 4a-4c or 8a-8d"; exit 2 ;;
esac 2>&1 | tee "$OUT/$step.log"
exit "${PIPESTATUS[0]}"
