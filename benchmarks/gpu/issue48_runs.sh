#!/usr/bin/env bash
# Issue 48's device calls (benchmarks/results/gpu_runs.md): run from a clean export of the commit
# being measured (helpers' half-edited files must not travel into a measurement):
#   here:   rm -rf .gpurun && mkdir .gpurun && git archive HEAD | tar x -C .gpurun
#   device: cp -r .whl .fa4a .gpurun/ && cd .gpurun && bash benchmarks/gpu/issue48_runs.sh a   (carry .whl .fa4a .gpurun)
#           cp -r .whl .fa4b .gpurun/ && cd .gpurun && bash benchmarks/gpu/issue48_runs.sh b   (carry .whl .fa4b .gpurun; at once)
#           cd .gpurun && bash benchmarks/gpu/issue48_runs.sh c                                 (carry .gpurun; at once)
# a: build, the GPU tests of the kernels added since they last ran, the RL loop's split on the 4-layer
#    Qwen3.5-35B-A3B;
# b: FlashAttention-4, the 24-layer 8-microbatch slice (never-seen steps), a new process's first pass;
# c: the one-microbatch line, the layers against their anchors, the Qwen3.5 slice;
# s: one call when machines are scarce (carry .whl .fa4a .gpurun; torch varlen attention, no FA4):
#    a new process's first pass against warm, the RL loop's split, the new kernels' GPU tests.
set -u
here=$(dirname "$0")
step=${1:?usage: issue48_runs.sh a|b|c}
OUT=${OUT:?set OUT (the device tool does)}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
te() { timeout "$1" python3 benchmarks/train_eval.py --fast-autotune --keep attention,linear_attention "${@:2}"; }
S8="--slice-microbatches 8 --repeats 1 --sections speedup,microbatches,newshapes,breakdown"
tests="tests/runtime/modules/test_fused_modules.py tests/kernels/test_kda_cp_gpu.py tests/kernels/test_ssd_op.py \
  tests/runtime/layers/test_mamba2.py tests/kernels/test_moe_kernels.py tests/runtime/layers/test_moe_gpu.py \
  tests/runtime/layers/test_ling3_layers.py tests/kernels/test_norm_kernels.py"
case "$step" in
  a) bash "$here/call_a.sh" bash -c "nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt; \
       timeout 170 python3 benchmarks/gpu/run_gpu_tests.py -q -rs -m gpu --import-mode=prepend $tests \
         > $OUT/gpu_tests.log 2>&1; echo tests rc \$?; tail -15 $OUT/gpu_tests.log; \
       timeout 170 python3 benchmarks/rl_loop.py --flavor qwen3.5-35b-a3b --layers 4 --device cuda \
         --steps 4 --sync-atol 1.0 > $OUT/rl_loop.jsonl 2>&1; echo rl rc \$?; tail -3 $OUT/rl_loop.jsonl" ;;
  b) bash "$here/call_b.sh" bash -c "$(declare -f te); \
       te 330 --layers 24 $S8 --out $OUT/te24_slice8; \
       te 75 --layers 24 --slice-microbatches 8 --sections first --out $OUT/te24_first" ;;
  c) bash "$here/call_b.sh" bash -c "$(declare -f te); \
       te 150 --layers 24 --sections speedup --out $OUT/te24_mb1; \
       timeout 150 python3 benchmarks/layer_speed.py --fast-autotune --cases moe,kda,kda_compact --no-readme \
         --out $OUT/layer_speed.json; \
       te 250 --flavor qwen3.5-35b-a3b --layers 8 --slice-microbatches 8 --repeats 1 \
         --sections speedup,microbatches --out $OUT/te_qwen35_slice8" ;;
  s) bash "$here/call_a.sh" bash -c "$(declare -f te); nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt; \
       te 90 --layers 24 --slice-microbatches 8 --sections first --out $OUT/te24_first; \
       timeout 160 python3 benchmarks/rl_loop.py --flavor qwen3.5-35b-a3b --layers 4 --device cuda \
         --steps 4 --sync-atol 1.0 > $OUT/rl_loop.jsonl 2>&1; echo rl rc \$?; tail -3 $OUT/rl_loop.jsonl; \
       timeout 120 python3 benchmarks/gpu/run_gpu_tests.py -q -rs -m gpu --import-mode=prepend $tests \
         > $OUT/gpu_tests.log 2>&1; echo tests rc \$?; tail -15 $OUT/gpu_tests.log" ;;
  *) echo "unknown step $step: a, b, c or s"; exit 2 ;;
esac 2>&1 | tee "$OUT/$step.log"
exit "${PIPESTATUS[0]}"
