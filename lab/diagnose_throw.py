# ruff: noqa: E501
"""Which error paths of the native library raise cleanly? Each case runs in a child process, so
a crash (a signal) is reported instead of ending the run."""

import subprocess
import sys

SETUP = """
import torch, astrai.extension
q = torch.randn(2, 5, 4, 16); k = torch.randn(2, 7, 2, 16)
"""
CASES = {
    "strict mismatch (message: one string)": "torch.ops.astr.attention(q, k, k, backend='cuda')",
    "pop on empty stack": "torch.ops.astr.pop_backend()",
    "dense q rank (multi-arg message)": "torch.ops.astr.attention(q[0], k, k)",
    "mode bogus (TORCH_CHECK_VALUE)": "torch.ops.astr.attention(q, k, k, mode='bogus')",
    "unknown backend in check_backend": "torch.ops.astr.check_backend('nope', q, None, None, False, None, False)",
    "k batch": "torch.ops.astr.attention(q, k[:1], k[:1])",
    "cuda binding dtype": "torch.ops.astr.cuda_paged_attention(q[0].float().cuda(), k.cuda(), k.cuda(), k.int().cuda(), k.int().cuda(), k.int().cuda(), 1, True, None, False, 1.0)",
}
worst = 0
for name, code in CASES.items():
    script = (
        SETUP
        + f"try:\n    {code}\n    print('NO ERROR')\nexcept Exception as e:\n    print(type(e).__name__, str(e).splitlines()[0][:100])\n"
    )
    result = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", script], capture_output=True, text=True
    )
    outcome = result.stdout.strip() or result.stderr.strip().splitlines()[-1:]
    print(f"{name:<40} rc={result.returncode} {outcome}")
    if result.returncode != 0:
        worst = result.returncode
        print("\n".join(result.stderr.splitlines()[:6]))
sys.exit(1 if worst else 0)
