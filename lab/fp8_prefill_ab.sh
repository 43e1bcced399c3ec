#!/bin/bash
# FP8 prefill variants (issue 30): benchmarks/bench_fp8.py --only prefill for each library in
# $LIBS (dirs under .devbuild, each with _C.abi3.so and REV), one process per library, FP8 against
# bf16 interleaved inside it; then the smoke tests of the first library.
set -u
source lab/device_prelude.sh
for lib in ${LIBS:-new}; do
  cp .devbuild/$lib/_C.abi3.so astrai/_C.abi3.so && echo "== $lib: $(cat .devbuild/$lib/REV)"
  mkdir -p "$OUT/$lib"
  timeout 120 python3 benchmarks/bench_fp8.py --only prefill --out "$OUT/$lib" 2>&1 | grep -v Warning
done
