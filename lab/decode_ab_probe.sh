#!/bin/bash
# Probe (one device call, carrying .devbuild): this build's split decode (B=1 L=32768) and
# persistent decode (B=128 L=2048) against the baseline build's, by ncu's instruction counts and
# stall reasons (lab/profile_decode.py --baseline). Writes $OUT/ncu_decode_ab.txt.
set -u
export PYTHONPATH=$PWD
cp .devbuild/new/_C.abi3.so astrai/_C.abi3.so
cat .devbuild/new/REV
STALLS=""
for s in long_scoreboard short_scoreboard wait barrier math_pipe_throttle mio_throttle \
  lg_throttle not_selected selected no_instruction branch_resolving dispatch_stall; do
  STALLS="$STALLS,smsp__warp_issue_stalled_${s}_per_warp_active.pct"
done
timeout -k 5 150 ncu --clock-control none \
  --kernel-name regex:'paged_decode_kernel|paged_decode_persistent|paged_attention_kernel' \
  --metrics gpu__time_duration.sum,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread,launch__grid_size$STALLS \
  python3 lab/profile_decode.py --baseline .devbuild/old/_C.abi3.so --shapes 1:32768,128:2048 \
  > "$OUT/ncu_decode_ab.txt" 2>&1
echo "ncu rc=$?"
grep -vE "^==PROF==|Warning|^ *-+ *$" "$OUT/ncu_decode_ab.txt" | sed -E 's/\(PagedKernelArgs\).*//' | cut -c1-140 | tail -120
