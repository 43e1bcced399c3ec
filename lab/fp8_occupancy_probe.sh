#!/bin/bash
# One H200 call: the FP8 decode at 3 blocks per SM (traits.h) - its tests, every form against the
# plan's choice (lab/fp8_decode_forms.py), bench_fp8.py (FP8 against bf16, same process); then,
# with the second library (.devbuild/ws128: the warp-specialised prefill also at D = 128), Nsight
# Compute's view of both D = 128 prefill kernels. Never a bare `wait` here (the tee below).
set -u
export PYTHONPATH=$PWD
R=$OUT/r
mkdir -p "$R/bench"
exec > >(tee "$OUT/session.log") 2>&1
pack() { tar -czf "$OUT/results.tar.gz" -C "$R" .; }
cp .devbuild/new/_C.abi3.so astrai/_C.abi3.so && cat .devbuild/new/REV
timeout 60 python3 -m pytest -q -p no:cacheprovider -x tests/kernels/test_cuda_fp8.py -k "decode" \
  -n 4 >"$R/t_fp8_smoke.log" 2>&1; echo "fp8 decode tests rc=$?"; tail -1 "$R/t_fp8_smoke.log"
PYTEST="timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE -n 5"
$PYTEST -m cuda tests/kernels/test_cuda_fp8.py tests/kernels/test_cuda_variants.py \
  tests/kernels/test_cuda_bad_metadata.py tests/extension/test_properties.py >"$R/t_fp8.log" 2>&1 &
P1=$!
$PYTEST tests/kernels/test_cuda_kernels.py -k "decode" >"$R/t_decode.log" 2>&1 &
P2=$!
wait $P1 $P2
for f in t_fp8 t_decode; do echo "--- $f"; grep -E "FAILED|ERROR" "$R/$f.log" | head; tail -1 "$R/$f.log"; done
timeout 90 compute-sanitizer --tool memcheck --error-exitcode 9 python3 scripts/sanitizer_smoke.py \
  >"$R/memcheck.log" 2>&1; echo "memcheck rc=$?"; tail -2 "$R/memcheck.log"
pack
timeout 120 python3 lab/fp8_decode_forms.py 2>&1 | tee "$R/forms.log" | grep -v Warn
timeout 120 python3 benchmarks/bench_fp8.py --repeats 20 --out "$R/bench" >"$R/bench_fp8.log" 2>&1
grep -E "^\| " "$R/bench_fp8.log"
pack
if [ -f .devbuild/ws128/_C.abi3.so ] && [ "${NCU:-1}" = 1 ]; then
  cp .devbuild/ws128/_C.abi3.so astrai/_C.abi3.so
  timeout 150 ncu --clock-control none --kernel-name regex:paged_prefill --launch-skip 2 \
    --launch-count 3 --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section WarpStateStats --section LaunchStats --section Occupancy --section InstructionStats \
    --section SchedulerStats python3 lab/prefill_ncu_kernels.py >"$R/ncu_prefill.txt" 2>&1
  echo "ncu rc=$?"
  grep -E "paged_prefill|Duration|Issue Slots Busy|Executed Ipc A|Stall|Registers Per|Warp Cycles Per Issued|No Eligible|Active Warps Per|Compute \(SM\) Th|Memory Throughput" "$R/ncu_prefill.txt" | head -80
fi
pack
