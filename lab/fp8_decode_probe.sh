#!/bin/bash
# Probe (one device call, carrying .devbuild and .peers): the FP8 decode beside FlashInfer's over
# the same e4m3 pool (bench_attention.py's cuda_ps16_fp8 and flashinfer_decode_fp8 peers; the
# FlashInfer FP8 module compiles at its first use), then Nsight Compute's sections for the bf16
# and FP8 decode kernels of lab/profile_decode.py, and for the bf16 decode of the baseline build
# (.devbuild/old) at the two shapes where this build's decode is behind it. Writes $OUT/r/* and
# $OUT/results.tar.gz.
set -u
export PYTHONPATH=$PWD
R=$OUT/r
mkdir -p "$R/bench"
exec > >(tee "$OUT/probe.log") 2>&1
cp .devbuild/new/_C.abi3.so astrai/_C.abi3.so
cat .devbuild/new/REV
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fisite \
  .peers/flashinfer/*.whl
PYTHONPATH=$PWD:/tmp/fisite FLASHINFER_WORKSPACE_BASE=/tmp/fi_cache MAX_JOBS=16 \
  timeout -k 5 "${PEERS_LIMIT:-300}" python3 benchmarks/bench_attention.py --only decode --quick \
  --peers cuda_ps16,cuda_ps16_fp8,flashinfer_decode,flashinfer_decode_fp8 --repeats 20 \
  --out "$R/bench" >"$R/bench_fp8_peers.log" 2>&1
echo "bench rc=$?"
tail -40 "$R/bench_fp8_peers.log"
tar -czf "$OUT/results.tar.gz" -C "$R" .
timeout -k 5 "${NCU_LIMIT:-150}" ncu --clock-control none --kernel-name regex:paged_decode \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
  --section LaunchStats --section Occupancy --section InstructionStats \
  python3 lab/profile_decode.py --fp8 --shapes 16:4096,1:32768 >"$R/ncu_decode.txt" 2>&1
echo "ncu rc=$?"
timeout -k 5 "${NCU_LIMIT:-150}" ncu --clock-control none --kernel-name regex:paged_decode \
  --section SpeedOfLight --section WarpStateStats --section LaunchStats --section InstructionStats \
  python3 lab/profile_decode.py --baseline .devbuild/old/_C.abi3.so --shapes 1:32768,128:2048 \
  >"$R/ncu_decode_ab.txt" 2>&1
echo "ncu A/B rc=$?"
grep -E "paged_decode|Duration|DRAM Throughput|Issue Slots Busy|Executed Ipc A|Stall|Registers Per|Achieved Occupancy" "$R/ncu_decode.txt" | head -120
tar -czf "$OUT/results.tar.gz" -C "$R" .
