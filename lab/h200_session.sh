#!/bin/bash
# One H200 call that checks a commit end to end (run through the device tool from the repo root,
# carrying .devbuild): the GPU tests with compute-sanitizer alongside, the demo, then the
# benchmarks one at a time. Each step has a deadline so that the call returns what it finished.
#   .devbuild/new/_C.abi3.so  this commit's library, prebuilt for torch 2.11+cu130, sm_90a
#   .devbuild/old/_C.abi3.so  the baseline, its namespace renamed astr_old (A/B rows)
# Writes $OUT/session.log and $OUT/results.tar.gz.
set -u
START=$(date +%s)
BUDGET=${BUDGET:-520}
R=$OUT/r
mkdir -p "$R/bench"
exec > >(tee "$OUT/session.log") 2>&1
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
XDIST=""
python3 -c "import xdist" 2>/dev/null && XDIST="-n 6"

# Correctness first: the GPU tests, with the sanitizer and the demo beside them (not timed).
step sanitizer 200 compute-sanitizer --tool memcheck --error-exitcode 9 \
  python3 scripts/sanitizer_smoke.py >"$R/sanitizer.log" 2>&1 &
SAN=$!
step demo 200 python3 -m astrai.demo --prompts 16 --new-tokens 32 --repeats 1 \
  >"$R/demo.log" 2>&1 &
DEMO=$!
step gpu_tests 220 python3 -m pytest -q -m cuda $XDIST -p no:cacheprovider -rfE \
  --ignore=tests/extension/test_properties.py --junitxml="$R/gpu_tests.xml" \
  tests/kernels tests/extension tests/integrations tests/distributed >"$R/gpu_tests.log" 2>&1
tail -25 "$R/gpu_tests.log"
wait $SAN $DEMO
tail -8 "$R/sanitizer.log"
tail -14 "$R/demo.log"

# Then speed, one benchmark at a time on an idle GPU.
step bench_fp8 80 python3 benchmarks/bench_fp8.py --repeats 20 --out "$R/bench" >"$R/bench_fp8.log" 2>&1
cat "$R/bench_fp8.log" | tail -12
step bench_variants 60 python3 benchmarks/bench_variants.py --repeats 20 --out "$R/bench" \
  >"$R/bench_variants.log" 2>&1
tail -20 "$R/bench_variants.log"
step bench_attention 150 python3 benchmarks/bench_attention.py --quick \
  --peers cuda_ps16,cuda_ps16_before,sdpa_cudnn --out "$R/bench" \
  --baseline-lib .devbuild/old/_C.abi3.so --baseline-namespace astr_old >"$R/bench_attention.log" 2>&1
tail -30 "$R/bench_attention.log"
tar -czf "$OUT/results.tar.gz" -C "$R" .
echo "done after $(($(date +%s) - START))s"
