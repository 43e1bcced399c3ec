#!/bin/bash
# One H200 call that checks a commit end to end (run through the device tool from the repo root,
# carrying .devbuild): the GPU tests with compute-sanitizer alongside, the demo, then the
# benchmarks one at a time. Each step has a deadline so that the call returns what it finished.
#   .devbuild/new/_C.abi3.so  this commit's library, prebuilt for torch 2.11+cu130, sm_90a
#   .devbuild/old/_C.abi3.so  the baseline, its namespace renamed astr_old (A/B rows)
# Writes $OUT/session.log and $OUT/results.tar.gz.
set -u
START=$(date +%s)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # scripts/ and benchmarks/ import astrai
# (the H200 image has pytest-xdist and hypothesis)
BUDGET=${BUDGET:-480}
R=$OUT/r
mkdir -p "$R/bench"
exec > >(tee "$OUT/session.log") 2>&1
pack() { tar -czf "$OUT/results.tar.gz" -C "$R" .; }  # after each phase: a cut-off call keeps it
left() { echo $((BUDGET - ($(date +%s) - START))); }
step() {  # step NAME SECONDS COMMAND...: runs if time is left, at most SECONDS
  local name=$1 want=$2
  shift 2
  local have
  have=$(left)
  if [ "$have" -lt 20 ]; then
    echo "== $name: skipped, $have s left"
    return
  fi
  [ "$want" -gt "$have" ] && want=$have
  echo "== $name (limit ${want}s, $(date +%T))"
  timeout -k 5 "$want" "$@"
  echo "== $name: rc=$? after $(($(date +%s) - START))s"
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
if [ -f .devbuild/new/_C.abi3.so ]; then
  cp .devbuild/new/_C.abi3.so astrai/_C.abi3.so
  cat .devbuild/new/REV
fi
python3 -c "import astrai.extension as e; print(e.ops.BUILD_INFO)" || {
  echo "prebuilt library does not load: building"
  MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 python3 setup.py build_ext --inplace >"$R/build.log" 2>&1
  tail -5 "$R/build.log"
}
python3 -c "import torch; print(torch.__version__, torch.version.cuda)"
# Correctness first: the GPU tests in three processes, with the sanitizer and the demo beside
# them (nothing here is timed).
PYTEST="python3 -m pytest -v -p no:cacheprovider -rfE"
step tests_kernels 200 $PYTEST tests/kernels/test_cuda_kernels.py >"$R/tests_kernels.log" 2>&1 &
T1=$!
step tests_variants_fp8 200 $PYTEST -m cuda tests/kernels/test_cuda_variants.py \
  tests/kernels/test_cuda_fp8.py tests/kernels/test_cuda_bad_metadata.py \
  tests/extension/test_properties.py >"$R/tests_variants_fp8.log" 2>&1 &
T2=$!
T3=""
if [ -z "${SKIP_API:-}" ]; then  # SKIP_API=1: the kernels' tests only (a kernel-only change)
  step tests_api 200 $PYTEST -m cuda --ignore=tests/extension/test_properties.py \
    tests/extension tests/integrations tests/distributed >"$R/tests_api.log" 2>&1 &
  T3=$!
fi
step sanitizer 180 compute-sanitizer --tool memcheck --error-exitcode 9 \
  python3 scripts/sanitizer_smoke.py >"$R/sanitizer.log" 2>&1 &
SAN=$!
[ -z "${SKIP_DEMO:-}" ] && step demo 200 python3 -m astrai.demo --prompts 16 --new-tokens 32 --repeats 1 \
  >"$R/demo.log" 2>&1 &
DEMO=$!
wait $T1 $T2 $T3 $SAN $DEMO
for f in tests_kernels tests_variants_fp8 ${T3:+tests_api}; do
  echo "--- $f"
  grep -E "FAILED|ERROR" "$R/$f.log" | head -20
  tail -2 "$R/$f.log"
done
tail -8 "$R/sanitizer.log"
tail -14 "$R/demo.log"
pack

# Then speed, one benchmark at a time on an idle GPU.
step bench_attention 150 python3 benchmarks/bench_attention.py --quick \
  --peers cuda_ps16,cuda_ps16_before,sdpa_cudnn --repeats 30 --out "$R/bench" \
  --baseline-lib .devbuild/old/_C.abi3.so --baseline-namespace astr_old >"$R/bench_attention.log" 2>&1
tail -30 "$R/bench_attention.log"
pack
step bench_fp8 70 python3 benchmarks/bench_fp8.py --repeats 20 --out "$R/bench" >"$R/bench_fp8.log" 2>&1
tail -12 "$R/bench_fp8.log"
pack
step bench_variants 60 python3 benchmarks/bench_variants.py --repeats 20 --out "$R/bench" \
  >"$R/bench_variants.log" 2>&1
tail -20 "$R/bench_variants.log"
pack
if [ -n "${TRANSFORMERS_BENCH:-}" ]; then  # last: whatever time is left
  step bench_transformers 120 python3 benchmarks/bench_transformers.py $TRANSFORMERS_BENCH \
    --out "$R/bench" >"$R/bench_transformers.log" 2>&1
  tail -12 "$R/bench_transformers.log"
  pack
fi
echo "done after $(($(date +%s) - START))s"
