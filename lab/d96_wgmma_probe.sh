#!/bin/bash
# D = 96 on the wgmma prefill (issue 32): for each library in $LIBS (dirs under .devbuild, from
# .devbuild/ab/libs.tar.xz), the D = 96 prefill tests, then lab/prefill_kernel_ab.py at D = 96
# (the mma.sync and wgmma kernels of that library and cuDNN, interleaved per shape).
set -u
source lab/device_prelude.sh
for lib in ${LIBS:-new}; do
  cp .devbuild/$lib/_C.abi3.so astrai/_C.abi3.so && echo "== $lib: $(cat .devbuild/$lib/REV)"
  timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE -n 5 tests/kernels/test_cuda_kernels.py \
    tests/kernels/test_cuda_variants.py tests/kernels/test_cuda_fp8.py -k "96 and prefill" \
    >"$OUT/t_$lib.log" 2>&1
  grep -E "FAILED|ERROR" "$OUT/t_$lib.log" | head -10; tail -1 "$OUT/t_$lib.log"
  timeout 200 python3 lab/prefill_kernel_ab.py "$OUT/ab_$lib.json" --dims 96 \
    --tunings prefill_kernel=mma_sync,prefill_kernel=wgmma --peers sdpa_cudnn 2>&1 | grep -v Warning
done
