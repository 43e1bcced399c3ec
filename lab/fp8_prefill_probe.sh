#!/bin/bash
# One H200 call for the FP8 wgmma prefill (issue 30): its tests (FP8 file, every prefill test,
# bad metadata), memcheck of scripts/sanitizer_smoke.py, racecheck of one FP8 wgmma prefill, then
# benchmarks/bench_fp8.py (FP8 against bf16, decode and prefill, one process).
#   $LIB/_C.abi3.so (default .devbuild/new)  the library under test
# Env: TESTS=0, SANITIZER=0, BENCH=0 skip a phase; BENCH_OUT for the record (default $OUT/bench).
set -u
source lab/device_prelude.sh
R=$OUT/r
mkdir -p "$R"
LIB=${LIB:-.devbuild/new}
cp $LIB/_C.abi3.so astrai/_C.abi3.so && cat $LIB/REV
timeout 120 python3 -m pytest -q -p no:cacheprovider -x -rfE tests/kernels/test_cuda_fp8.py \
  -k "prefill and in_kernel" >"$R/t_smoke.log" 2>&1
rc=$?
grep -E "FAILED|Error|assert" "$R/t_smoke.log" | head -20; tail -2 "$R/t_smoke.log"
if [ $rc != 0 ]; then echo "smoke failed (rc=$rc): stopping"; exit 1; fi
PIDS=""
if [ "${TESTS:-1}" = 1 ]; then
  PYTEST="timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE -n 5"
  $PYTEST tests/kernels/test_cuda_fp8.py tests/kernels/test_cuda_bad_metadata.py >"$R/t_fp8.log" 2>&1 &
  PIDS="$PIDS $!"
  $PYTEST tests/kernels/test_cuda_kernels.py tests/kernels/test_cuda_variants.py \
    -k "prefill or head_major or scale" >"$R/t_prefill.log" 2>&1 &
  PIDS="$PIDS $!"
fi
if [ "${SANITIZER:-1}" = 1 ]; then
  (timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 python3 scripts/sanitizer_smoke.py \
    >"$R/memcheck.log" 2>&1; echo "memcheck rc=$?" >>"$R/memcheck.log") &
  PIDS="$PIDS $!"
fi
wait $PIDS  # by pid: a bare wait would also wait for the tee above
for f in t_fp8 t_prefill; do
  [ -f "$R/$f.log" ] || continue
  echo "--- $f"; grep -E "FAILED|ERROR" "$R/$f.log" | head -15; tail -1 "$R/$f.log"
done
[ -f "$R/memcheck.log" ] && tail -3 "$R/memcheck.log"
if [ "${SANITIZER:-1}" = 1 ]; then
  timeout 90 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest -q \
    -p no:cacheprovider tests/kernels/test_cuda_fp8.py \
    -k "fp8_prefill_with_cached_prefixes and in_kernel-16-128" >"$R/racecheck.log" 2>&1
  echo "racecheck rc=$?"; tail -2 "$R/racecheck.log"
fi
if [ "${BENCH:-1}" = 1 ]; then
  mkdir -p "${BENCH_OUT:-$OUT/bench}"
  timeout 150 python3 benchmarks/bench_fp8.py --out "${BENCH_OUT:-$OUT/bench}" 2>&1 | grep -v Warning
fi
