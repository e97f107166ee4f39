#!/usr/bin/env bash
# One GPU, three calls back to back (the later ones while the machine is warm): the state-passing CP core's
# exactness and its summary / rerun split, the weight stream and routing replay on Qwen3.5-35B-A3B
# layers, the RL loop's step split and asynchronous harts-rl on CUDA, the entropy pass's cost, and the
# GPU tests of the kernels and layers these use. Results in benchmarks/results/rl_cp_gpu/.
#   here:   rm -rf .gpurun && mkdir .gpurun && git archive HEAD | tar x -C .gpurun
#   device: cd .gpurun && cp -r ../.whl . && bash benchmarks/gpu/rl_cp_runs.sh 1   (carry .whl .gpurun)
#           cd .gpurun && bash benchmarks/gpu/rl_cp_runs.sh 2                      (carry .gpurun; at once)
#           cd .gpurun && bash benchmarks/gpu/rl_cp_runs.sh 3                      (carry .gpurun; at once)
# Each run has its own time cap and the script goes on past a failure: every log says its rc. The
# state-passing core and async harts-rl run with one Triton config per kernel (run_first_config.py):
# their cold autotune alone passed 150 s on an H100 (benchmarks/results/gpu_runs.md).
set -u
here=$(dirname "$0")
step=${1:?usage: rl_cp_runs.sh 1|2|3}
OUT=${OUT:?set OUT (the device tool does)}
T=${HARTS_GPU_TMP:-/tmp}
tests="tests/kernels/test_kda_cp_gpu.py tests/runtime/parallel/test_cp_attention_gpu.py \
  tests/runtime/layers/test_moe_gpu.py tests/runtime/models/test_families_gpu.py tests/kernels/test_ssd_op.py"
py() { local cap=$1 name=$2; shift 2; echo "== $name"; timeout "$cap" python3 "$@"; echo "$name rc $?"; }
case "$step" in
  1) mkdir -p .fa4a && touch .fa4a/none   # call_a.sh keeps FlashAttention-4's files; none travel here
     bash "$here/call_a.sh" bash -c "$(declare -f py); set -u; nvidia-smi --query-gpu=name,memory.total --format=csv; \
       py 240 gpu_tests benchmarks/gpu/run_gpu_tests.py -q -rs -m gpu --import-mode=prepend $tests > $OUT/gpu_tests.log 2>&1; \
       tail -4 $OUT/gpu_tests.log; \
       py 150 cp_states benchmarks/gpu/run_first_config.py benchmarks/cp_states_one_gpu.py \
         --out $OUT/cp_states_one_gpu.json" ;;
  2|3) [ -d "$T/harts/harts_runtime" ] || { echo "cold machine: run step 1 first"; exit 3; }
     export PYTHONPATH=$T/harts:$T/site PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$T/tc ;;&
  2) py 170 weight_stream benchmarks/weight_stream.py --flavor qwen3.5-35b-a3b --layers 4 --device cuda \
       --out "$OUT/weight_stream_cuda.json" | tail -3
     py 120 routing_replay benchmarks/routing_replay.py --flavor qwen3.5-35b-a3b --layers 2 --device cuda \
       --out "$OUT/routing_replay_cuda.json" | tail -3
     py 60 entropy_cost benchmarks/entropy_cost.py --device cuda --rows 16384 --hidden 4096 --vocab 151936 \
       --dtype bfloat16 --out "$OUT/entropy_cost_cuda.json" | tail -3 ;;
  3) py 300 rl_loop benchmarks/rl_loop.py --flavor qwen3.5-35b-a3b --layers 4 --device cuda --steps 3 \
       --sync-atol 1.0 > "$OUT/rl_loop_cuda.jsonl" 2>&1; tail -2 "$OUT/rl_loop_cuda.jsonl"
     py 200 async_rl benchmarks/gpu/run_first_config.py benchmarks/async_rl.py --device cuda --steps 12 \
       --out "$OUT/async_rl_cuda.json" | tail -3 ;;
  *) echo "unknown step $step: 1, 2 or 3"; exit 2 ;;
esac 2>&1 | tee "$OUT/run$step.log"
exit "${PIPESTATUS[0]}"
