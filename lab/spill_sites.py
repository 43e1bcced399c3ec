"""Probe: where a kernel's register spills sit. Compiles one instantiation file for sm_90a with
line info, disassembles the cubin with nvdisasm and counts local-memory stores and loads (STL,
LDL) per source line of the kernels whose mangled name contains PATTERN: a spill in a per-block
prologue costs once, one in the tile loop every tile (ptxas -v gives only the bytes).

    python3 lab/spill_sites.py GEN/paged_prefill_wgmma_hdim128_bf16_kv_same.cu SoftcapE0

nvdisasm is not in this machine's toolkit; the local package index has it:
    pip download --no-deps -d /tmp/nvd nvidia-cuda-nvdisasm && unzip -q /tmp/nvd/*.whl -d /tmp/nvd/x
(NVDISASM defaults to /tmp/nvd/x/nvidia/cu13/bin/nvdisasm; instantiation files:
python3 scripts/generate_instantiations.py DIR.)
"""

import os
import re
import subprocess
import sys
from collections import Counter

NVDISASM = os.environ.get("NVDISASM", "/tmp/nvd/x/nvidia/cu13/bin/nvdisasm")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from kernel_resources import nvcc_flags  # noqa: E402  (the build's flags)


def main():
    source, pattern = sys.argv[1], sys.argv[2]
    cubin = "/tmp/spill_sites.cubin"
    flags = [*nvcc_flags(os.path.join(ROOT, "csrc"), "90a"), "-lineinfo"]
    subprocess.run([*flags, "-cubin", source, "-o", cubin], check=True)
    sass = subprocess.run([NVDISASM, "-g", "-c", cubin], capture_output=True, text=True, check=True)
    lines = sass.stdout.split("\n")
    headers = [i for i, line in enumerate(lines) if line.startswith("//---------------------")]
    for n, start in enumerate(headers):
        if pattern not in lines[start]:
            continue
        end = headers[n + 1] if n + 1 < len(headers) else len(lines)
        counts, where = Counter(), None
        for line in lines[start:end]:
            found = re.search(r'## File "([^"]+)", line (\d+)', line)
            if found:
                where = (os.path.basename(found.group(1)), int(found.group(2)))
            op = re.search(r"\b(STL|LDL)\b", line)
            if op:
                counts[(where, op.group(1))] += 1
        print(lines[start].split(".text.")[-1].split(" ")[0])
        for (at, op), count in sorted(counts.items(), key=lambda kv: kv[0][0] or ("", 0)):
            print(f"  {count:3d} {op} {at[0]}:{at[1]}" if at else f"  {count:3d} {op} ?")


if __name__ == "__main__":
    main()
