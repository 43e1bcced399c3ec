#!/bin/bash
# One H200 call for the warp-specialised prefill (issue 32): its tests (every kernel file's prefill
# tests, or with FULL=1 every GPU test), compute-sanitizer, then the prefill kernels of the build
# against each other (lab/prefill_kernel_ab.py: kernel tunings of this one library, FlashInfer fa3
# when .peers/flashinfer is carried, cuDNN), all interleaved per shape.
#   $LIB/_C.abi3.so (default .devbuild/new)  the library under test
# Env: TESTS=0, SANITIZER=0, AB=0 skip a phase; AB_ARGS for prefill_kernel_ab.py; FI_WARM=64,256
# compiles FlashInfer's fa3 modules for those head dims while the tests run; RECORD=1 adds
# bench_attention's records; BASE=1 the after / before run against .devbuild/base/_C.abi3.so
# (benchmarks/build_baseline.sh, namespace astr_old).
set -u
[ -f .devbuild/ab/libs.tar.xz ] && tar -xJf .devbuild/ab/libs.tar.xz -C .devbuild
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
R=$OUT/r
mkdir -p "$R"
exec > >(tee "$OUT/session.log") 2>&1
pack() { tar -czf "$OUT/results.tar.gz" -C "$R" .; }
LIB=${LIB:-.devbuild/new}
if [ -d .peers/flashinfer ]; then  # FlashInfer (README in ../shared/peers/flashinfer)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fisite \
    .peers/flashinfer/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/fisite \
    FLASHINFER_WORKSPACE_BASE=/tmp/fi_cache MAX_JOBS=16
fi
cp $LIB/_C.abi3.so astrai/_C.abi3.so && cat $LIB/REV
python3 -c "import astrai.extension as e; print(e.ops.BUILD_INFO)" | head -3
# A hang (a barrier that never completes) must not eat the call: one small test first.
timeout 90 python3 -m pytest -q -p no:cacheprovider -x tests/kernels/test_cuda_kernels.py \
  -k "prefill_matches_reference and warp_specialized and 64" >"$R/t_smoke.log" 2>&1
rc=$?
tail -2 "$R/t_smoke.log"
if [ $rc != 0 ]; then echo "smoke failed (rc=$rc): stopping"; pack; exit 1; fi
PIDS=""
if [ -n "${FI_WARM:-}" ]; then  # FlashInfer's JIT modules compile while the tests run
  (timeout 280 python3 lab/flashinfer_warm.py $FI_WARM >"$R/fi_warm.log" 2>&1) &
  FI_PID=$!
fi
if [ "${TESTS:-1}" = 1 ]; then
  PYTEST="timeout 170 python3 -m pytest -q -p no:cacheprovider -rfE -n 5"
  if [ "${FULL:-0}" = 1 ]; then
    $PYTEST tests/kernels/test_cuda_kernels.py >"$R/t_kernels.log" 2>&1 &
    PIDS="$PIDS $!"
    $PYTEST -m cuda tests/kernels/test_cuda_variants.py tests/kernels/test_cuda_fp8.py \
      tests/kernels/test_cuda_bad_metadata.py tests/extension/test_properties.py >"$R/t_variants.log" 2>&1 &
    PIDS="$PIDS $!"
    $PYTEST -m cuda --ignore=tests/extension/test_properties.py tests/extension tests/integrations \
      tests/distributed >"$R/t_api.log" 2>&1 &
    PIDS="$PIDS $!"
  else
    $PYTEST tests/kernels/test_cuda_kernels.py -k "prefill or head_major or scale" >"$R/t_kernels.log" 2>&1 &
    PIDS="$PIDS $!"
    $PYTEST -m cuda tests/kernels/test_cuda_variants.py tests/kernels/test_cuda_fp8.py \
      tests/kernels/test_cuda_bad_metadata.py -k "prefill" >"$R/t_variants.log" 2>&1 &
    PIDS="$PIDS $!"
  fi
fi
if [ "${SANITIZER:-1}" = 1 ]; then
  (timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 python3 scripts/sanitizer_smoke.py \
    >"$R/memcheck.log" 2>&1; echo "memcheck rc=$?" >>"$R/memcheck.log") &
  PIDS="$PIDS $!"
fi
# By pid, and only when there are some: a bare wait would also wait for the tee above, forever.
[ -n "$PIDS" ] && wait $PIDS
for f in t_kernels t_variants t_api; do
  [ -f "$R/$f.log" ] || continue
  echo "--- $f"; grep -E "FAILED|ERROR" "$R/$f.log" | head -15; tail -1 "$R/$f.log"
done
[ -f "$R/memcheck.log" ] && tail -3 "$R/memcheck.log"
if [ "${SANITIZER:-1}" = 1 ]; then
  timeout 120 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest -q \
    -p no:cacheprovider tests/kernels/test_cuda_kernels.py \
    -k "prefill_ragged_batch_with_uneven and warp_specialized" >"$R/racecheck.log" 2>&1
  echo "racecheck rc=$?"; tail -2 "$R/racecheck.log"
fi
pack
if [ -n "${FI_WARM:-}" ]; then wait $FI_PID; cat "$R/fi_warm.log" | tail -4; fi
if [ "${AB:-1}" = 1 ]; then  # kernels of this build against each other and the peers, interleaved
  timeout ${AB_TIMEOUT:-200} python3 lab/prefill_kernel_ab.py "$R/ab.json" ${AB_ARGS:-} 2>&1 | tee "$R/ab.log" \
    | grep -v Warning
fi
pack
if [ "${RECORD:-0}" = 1 ]; then  # the records: bench_attention's prefill rows beside FlashInfer and cuDNN
  B="timeout 150 python3 benchmarks/bench_attention.py --quick --only prefill --repeats 20"
  $B --peers cuda_ps16,flashinfer_fa3,sdpa_cudnn --out "$R/record" >"$R/record.log" 2>&1
  grep -E "^\| " "$R/record.log" | head -40
  $B --non-causal --peers cuda_ps16,flashinfer_fa3,sdpa_cudnn --out "$R/record_noncausal" \
    >"$R/record_noncausal.log" 2>&1
  grep -E "^\| " "$R/record_noncausal.log" | head -20
  pack
fi
if [ -f .devbuild/base/_C.abi3.so ] && [ "${BASE:-0}" = 1 ]; then  # after / before, one process
  timeout 200 python3 benchmarks/bench_attention.py --quick --only prefill --repeats 20 \
    --peers cuda_ps16,cuda_ps16_before,sdpa_cudnn --baseline-lib .devbuild/base/_C.abi3.so \
    --baseline-namespace astr_old --out "$R/ab_base" >"$R/ab_base.log" 2>&1
  grep -E "^\| " "$R/ab_base.log" | head -50
  pack
fi
