#!/bin/bash
# Probe (one device call): why this build's prefill runs ~7% behind the baseline's. Dumps the
# SASS of both builds' bf16 prefill kernels and reads ncu's counters for one call of each.
set -u
export PYTHONPATH=$PWD
cp .devbuild/new/_C.abi3.so astrai/_C.abi3.so
for lib in new old; do
  cuobjdump --dump-sass .devbuild/$lib/_C.abi3.so > /tmp/$lib.sass 2>/dev/null
  python3 - "$lib" <<'PY'
import re, sys
lib = sys.argv[1]
text = open(f"/tmp/{lib}.sass").read()
parts = re.split(r"\n\s+Function : ", text)
def wanted(name):  # the bf16 prefill kernels (the baseline's mma.sync one: decode=false)
    return "bfloat16" in name and (
        ("prefill" in name and ("Li128E" in name or "Li64E" in name))
        or "PagedAttentionTraitsILi64ELb0E" in name)
keep = [p for p in parts if wanted(p.split("\n")[0])]
with open(f"{__import__('os').environ['OUT']}/sass_{lib}.txt", "w") as f:
    for p in keep:
        f.write("Function : " + p + "\n")
print(lib, [p.split("\n")[0][:120] for p in keep])
PY
done
gzip -f $OUT/sass_new.txt $OUT/sass_old.txt
timeout 150 ncu --clock-control none --kernel-name regex:'prefill|paged_attention_kernel' \
  --metrics gpu__time_duration.sum,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__warp_issue_stalled_barrier_per_warp_active.pct,smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct,smsp__warp_issue_stalled_wait_per_warp_active.pct,smsp__warp_issue_stalled_math_pipe_throttle_per_warp_active.pct,launch__registers_per_thread \
  python3 lab/prefill_ab_ncu.py .devbuild/old/_C.abi3.so > $OUT/ncu.txt 2>&1
tail -80 $OUT/ncu.txt
ls -la $OUT
