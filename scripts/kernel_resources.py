"""Compiles the paged-attention instantiations for one arch with `ptxas -v` and prints each
kernel's registers, spills and stack: the resource report to read before and after a kernel change
(no GPU needed).

    python scripts/kernel_resources.py [--arch 90a] [--filter decode_hdim128] [--csrc DIR]

--csrc points at another tree's csrc/ (e.g. an older commit exported with git archive) whose
generated or hand-written instantiation files are compiled instead; with no generator there, every
.cu under DIR/kernels is compiled.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import generate_instantiations  # noqa: E402


def nvcc_flags(include: str, arch: str) -> list:
    """nvcc and the flags an instantiation file compiles with here (as setup.py builds it)."""
    return [
        shutil.which("nvcc") or "nvcc",
        "-std=c++17",
        "-O3",
        "--use_fast_math",
        "--expt-relaxed-constexpr",
        f"-gencode=arch=compute_{arch},code=sm_{arch}",
        "-DASTR_WITH_CUDA=1",
        *(["-DASTR_WITH_SM90A=1"] if arch == "90a" else []),
        "-I",
        include,
    ]


def compile_report(source: str, include: str, arch: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [*nvcc_flags(include, arch), "-c", source, "-o", os.path.join(tmp, "out.o")]
        cmd += ["-Xptxas", "-v"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            return f"FAIL {source}\n{result.stderr[-3000:]}"
        return result.stderr


def demangle(names):
    filt = shutil.which("cu++filt") or shutil.which("c++filt")
    if filt is None:
        return names
    out = subprocess.run([filt], input="\n".join(names), capture_output=True, text=True).stdout
    return out.splitlines()


def parse(report: str):
    rows = []
    current = None
    for line in report.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            current = {"name": m.group(1), "spill": "", "regs": ""}
            rows.append(current)
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill", line)
        if m:
            current["spill"] = f"stack {m.group(1)} spill {m.group(2)}/{m.group(3)}"
        m = re.search(r"Used (\d+) registers", line)
        if m:
            current["regs"] = m.group(1)
    return rows


def short(name: str) -> str:
    """The demangled name without namespaces and without its parameter list: the last
    parenthesised group only, so that template arguments such as `(Softcap)1` stay and each
    instantiation keeps a line of its own."""
    name = re.sub(r"astr::kernels::", "", name)
    if name.endswith(")"):
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                return name[:i]
    return name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="90a")
    parser.add_argument("--filter", default="")
    parser.add_argument("--csrc", default=os.path.join(ROOT, "csrc"))
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("MAX_JOBS", "2")))
    args = parser.parse_args()
    csrc = os.path.abspath(args.csrc)
    if csrc == os.path.join(ROOT, "csrc"):
        out_dir = os.path.join(ROOT, "build-cu", "generated")
        sources = generate_instantiations.write(out_dir)
    else:
        sources = sorted(glob.glob(os.path.join(csrc, "kernels", "**", "*.cu"), recursive=True))
    sources = [s for s in sources if args.filter in os.path.basename(s)]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        reports = list(pool.map(lambda s: compile_report(s, csrc, args.arch), sources))
    seen = set()
    for report in reports:
        if report.startswith("FAIL"):
            print(report)
            continue
        rows = parse(report)
        names = demangle([r["name"] for r in rows])
        for row, name in zip(rows, names):
            key = short(name)
            if key in seen:
                continue
            seen.add(key)
            print(f"{row['regs']:>4} regs  {row['spill']:<24} {key}")


if __name__ == "__main__":
    main()
