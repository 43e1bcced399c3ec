#!/bin/bash
# One device call for the L2-panel block order and the later page-id check (lab/NOTES.md, version
# 27), from a tree with lab/patches/prefill_l2_panels.patch and prefill_late_page_id_check.patch
# applied, and .devbuild/base exported from a commit with the first patch only (namespace astr_old:
# BASELINE_EXPORT_ONLY=1 bash benchmarks/build_baseline.sh COMMIT .devbuild/base). Carry .devbuild
# and .peers. Builds both libraries here, then lab/ws_prefill_probe.sh does the rest: prefill
# tests, memcheck, racecheck of the ragged warp-specialised prefill, the panel A/B beside fa3 and
# cuDNN (one library, prefill_l2_panel=all vs auto), the late check after / before (BASE=1).
set -u
mkdir -p "$OUT" .devbuild/new
(MAX_JOBS=6 TORCH_CUDA_ARCH_LIST=9.0 bash benchmarks/build_baseline.sh - .devbuild/base \
  >"$OUT/build_base.log" 2>&1) &
BASE_PID=$!
MAX_JOBS=10 TORCH_CUDA_ARCH_LIST=9.0 python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1 ||
  { tail -20 "$OUT/build.log"; exit 1; }
wait $BASE_PID || { tail -20 "$OUT/build_base.log"; exit 1; }
cp astrai/_C.abi3.so .devbuild/new/ && git rev-parse --short HEAD >.devbuild/new/REV 2>/dev/null ||
  echo "working tree" >.devbuild/new/REV
cp .devbuild/base/astrai/_C.abi3.so .devbuild/base/_C.abi3.so
LIB=.devbuild/new FI_WARM=64,256 BASE=1 \
  AB_ARGS="--dims 128,96 --tunings prefill_l2_panel=all,auto" bash lab/ws_prefill_probe.sh
