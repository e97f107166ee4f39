#!/usr/bin/env bash
# The open issue-15 GPU runs (benchmarks/results/gpu_runs.md "Open GPU work"), one device call per step, made back to
# back so /tmp stays warm. From the repo root on the lent machine:
#   a  carry .whl .fa4a   build + this session's GPU tests              (~3 min)
#   b  carry .whl .fa4b   FA4 + 24-layer speedup/breakdown, both cores kept (~5 min)
#   c  carry nothing      24-layer speedup, attention kept; families + attention GPU tests
#   d  carry nothing      24-layer fidelity (recomputation on)
#   e  carry nothing      a tuned 24-layer speedup run (cold full autotune: minutes); its Triton
#                         cache comes back as $OUT/tcache_tuned.tgz when under 60 MB (to carry later)
# Everything is written under $OUT as it goes; each step's log is $OUT/<step>.log.
set -u
here=$(dirname "$0")
step=${1:?usage: issue15_runs.sh a|b|c|d|e}
OUT=${OUT:?set OUT (the device tool does)}
te() { timeout "$1" python3 benchmarks/train_eval.py --layers 24 "${@:2}"; }
tests() { timeout "$1" python3 benchmarks/gpu/run_gpu_tests.py -q -m gpu --import-mode=prepend "${@:2}"; }
case "$step" in
  a) bash "$here/call_a.sh" bash -c "$(declare -f tests); tests 400 tests/runtime/layers/test_moe_gpu.py \
       tests/runtime/modules/test_fused_modules.py tests/kernels/test_kda_gpu.py tests/runtime/models/test_hybrid_model.py" ;;
  b) bash "$here/call_b.sh" bash -c "$(declare -f te); te 500 --fast-autotune --sections speedup,breakdown \
       --keep attention,linear_attention --out $OUT/te24_kept2" ;;
  c) bash "$here/call_b.sh" bash -c "$(declare -f te tests); te 200 --fast-autotune --sections speedup \
       --keep attention --out $OUT/te24_kept1; HARTS_TEST_REPORT=$OUT tests 350 \
       tests/runtime/models/test_families_gpu.py tests/runtime/ops/test_attention_gpu.py" ;;
  d) bash "$here/call_b.sh" bash -c "$(declare -f te); te 560 --fast-autotune --sections fidelity \
       --fidelity-recompute on --out $OUT/te24_fidelity" ;;
  e) TRITON_CACHE_DIR=${HARTS_GPU_TMP:-/tmp}/tc_tuned bash "$here/call_b.sh" bash -c "$(declare -f te); \
       te 560 --sections speedup --keep attention,linear_attention --out $OUT/te24_tuned; rc=\$?; \
       tar czf $OUT/tcache_tuned.tgz -C \$(dirname \$TRITON_CACHE_DIR) tc_tuned; \
       [ \$(stat -c %s $OUT/tcache_tuned.tgz) -lt 60000000 ] || rm $OUT/tcache_tuned.tgz; exit \$rc" ;;
  *) echo "unknown step $step: a, b, c, d or e"; exit 2 ;;
esac 2>&1 | tee "$OUT/$step.log"
exit "${PIPESTATUS[0]}"
