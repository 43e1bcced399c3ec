#!/usr/bin/env bash
# One full pass on a GPU machine (the device): build, every test, the memory checker on a
# small run, the race checker on the prefill kernels, the demo and the benchmark. Logs go to $OUT
# (default /tmp/out). SKIP_TESTS, SKIP_SANITIZER, SKIP_RACECHECK, SKIP_DEMO, SKIP_BENCH=1 skip
# a step.
# BASELINE_DIR=<folder of this tree holding sources exported by
# `BASELINE_EXPORT_ONLY=1 bash benchmarks/build_baseline.sh COMMIT <folder>`>: builds that older
# library too and runs the benchmark as an A/B against it (benchmarks/README.md).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} PYTHONUNBUFFERED=1
step() { echo "=== $1 ($(date +%T))"; }
step build
start=$(date +%s)
python3 -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
python3 -m astrai.extension.info
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  step pytest
  python3 -m pytest -q -p no:cacheprovider tests ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log" | tail -25
  step ctest
  (cmake -S tests/cpp -B build-cpp -G Ninja >/dev/null && cmake --build build-cpp >/dev/null && ctest --test-dir build-cpp 2>&1 | tail -3) || echo "ctest: failed"
fi
if [ "${SKIP_SANITIZER:-0}" != 1 ]; then
  step compute-sanitizer
  compute-sanitizer --tool memcheck --error-exitcode 9 python3 scripts/sanitizer_smoke.py 2>&1 | tail -8 | tee "$OUT/sanitizer.log"
fi
if [ "${SKIP_RACECHECK:-0}" != 1 ]; then
  # Shared-memory races of the prefill kernels' pipelines (TMA boxes, the cp.async gather, wgmma,
  # mma.sync): one ragged batch whose sequences take different numbers of row tiles, each kernel.
  step racecheck
  compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
    tests/kernels/test_cuda_kernels.py -k prefill_ragged_batch_with_uneven_row_tiles 2>&1 \
    | tail -4 | tee "$OUT/racecheck.log"
fi
if [ "${SKIP_DEMO:-0}" != 1 ]; then
  step demo
  python3 -m astrai.demo 2>/dev/null | tee "$OUT/demo.txt"
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  baseline=()
  if [ -n "${BASELINE_DIR:-}" ]; then
    step baseline build
    lib=$(bash benchmarks/build_baseline.sh - "$BASELINE_DIR") || { echo "baseline: build failed"; exit 1; }
    baseline=(--baseline-lib "$lib")
  fi
  step bench
  python3 benchmarks/bench_attention.py ${BENCH_ARGS:---quick} ${baseline[@]+"${baseline[@]}"} --out "$OUT" 2>&1 | tail -60
fi
step done
