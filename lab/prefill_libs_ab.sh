#!/bin/bash
# Prefill kernels of two or more libraries (issue 32): the prefill tests of the last library in
# $LIBS, then lab/prefill_kernel_ab.py (the plan's kernel, no peers) once per library in the
# order given, one process each (list them alternating, A B A B, to see the noise between
# processes). Libraries: dirs under .devbuild from .devbuild/ab/libs.tar.xz.
set -u
source lab/device_prelude.sh
LIBS=${LIBS:-new}
last=${LIBS##* }
cp .devbuild/$last/_C.abi3.so astrai/_C.abi3.so && echo "== tests: $last: $(cat .devbuild/$last/REV)"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE -n 5 tests/kernels/test_cuda_kernels.py \
  tests/kernels/test_cuda_variants.py tests/kernels/test_cuda_fp8.py -k "prefill" >"$OUT/t.log" 2>&1
grep -E "FAILED|ERROR" "$OUT/t.log" | head -10; tail -1 "$OUT/t.log"
i=0
for lib in $LIBS; do
  i=$((i + 1))
  cp .devbuild/$lib/_C.abi3.so astrai/_C.abi3.so && echo "== $i $lib: $(cat .devbuild/$lib/REV)"
  timeout 120 python3 lab/prefill_kernel_ab.py "$OUT/ab_${i}_$lib.json" --quick --tunings auto \
    --dims ${DIMS:-128,64,256,96} --peers "" 2>&1 | grep -v Warning
done
