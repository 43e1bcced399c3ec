"""A small run of every cuda-backend kernel (append, decode with split-KV, prefill with a mask),
for `compute-sanitizer --tool memcheck`: ragged lengths that end mid-page, shuffled pages,
GQA, and a block table wider than any sequence needs. Decodes run in 2 splits, three times: as
block pairs (D = 128 on sm_90), in a thread-block cluster (sm_90) and with the merge kernel, and
in 1 split as eight-warp blocks (D = 128), for short sequences and for one of 1500 tokens;
prefills twice: on wgmma (where it runs) and on mma.sync."""

import os

os.environ.setdefault("ASTR_TUNE_KERNELS", "1")  # before the first call: arms the kernel switches

import torch  # noqa: E402

import astrai.extension  # noqa: F401, E402  (loads the library)

# The binding's switches of each way to merge 2 decode splits, and of one split as eight-warp
# blocks (read on every call).
TWO = {"ASTR_DECODE_SPLITS": "2"}  # the only count merged in a pair
MERGES = (
    {**TWO, "ASTR_DECODE_BLOCK_PAIRS": "1"},  # block pairs where they run (D = 128), else a cluster
    {**TWO, "ASTR_DECODE_BLOCK_PAIRS": "0"},  # a cluster
    {**TWO, "ASTR_DECODE_CLUSTER_MERGE": "0"},  # the merge kernel
    {"ASTR_DECODE_SPLITS": "1", "ASTR_DECODE_EIGHT_WARPS": "1"},  # eight-warp blocks (D = 128)
)
SWITCHES = ("ASTR_DECODE_SPLITS", "ASTR_DECODE_BLOCK_PAIRS", "ASTR_DECODE_CLUSTER_MERGE")
SWITCHES += ("ASTR_DECODE_EIGHT_WARPS",)


def set_merge(switches: dict) -> None:
    for name in SWITCHES:
        os.environ.pop(name, None)
    os.environ.update(switches)


def main() -> None:
    torch.manual_seed(0)
    device, dtype = "cuda", torch.bfloat16
    for head_dim, page_size in ((64, 1), (128, 16), (256, 64)):
        pages, kv_heads, q_heads = 64, 2, 8
        k_cache = torch.randn(pages, page_size, kv_heads, head_dim, device=device, dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        seq_lens = torch.tensor([1, 5, page_size * 3 + 1], dtype=torch.int32, device=device)
        width = 8
        block_table = torch.randperm(pages, device=device)[: 3 * width].view(3, width).int()
        q_lens = [1, 3, 4]
        starts = torch.tensor([0, 1, 4, 8], dtype=torch.int32, device=device)
        tokens = sum(q_lens)
        slots = (block_table[2, 0] * page_size).repeat(tokens).int()
        k_new = torch.randn(tokens, kv_heads, head_dim, device=device, dtype=dtype)
        torch.ops.astr.append_kv(k_new, k_new, k_cache, v_cache, slots)
        q = torch.randn(tokens, q_heads, head_dim, device=device, dtype=dtype)
        mask = torch.rand(tokens, page_size * 3 + 1, device=device) > 0.3
        prefills = []
        for wgmma in ("1", "0"):
            os.environ["ASTR_PREFILL_WGMMA"] = wgmma
            prefills.append(
                torch.ops.astr.cuda_paged_attention(
                    q, k_cache, v_cache, block_table, seq_lens, starts, 4, False, mask, True, 0.1
                )
            )
        decodes = []
        for merge in MERGES:
            set_merge(merge)
            decodes.append(
                torch.ops.astr.cuda_paged_attention(
                    q[:3],
                    k_cache,
                    v_cache,
                    block_table,
                    seq_lens,
                    starts,
                    1,
                    True,
                    None,
                    False,
                    0.1,
                )
            )
        # One longer sequence (24 tiles of 64, 12 per split): the pipeline past its prologue.
        long_len = 1500
        long_pages = -(-long_len // page_size)
        long_k = torch.randn(
            long_pages + 3, page_size, kv_heads, head_dim, device=device, dtype=dtype
        )
        long_v = torch.randn_like(long_k)
        long_table = torch.randperm(long_pages + 3, device=device)[:long_pages].view(1, -1).int()
        long_lens = torch.tensor([long_len], dtype=torch.int32, device=device)
        long_q = torch.randn(1, q_heads, head_dim, device=device, dtype=dtype)
        long_decodes = []
        for merge in MERGES:
            set_merge(merge)
            long_decodes.append(
                torch.ops.astr.cuda_paged_attention(
                    long_q,
                    long_k,
                    long_v,
                    long_table,
                    long_lens,
                    starts[:2],
                    1,
                    True,
                    None,
                    True,
                    0.1,
                )
            )
        torch.cuda.synchronize()
        assert all(torch.isfinite(x).all() for x in prefills + decodes + long_decodes)
        assert torch.allclose(prefills[0].float(), prefills[1].float(), atol=2e-2)
        for other in range(1, len(MERGES)):
            assert torch.allclose(decodes[0].float(), decodes[other].float(), atol=2e-2)
            assert torch.allclose(long_decodes[0].float(), long_decodes[other].float(), atol=2e-2)
        print(f"head_dim {head_dim} page_size {page_size}: ok")


if __name__ == "__main__":
    main()
