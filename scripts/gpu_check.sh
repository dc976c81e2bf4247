#!/usr/bin/env bash
# One call on the H200: CUDA tests (parity, speculation identity, graph replay, kernels at full
# size), the cost-table profile, and the benchmarks; a short table last. Logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
STAGES=${STAGES:-tests,profile,bench}
status=0
if [[ $STAGES == *tests* ]]; then
  python3 -m pytest -q -x -p no:cacheprovider tests/e2e/test_cuda_parity.py \
    tests/e2e/test_cuda_graphs.py ${KERNEL_TESTS:-} 2>&1 | tee "$OUT/tests.log" | tail -25
  status=${PIPESTATUS[0]}
fi
if [[ $STAGES == *profile* ]]; then
  python3 scripts/profile_example.py --out "$OUT" 2>&1 | tee "$OUT/profile.log" | tail -30
fi
if [[ $STAGES == *bench* ]]; then
  python3 scripts/gpu_bench.py --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -16
fi
exit $status
