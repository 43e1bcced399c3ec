#!/bin/bash
# The session's closing H200 call: every GPU test, memcheck and racecheck
# (lab/ws_prefill_probe.sh with FULL=1 AB=0), racecheck of the D = 96 wgmma prefill, then
# benchmarks/bench_fp8.py. The library: .devbuild/$LIBNAME from .devbuild/ab/libs.tar.xz.
set -u
[ -f .devbuild/ab/libs.tar.xz ] && tar -xJf .devbuild/ab/libs.tar.xz -C .devbuild
LIB=.devbuild/${LIBNAME:-final} FULL=1 AB=0 bash lab/ws_prefill_probe.sh
mv "$OUT/session.log" "$OUT/tests.log"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
timeout 90 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest -q \
  -p no:cacheprovider tests/kernels/test_cuda_kernels.py \
  -k "prefill_ragged_batch_with_uneven and wgmma or prefill_matches_reference and wgmma-16-1-True-96-dtype0" \
  >"$OUT/racecheck_wgmma.log" 2>&1
echo "racecheck wgmma rc=$?"; tail -2 "$OUT/racecheck_wgmma.log"
mkdir -p "$OUT/bench"
timeout 150 python3 benchmarks/bench_fp8.py --out "$OUT/bench" 2>&1 | grep -v Warning
