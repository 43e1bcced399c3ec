#!/bin/bash
# Probe (one device call, carrying .devbuild and .peers): ncu's pipe use of the softcapped and
# plain wgmma prefill (B=1 S=8192) and of the FP8 decode (B=16 L=4096, B=1 L=32768), then the
# FP8 decode beside FlashInfer's over the same e4m3 pool. Writes $OUT/*.
set -u
export PYTHONPATH=$PWD
cp .devbuild/new/_C.abi3.so astrai/_C.abi3.so
cat .devbuild/new/REV
M=gpu__time_duration.sum,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active
M=$M,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active
M=$M,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active
M=$M,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active
M=$M,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
M=$M,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread
for s in long_scoreboard short_scoreboard wait barrier math_pipe_throttle mio_throttle not_selected; do
  M=$M,smsp__warp_issue_stalled_${s}_per_warp_active.pct
done
timeout -k 5 120 ncu --clock-control none --kernel-name regex:'prefill_wgmma|paged_decode_kernel' \
  --metrics "$M" python3 - > "$OUT/ncu.txt" 2>&1 <<'PY'
import sys
sys.path.insert(0, "benchmarks")
import torch, harness, bench_fp8, bench_variants
import astrai.extension  # noqa: F401
make = bench_variants.prefill_call([0], [8192])
for fn in (make(), make(softcap=30.0)):
    fn(); torch.cuda.synchronize()
for b, l in ((16, 4096), (1, 32768)):
    q, args = harness.uniform_decode_call(b, l, 32, 8, 128)
    torch.ops.astr.attention(q, backend="cuda", **bench_fp8.fp8_copy(args)); torch.cuda.synchronize()
PY
echo "ncu rc=$?"
grep -vE "^==PROF==|Warning|^ *-+ *$|Metric Name|Section:" "$OUT/ncu.txt" | sed -E 's/\(PagedKernelArgs\).*//' | cut -c1-130
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fisite \
  .peers/flashinfer/*.whl
PYTHONPATH=$PWD:/tmp/fisite FLASHINFER_WORKSPACE_BASE=/tmp/fi_cache MAX_JOBS=16 \
  timeout -k 5 200 python3 benchmarks/bench_attention.py --only decode --quick \
  --peers cuda_ps16,cuda_ps16_fp8,flashinfer_decode,flashinfer_decode_fp8 --repeats 20 \
  --out "$OUT/bench" > "$OUT/bench_fp8_peers.log" 2>&1
echo "bench rc=$?"
sed -n '/## Decode/,/## Verification/p' "$OUT/bench_fp8_peers.log" | head -30
