#!/bin/bash
# Second of two H200 calls on one warm machine (the first: `bash scripts/flash_wheels.sh stash`,
# carrying .whl/part-a): installs FlashAttention-4 from .whl/part-b and runs bench_attention's
# prefill rows with the flash backend (FlashAttention-4 over 256-token pages) beside astrai's cuda
# kernels and cuDNN. Library: .devbuild/new.
set -u
export PYTHONPATH=$PWD
R=$OUT/r
mkdir -p "$R"
cp .devbuild/new/_C.abi3.so astrai/_C.abi3.so && cat .devbuild/new/REV
source scripts/flash_wheels.sh install || exit 1
python3 -c "import astrai.extension as e; print(e.ops.BUILD_INFO)" | head -2
timeout ${FA4_LIMIT:-420} python3 benchmarks/bench_attention.py --quick --only prefill --repeats 20 \
  --peers cuda_ps16,astrai_flash,sdpa_cudnn --out "$R/fa4" >"$R/fa4.log" 2>&1
echo "bench rc=$?"
grep -E "^\| |err|Error" "$R/fa4.log" | head -40
tar -czf "$OUT/results.tar.gz" -C "$R" .
