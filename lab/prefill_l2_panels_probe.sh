#!/bin/bash
# One device call for the L2-panel block order and the later page-id check (lab/NOTES.md, version
# 27), from a tree with lab/patches/prefill_l2_panels.patch and prefill_late_page_id_check.patch
# applied, and .devbuild/base exported from the tree with the first patch only (namespace astr_old,
# BASELINE_EXPORT_ONLY=1 bash benchmarks/build_baseline.sh COMMIT .devbuild/base). Carry .devbuild
# and .peers. Builds both, prefill tests, racecheck, the panel A/B, the record with the baseline.
set -u
export PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R
exec > >(tee "$OUT/session.log") 2>&1
pack() { tar -czf "$OUT/results.tar.gz" -C "$R" .; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fisite \
  .peers/flashinfer/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/fisite FLASHINFER_WORKSPACE_BASE=/tmp/fi_cache
T0=$(date +%s)
(MAX_JOBS=6 TORCH_CUDA_ARCH_LIST=9.0 bash benchmarks/build_baseline.sh - .devbuild/base >$R/build_base.log 2>&1; echo "base rc=$?" >>$R/build_base.log) &
BB=$!
MAX_JOBS=10 TORCH_CUDA_ARCH_LIST=9.0 python3 setup.py build_ext --inplace >$R/build.log 2>&1
echo "build rc=$? $(( $(date +%s) - T0 )) s"; tail -2 $R/build.log | cut -c1-300
python3 -c "import astrai.extension as e; print(e.ops.BUILD_INFO)" | head -3
timeout 90 python3 -m pytest -q -p no:cacheprovider -x tests/kernels/test_cuda_kernels.py \
  -k "panels_of_pairs or (ragged_batch_with_uneven and warp_specialized)" >"$R/t_smoke.log" 2>&1
rc=$?; tail -2 "$R/t_smoke.log"
if [ $rc != 0 ]; then echo "smoke failed: stopping"; grep -E "Error|assert|FAILED" $R/t_smoke.log | head; pack; exit 1; fi
wait $BB; tail -2 $R/build_base.log; echo "both built $(( $(date +%s) - T0 )) s"
(MAX_JOBS=8 timeout 200 python3 lab/flashinfer_warm.py 64,256 >"$R/fi_warm.log" 2>&1) &
FI=$!
PY="timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE -n 4"
$PY tests/kernels/test_cuda_kernels.py -k "prefill or head_major or scale" >$R/t_kernels.log 2>&1 &
P1=$!
$PY -m cuda tests/kernels/test_cuda_variants.py tests/kernels/test_cuda_fp8.py \
  tests/kernels/test_cuda_bad_metadata.py -k prefill >$R/t_variants.log 2>&1 &
P2=$!
(timeout 140 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
  tests/kernels/test_cuda_kernels.py -k "ragged_batch_with_uneven and warp_specialized" >$R/racecheck.log 2>&1; echo "racecheck rc=$?" >>$R/racecheck.log) &
P3=$!
wait $P1 $P2 $P3
for f in t_kernels t_variants; do echo "--- $f"; grep -E "FAILED|ERROR" $R/$f.log | head -10; tail -1 $R/$f.log; done
tail -3 $R/racecheck.log
wait $FI; tail -3 $R/fi_warm.log
pack
echo "=== A/B block order $(date +%T)"
timeout 160 python3 lab/prefill_kernel_ab.py $R/ab_panels.json --dims 128,96 \
  --tunings "prefill_l2_panel=all,auto" 2>&1 | grep -v Warning | tee $R/ab_panels.log
pack
echo "=== record $(date +%T)"
B="python3 benchmarks/bench_attention.py --only prefill --repeats 20 --baseline-lib .devbuild/base/astrai/_C.abi3.so --baseline-namespace astr_old"
timeout 220 $B --quick --peers cuda_ps16,cuda_ps16_before,flashinfer_fa3,sdpa_cudnn --out $R/record >$R/record.log 2>&1; echo "record rc=$?"
grep -E "^\| " $R/record.log | head -40
pack
echo "done $(date +%T)"
