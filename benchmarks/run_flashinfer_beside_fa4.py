"""Runs bench_attention.py (same arguments) with FlashInfer and FlashAttention-4 in one process
(the prefill record's peers). The FlashInfer wheel carried from ../shared/peers is trimmed: it
leaves out FlashInfer's CuTe-DSL submodules, and `import flashinfer` loads them whenever the CUTLASS
DSL (which FlashAttention-4 needs, scripts/flash_wheels.sh) is importable, so that import fails.
Here FlashInfer is imported first with the DSL's site off sys.path; then the site is put back.

    source scripts/flash_wheels.sh install   # FlashAttention-4's site on PYTHONPATH
    python3 benchmarks/run_flashinfer_beside_fa4.py --quick --only prefill \
        --peers cuda_ps16,flashinfer_fa3,astrai_flash,sdpa_cudnn
"""

import importlib
import os
import runpy
import sys

FA4_SITE = "/tmp/astrai-flash-site"  # scripts/flash_wheels.sh's SITE
HERE = os.path.dirname(os.path.abspath(__file__))

dsl_paths = [p for p in sys.path if p.startswith(FA4_SITE)]
sys.path[:] = [p for p in sys.path if not p.startswith(FA4_SITE)]
import flashinfer  # noqa: E402,F401

sys.path[:0] = dsl_paths
importlib.invalidate_caches()
import flash_attn.cute  # noqa: E402,F401  (fails here, not mid-benchmark, if the site is wrong)

print(f"flashinfer {flashinfer.__version__} and flash_attn.cute imported", flush=True)
script = os.path.join(HERE, "bench_attention.py")
sys.argv = [script] + sys.argv[1:]
sys.path.insert(0, os.path.dirname(script))
runpy.run_path(script, run_name="__main__")
