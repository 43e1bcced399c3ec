#!/bin/bash
# One H200 call: executed instructions per SASS line (Nsight Compute's source counters) of both
# D = 128 prefill kernels (lab/prefill_ncu_kernels.py, library .devbuild/ws128), as CSV.
set -u
export PYTHONPATH=$PWD
cp .devbuild/ws128/_C.abi3.so astrai/_C.abi3.so
for k in wgmma warp_specialized; do
  timeout 150 ncu --clock-control none --kernel-name regex:paged_prefill_${k}_kernel --launch-skip 2 \
    --launch-count 1 --section SourceCounters --section WarpStateStats -o $OUT/$k \
    python3 lab/prefill_ncu_kernels.py >$OUT/$k.log 2>&1
  echo "$k ncu rc=$?"
  ncu --import $OUT/$k.ncu-rep --page source --csv --print-source sass >$OUT/${k}_sass.csv 2>&1
  ncu --import $OUT/$k.ncu-rep --page details >$OUT/${k}_details.txt 2>&1
  wc -l $OUT/${k}_sass.csv; head -c 600 $OUT/${k}_sass.csv; echo
done
