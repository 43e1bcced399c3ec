"""A small run of every cuda-backend kernel (append, decode with split-KV, prefill with a mask),
for `compute-sanitizer --tool memcheck`: ragged lengths that end mid-page, shuffled pages,
GQA, and a block table wider than any sequence needs. Every decode runs in each form the plan can
be told to use (torch.ops.astr.set_kernel_tuning): 2 splits as block pairs (D = 128 on sm_90), in a
thread-block cluster (sm_90) and with the merge kernel, 1 split as eight-warp blocks (D = 128) and
as the persistent decode on 2 blocks (so each block claims several items), for short sequences and
for one of 1500 tokens; prefills on each kernel (warp-specialised and wgmma where they run,
mma.sync, and the persistent warp-specialised one on 2 blocks, so each block takes several
items), the wgmma and mma.sync ones reading FP8 pools themselves. A form that
cannot run a shape leaves the choice to the plan, as in the kernel tests. Then the variants
(window, softcap, sinks, lse) through every form, and bad metadata (page ids outside the pool,
lengths past the block table, negative lengths, a decreasing query_start_loc) that the kernels
must survive without reading outside their tensors. The same with FP8 pools (e4m3, per-head
scales: the prefill kernels reading the bytes, and the dequantizing pass before the
warp-specialised one), then a seeded fuzz: random page ids,
lengths and query_start_loc values, 16-bit and FP8 pools, decode and prefill. Last, latent
attention (mla_attention and append_mla) with good and bad metadata."""

import torch

import astrai.extension  # noqa: F401  (loads the library)

DECODE_FORMS = (
    "decode_form=block_pairs,decode_splits=2",
    "decode_form=cluster,decode_splits=2",
    "decode_form=split,decode_splits=2",  # the merge kernel
    "decode_form=eight_warps,decode_splits=1",
    "decode_form=persistent,persistent_blocks=2",
)
# fp8_prefill only matters for FP8 pools: there the wgmma and mma.sync prefills read the bytes,
# and the warp-specialised one (or the plan's choice where it does not run) dequantized pages.
PREFILL_KERNELS = (
    "prefill_kernel=warp_specialized",
    "prefill_kernel=wgmma,fp8_prefill=in_kernel",
    "prefill_kernel=mma_sync,fp8_prefill=in_kernel",
    "prefill_kernel=persistent,persistent_blocks=2",
)


# The order in which this script lists a call's arguments (decode a bool, softcap 0.0 off).
CALL_ORDER = (
    "q k_cache v_cache block_table seq_lens query_start_loc max_query_len decode attn_mask "
    "is_causal scale window_left softcap sinks return_lse k_scale v_scale"
).split()


def paged_attention(tuning: str, *args):
    """torch.ops.astr.cuda_paged_attention over `args` (CALL_ORDER) with the plan told `tuning`;
    the automatic choice again afterwards."""
    call = dict(zip(CALL_ORDER, args))
    call["mode"] = "decode" if call.pop("decode") else "prefill"
    call["softcap"] = call.get("softcap") or None
    torch.ops.astr.set_kernel_tuning(tuning)
    try:
        return torch.ops.astr.cuda_paged_attention(call.pop("q"), **call)[0]
    finally:
        torch.ops.astr.set_kernel_tuning("")


def main() -> None:
    torch.manual_seed(0)
    device, dtype = "cuda", torch.bfloat16
    for head_dim, page_size in ((64, 1), (96, 16), (128, 16), (256, 64)):
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
        prefill = (q, k_cache, v_cache, block_table, seq_lens, starts, 4, False, mask, True, 0.1)
        prefills = [paged_attention(kernel, *prefill) for kernel in PREFILL_KERNELS]
        decode = (q[:3], k_cache, v_cache, block_table, seq_lens, starts, 1, True, None, False, 0.1)
        decodes = [paged_attention(form, *decode) for form in DECODE_FORMS]
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
        long_decode = (long_q, long_k, long_v, long_table, long_lens, starts[:2], 1, True, None)
        long_decode += (True, 0.1)
        long_decodes = [paged_attention(form, *long_decode) for form in DECODE_FORMS]
        torch.cuda.synchronize()
        assert all(torch.isfinite(x).all() for x in prefills + decodes + long_decodes)
        assert all(
            torch.allclose(x.float(), prefills[-1].float(), atol=2e-2) for x in prefills[:-1]
        )
        for other in range(1, len(DECODE_FORMS)):
            assert torch.allclose(decodes[0].float(), decodes[other].float(), atol=2e-2)
            assert torch.allclose(long_decodes[0].float(), long_decodes[other].float(), atol=2e-2)
        # The variants: a window, a softcap, sinks and the lse, through every form.
        sinks = torch.randn(q_heads, device=device)
        variants = (16, 3.0, sinks, True)
        for form in DECODE_FORMS:
            out = paged_attention(form, *long_decode, *variants)
            assert torch.isfinite(out).all()
        for kernel in PREFILL_KERNELS:
            assert torch.isfinite(paged_attention(kernel, *prefill, *variants)).all()
        # Bad metadata: never an access outside the tensors (the memory checker's part); the
        # sequences concerned come back as NaN.
        pool = k_cache.shape[0]
        for bad_page in (-5, pool, 1 << 30):
            table = block_table.clone()
            table[2, 0] = bad_page
            for form in DECODE_FORMS:
                paged_attention(form, q[:3], k_cache, v_cache, table, *decode[4:])
            for kernel in PREFILL_KERNELS:
                paged_attention(kernel, q, k_cache, v_cache, table, *prefill[4:])
        for lens in ([1, -7, 3], [1, 5, width * page_size + 100]):
            bad_lens = torch.tensor(lens, dtype=torch.int32, device=device)
            for form in DECODE_FORMS:
                paged_attention(form, q[:3], k_cache, v_cache, block_table, bad_lens, *decode[5:])
            for kernel in PREFILL_KERNELS:
                args = (q, k_cache, v_cache, block_table, bad_lens, *prefill[5:])
                paged_attention(kernel, *args)
        for bad_starts in ([0, 4, 1, 8], [0, 1, 4, 40], [0, -3, 4, 8]):
            starts_bad = torch.tensor(bad_starts, dtype=torch.int32, device=device)
            for kernel in PREFILL_KERNELS:
                args = (q, k_cache, v_cache, block_table, seq_lens, starts_bad, *prefill[6:])
                paged_attention(kernel, *args)
        # FP8 pools: the same calls, good and bad metadata.
        fp8 = (k_cache.float().clamp(-400, 400).to(torch.float8_e4m3fn),)
        fp8 += (v_cache.float().clamp(-400, 400).to(torch.float8_e4m3fn),)
        scales = (torch.rand(kv_heads, device=device) + 0.5, torch.rand(kv_heads, device=device))
        for table in (block_table, bad_table(block_table, pool)):
            for form in DECODE_FORMS:
                args = (q[:3], *fp8, table, *decode[4:], -1, 0.0, None, False, *scales)
                assert paged_attention(form, *args).shape == q[:3].shape
            for kernel in PREFILL_KERNELS:
                args = (q, *fp8, table, *prefill[4:], -1, 0.0, None, False, *scales)
                paged_attention(kernel, *args)
        torch.cuda.synchronize()
        print(f"head_dim {head_dim} page_size {page_size}: ok")
    fuzz_bad_metadata(device, dtype)
    latent_attention_smoke(device, dtype)


def bad_table(table, pool):
    out = table.clone()
    out[0, 0], out[2, 1] = -1, pool + 3
    return out


def fuzz_bad_metadata(device, dtype, cases=40):
    """Random metadata, most of it wrong, through decode and prefill on 16-bit and FP8 pools:
    the kernels must only ever read the pools and write their outputs (memcheck's part)."""
    g = torch.Generator().manual_seed(1)

    def ints(low, high, n):
        return torch.randint(low, high, (n,), generator=g)

    refused = 0
    for case in range(cases):
        head_dim = (64, 96, 128, 256)[case % 4]
        page_size = (1, 16, 64)[case % 3]
        pages, kv_heads, q_heads, batch, width = 16, 2, 4, int(ints(1, 5, 1)), int(ints(1, 6, 1))
        k_cache = torch.randn(pages, page_size, kv_heads, head_dim, generator=g).to(device)
        v_cache = torch.randn_like(k_cache)
        scales = (None, None)
        if case % 2:
            k_cache, v_cache = (c.to(torch.float8_e4m3fn) for c in (k_cache, v_cache))
            scales = (torch.rand(kv_heads, device=device) + 0.5,) * 2
        else:
            k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
        table = ints(-3, pages + 3, batch * width).view(batch, width).int().to(device)
        lens = ints(-4, width * page_size + 40, batch).int().to(device)
        q_lens = ints(1, 9, batch)
        tokens = int(q_lens.sum())
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)])
        if case % 3 == 0:
            starts = starts + ints(-4, 5, batch + 1)  # often decreasing or past the tokens
        starts = starts.int().to(device)
        q = torch.randn(tokens, q_heads, head_dim, generator=g).to(device, dtype)
        tail = (-1, 0.0, None, False, *scales)
        decode_starts = torch.arange(batch + 1, dtype=torch.int32, device=device)
        calls = [
            (form, q[:batch], k_cache, v_cache, table, lens, decode_starts, 1, True)
            for form in DECODE_FORMS
        ]
        calls += [
            (kernel, q, k_cache, v_cache, table, lens, starts, 8, False)
            for kernel in PREFILL_KERNELS
        ]
        for call in calls:
            try:
                paged_attention(*call, None, True, 0.1, *tail)
            except ValueError:  # refused on the host (an argument's shape or type): fine too
                refused += 1
        torch.cuda.synchronize()
    print(f"fuzz: {cases} random metadata cases: ok ({refused} calls refused on the host)")


def latent_attention_smoke(device, dtype):
    """astr::mla_attention's cuda kernel and astr::append_mla's (issue 50): bf16 and e4m3
    latents, pages of 1, 64 and 256, 24 heads (a partial group of 16), decode and a 2-token
    prefill over ragged lengths ending mid-page, then bad page ids, lengths and query_start_loc,
    which the kernels must survive without reading outside their tensors."""
    heads, latent, rope = 24, 512, 64
    for page_size in (1, 64, 256):
        pages, width = (48, 12) if page_size > 1 else (3000, 700)
        ckv = torch.randn(pages, page_size, latent, device=device, dtype=dtype)
        krope = torch.randn(pages, page_size, rope, device=device, dtype=dtype)
        table = torch.randperm(pages, device=device)[: 3 * width].view(3, width).int()
        seq_lens = torch.tensor([2, 130, 611], dtype=torch.int32, device=device)
        slots = (table[:, 0] * page_size).int()
        slots[1] = -1
        new_ckv = torch.randn(3, latent, device=device, dtype=dtype)
        new_krope = torch.randn(3, rope, device=device, dtype=dtype)
        torch.ops.astr.append_mla(new_ckv, new_krope, ckv, krope, slots)
        scale = torch.tensor([0.05], device=device)
        fp8 = (ckv.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        torch.ops.astr.append_mla(new_ckv, new_krope, fp8, krope, slots, scale)
        for tokens in (1, 2):
            call = dict(
                q_nope=torch.randn(3 * tokens, heads, latent, device=device, dtype=dtype),
                q_rope=torch.randn(3 * tokens, heads, rope, device=device, dtype=dtype),
                krope_cache=krope,
                block_table=table,
                seq_lens=seq_lens,
                query_start_loc=torch.arange(0, 3 * tokens + 1, tokens, device=device).int(),
                max_query_len=tokens,
                mode="decode" if tokens == 1 else "prefill",
                scale=0.04,
                return_lse=True,
            )
            bad_calls = [dict(block_table=bad_table(table, pages))]
            for bad in ([1, -7, 3], [1, 130, width * page_size + 100]):
                bad_calls.append(dict(seq_lens=torch.tensor(bad, dtype=torch.int32, device=device)))
            if tokens == 2:
                for bad in ([0, 4, 1, 6], [0, 2, 4, 40], [0, -3, 4, 6]):
                    starts = torch.tensor(bad, dtype=torch.int32, device=device)
                    bad_calls.append(dict(query_start_loc=starts))
            for pool in (dict(ckv_cache=ckv), dict(ckv_cache=fp8, ckv_scale=scale)):
                out, _ = torch.ops.astr.cuda_mla_attention(**call, **pool)
                assert torch.isfinite(out).all()
                for changes in bad_calls:
                    torch.ops.astr.cuda_mla_attention(**{**call, **pool, **changes})
        torch.cuda.synchronize()
        print(f"latent attention, page_size {page_size}: ok")


if __name__ == "__main__":
    main()
