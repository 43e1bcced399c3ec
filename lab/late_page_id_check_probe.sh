#!/bin/bash
# One device call for the later page-id check (lab/patches/prefill_late_page_id_check.patch; NOTES
# version 28): its library against main's in one process. From a tree with the patch applied and
# .devbuild/base exported from main (BASELINE_EXPORT_ONLY=1 bash benchmarks/build_baseline.sh MAIN
# .devbuild/base; namespace astr_old); carry .devbuild (and .peers for fa3). Builds both libraries,
# then lab/ws_prefill_probe.sh: the prefill tests, memcheck, racecheck, and the after / before rows
# (BASE=1). No fa3 JIT warm-up: it took 230 s of the last call, and after / before needs no peer.
set -u
mkdir -p "$OUT" .devbuild/new
(MAX_JOBS=6 TORCH_CUDA_ARCH_LIST=9.0 bash benchmarks/build_baseline.sh - .devbuild/base \
  >"$OUT/build_base.log" 2>&1) &
BASE_PID=$!
MAX_JOBS=10 TORCH_CUDA_ARCH_LIST=9.0 python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1 ||
  { tail -20 "$OUT/build.log"; exit 1; }
wait $BASE_PID || { tail -20 "$OUT/build_base.log"; exit 1; }
cp astrai/_C.abi3.so .devbuild/new/ && echo "main + late page-id check patch" >.devbuild/new/REV
cp .devbuild/base/astrai/_C.abi3.so .devbuild/base/_C.abi3.so
LIB=.devbuild/new AB=0 BASE=1 bash lab/ws_prefill_probe.sh
