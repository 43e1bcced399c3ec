"""GPU tests of the cuda backend's own kernels: astr::append_kv and astr::cuda_paged_attention.

The reference is tests/reference.py's, written from the definition in float64, one sequence at a
time: gather the sequence's K/V through its block table, then softmax(q k^T * scale + masks) v.
Inputs are fresh random values on a pool of shuffled pages; pool slots that no sequence owns are
NaN, so a kernel that reads past a sequence's length shows up as NaN. Outputs are poisoned first
(see `poison_next_allocation`).
"""

import math

import pytest
import torch

from astrai.extension import ops  # loads the library, registers the ops
from tests.kernels.conftest import batch_cuda_op, captured_graph, cuda_op
from tests.reference import paged_reference

# Skipped where no GPU is visible (tests/conftest.py).
pytestmark = pytest.mark.cuda


TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 3e-3}
# The head dims the kernels were built for (config.h's list, as the library reports it): the rows
# of equal q/k and v head dims, and those whose v head dim differs ((192, 128): DeepSeek's MHA
# form).
HEAD_DIMS = ops.BUILD_INFO["paged_kernels"]["head_dims"] if torch.cuda.is_available() else [64, 128]
UNEQUAL_HEAD_DIMS = (
    [tuple(p) for p in ops.BUILD_INFO["paged_kernels"]["head_dim_pairs"] if p[0] != p[1]]
    if torch.cuda.is_available()
    else [(192, 128)]
)


def attention_op(*args, **kwargs):
    """The cuda op's output alone (tests/kernels/conftest.py: cuda_op's arguments)."""
    return cuda_op(*args, **kwargs)[0]


def poison_next_allocation(shape, dtype):
    """Fill a block of the output's size with NaN and free it, so that the caching allocator hands
    the same memory to the op's output: any element the kernel does not write stays NaN."""
    block = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    del block


class PagedBatch:
    """A ragged batch in a paged pool: random pages, shuffled, NaN in every unowned slot."""

    def __init__(
        self,
        seq_lens,
        q_lens,
        num_q_heads,
        num_kv_heads,
        head_dim,
        page_size,
        dtype,
        spare_pages=5,
        extra_width=2,
        generator=None,
        head_dim_v=None,
    ):
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        self.seq_lens_list = list(seq_lens)
        self.q_lens_list = list(q_lens)
        self.page_size = page_size
        dev = "cuda"
        pages_per_seq = [max(1, -(-n // page_size)) for n in seq_lens]
        num_pages = sum(pages_per_seq) + spare_pages
        self.k_cache = torch.randn(
            num_pages,
            page_size,
            num_kv_heads,
            head_dim,
            device=dev,
            dtype=dtype,
            generator=generator,
        )
        self.v_cache = torch.randn(
            num_pages,
            page_size,
            num_kv_heads,
            head_dim_v,
            device=dev,
            dtype=dtype,
            generator=generator,
        )
        perm = torch.randperm(num_pages, device=dev, generator=generator)
        width = max(pages_per_seq) + extra_width
        # Entries past a sequence's pages point outside the pool: the kernel must not read them.
        self.block_table = torch.full(
            (len(seq_lens), width), 1 << 30, dtype=torch.int32, device=dev
        )
        owned = torch.zeros(num_pages * page_size, dtype=torch.bool, device=dev)
        start = 0
        for b, (n, pages) in enumerate(zip(seq_lens, pages_per_seq)):
            ids = perm[start : start + pages]
            start += pages
            self.block_table[b, :pages] = ids.int()
            pos = torch.arange(n, device=dev)
            owned[ids[pos // page_size] * page_size + pos % page_size] = True
        flat_k = self.k_cache.view(-1, num_kv_heads, head_dim)
        flat_v = self.v_cache.view(-1, num_kv_heads, head_dim_v)
        flat_k[~owned] = float("nan")
        flat_v[~owned] = float("nan")
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
        qsl = [0]
        for n in q_lens:
            qsl.append(qsl[-1] + n)
        self.query_start_loc = torch.tensor(qsl, dtype=torch.int32, device=dev)
        self.num_tokens = qsl[-1]
        self.q = torch.randn(
            self.num_tokens, num_q_heads, head_dim, device=dev, dtype=dtype, generator=generator
        )
        self.k_scale = self.v_scale = None  # a 16-bit pool


def reference(batch, q, is_causal, scale, attn_mask=None, **variants):
    """The float64 reference (tests/reference.py) over the batch's pools, at the lengths in
    batch.seq_lens_list (a replayed graph's test changes them); variants: window_left, softcap,
    sinks, return_lse. An FP8 batch passes its scales."""
    return paged_reference(
        q,
        batch.k_cache,
        batch.v_cache,
        batch.block_table,
        batch.seq_lens_list,
        batch.query_start_loc,
        is_causal=is_causal,
        scale=scale,
        attn_mask=attn_mask,
        k_scale=batch.k_scale,
        v_scale=batch.v_scale,
        **variants,
    )


def assert_close(out, ref, dtype):
    assert out.dtype == dtype
    assert not torch.isnan(out).any(), "output has NaN (unwritten element or read of a NaN slot)"
    err = (out.double() - ref).norm() / ref.norm().clamp_min(1e-30)
    assert err < TOLERANCE[dtype], f"relative L2 error {err:.3e}"


def output_shape(batch, q):
    """[T, Hq, Dv]: the output's rows have v's head dim."""
    return (*q.shape[:-1], batch.v_cache.shape[-1])


def run_decode(batch, attn_mask=None, is_causal=True, scale=None):
    poison_next_allocation(output_shape(batch, batch.q), batch.q.dtype)
    scale = 1.0 / math.sqrt(batch.q.shape[-1]) if scale is None else scale
    return batch_cuda_op(
        batch,
        batch.q,
        1,
        True,
        attn_mask,
        is_causal,
        scale,
    )[0]


def run_prefill(batch, q, scale, is_causal=True, attn_mask=None):
    poison_next_allocation(output_shape(batch, q), q.dtype)
    return batch_cuda_op(
        batch,
        q,
        max(batch.q_lens_list),
        False,
        attn_mask,
        is_causal,
        scale,
    )[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
@pytest.mark.parametrize("group", [1, 4, 8, 12, 16])
def test_decode_matches_reference(dtype, head_dim, page_size, group):
    """Groups of 1-16 query heads per kv head: one block's rows, of which 12 and 16 take both of
    the decode's 8-row head tiles (the second one partly padding at 12)."""
    g = torch.Generator(device="cuda").manual_seed(1000 + head_dim + page_size + group)
    lens = [1, 8192, int(torch.randint(2, 8192, (1,), generator=g, device="cuda"))]
    batch = PagedBatch(lens, [1] * len(lens), 2 * group, 2, head_dim, page_size, dtype, generator=g)
    out = run_decode(batch)
    assert_close(out, reference(batch, batch.q, True, 1.0 / math.sqrt(head_dim)), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_long_sequence_uses_splits(dtype):
    """B=1, L=32768: the split-KV path with its merge kernel."""
    batch = PagedBatch([32768], [1], 32, 8, 128, 16, dtype)
    out = run_decode(batch)
    assert_close(out, reference(batch, batch.q, True, 1.0 / math.sqrt(128)), dtype)


# How 2 splits merge, by the kernel tuning (csrc/kernels/paged_attention/plan.h): "auto" (block
# pairs where they run, D = 128 on sm_90, and fill the GPU, unless eight-warp blocks replace them;
# else a cluster on sm_90, else the merge kernel), "pairs" (one block of two groups of warps
# wherever that runs, else as auto), "cluster" and "kernel" (the workspace and the merge kernel).
# "eight": one split as eight-warp blocks (D = 128, where the block fits). "persistent": the
# persistent decode (D = 128) on 3 blocks, so that each block takes several items. A form that
# cannot run (head dim, GPU) falls back to the automatic choice.
MERGE_TUNING = {
    "auto": "",
    "pairs": "decode_form=block_pairs",
    "cluster": "decode_form=cluster",
    "kernel": "decode_form=split",
    "eight": "decode_form=eight_warps",
    "persistent": "decode_form=persistent,persistent_blocks=3",
}


def splits_tuning(splits):
    return f"decode_splits={splits}" if splits else ""


# Every decode form that a forced split count and form select (MERGE_TUNING).
FORCED_DECODE_FORMS = [
    (1, "eight"),
    (1, "persistent"),
    (2, "pairs"),
    (2, "cluster"),
    (2, "kernel"),
]
SPLITS_AND_MERGES = [(1, "auto"), *FORCED_DECODE_FORMS]
SPLITS_AND_MERGES += [(n, "auto") for n in (3, 5, 8, 9, 32)]


@pytest.mark.parametrize("splits,merge", SPLITS_AND_MERGES)
@pytest.mark.parametrize(
    "head_dim,group", [(64, 4), (96, 4), (128, 4), (128, 24), (256, 8), (512, 8)]
)
def test_decode_every_split_count_merges_the_same(head_dim, group, splits, merge, tuning):
    """A forced split count; 1 split also as eight-warp blocks (D = 128), 2 splits merged in a
    block pair, in a cluster or by the merge kernel (MERGE_SWITCHES), other counts by the merge
    kernel. Lengths 1 and 100 leave most splits empty;
    group 24 takes two row tiles, the second half empty; one sequence's mask hides every key
    (zeros)."""
    tuning(splits_tuning(splits), MERGE_TUNING[merge])
    g = torch.Generator(device="cuda").manual_seed(300 + splits + head_dim)
    lens = [1, 100, 2000, 5000]
    batch = PagedBatch(lens, [1] * 4, 2 * group, 2, head_dim, 16, torch.bfloat16, generator=g)
    mask = torch.rand(4, 5000, generator=g, device="cuda") > 0.2
    mask[2] = False
    for attn_mask in (None, mask):
        out = run_decode(batch, attn_mask=attn_mask)
        ref = reference(batch, batch.q, True, 1.0 / math.sqrt(head_dim), attn_mask)
        assert_close(out, ref, torch.bfloat16)
    assert (out[2] == 0).all()


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("scale", [-0.2, 0.0, 0.3])
def test_decode_scale_of_any_sign(head_dim, scale):
    """A positive scale is folded into the softmax's exponent; zero and negative ones are applied
    to the scores first."""
    g = torch.Generator(device="cuda").manual_seed(17 + head_dim)
    batch = PagedBatch([1, 300, 3000], [1] * 3, 24, 2, head_dim, 16, torch.bfloat16, generator=g)
    out = run_decode(batch, scale=scale)
    assert_close(out, reference(batch, batch.q, True, scale), torch.bfloat16)


def test_decode_large_group_and_many_sequences():
    """Group of 32 q heads (two 16-row tiles) and a batch of 37 ragged sequences."""
    g = torch.Generator(device="cuda").manual_seed(7)
    lens = torch.randint(1, 3000, (37,), generator=g, device="cuda").tolist()
    batch = PagedBatch(lens, [1] * 37, 64, 2, 128, 16, torch.bfloat16, generator=g)
    out = run_decode(batch)
    assert_close(out, reference(batch, batch.q, True, 1.0 / math.sqrt(128)), torch.bfloat16)


def test_decode_with_mask_and_empty_rows():
    g = torch.Generator(device="cuda").manual_seed(11)
    batch = PagedBatch([700, 5, 2000], [1, 1, 1], 8, 2, 128, 16, torch.float16, generator=g)
    mask = torch.rand(3, 1500, generator=g, device="cuda") > 0.3
    mask[1] = False  # sequence 1 sees no key: zeros
    out = run_decode(batch, attn_mask=mask)
    ref = reference(batch, batch.q, True, 1.0 / math.sqrt(128), mask)
    assert_close(out, ref, torch.float16)
    assert (out[1] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("page_size,group", [(1, 4), (16, 1), (64, 4), (256, 8)])
def test_prefill_matches_reference(dtype, head_dim, is_causal, page_size, group, prefill_kernel):
    g = torch.Generator(device="cuda").manual_seed(head_dim * 7 + page_size + group + is_causal)
    q_lens = [1, int(torch.randint(2, 300, (1,), generator=g, device="cuda")), 77]
    prefix = [int(x) for x in torch.randint(0, 1200, (3,), generator=g, device="cuda")]
    prefix[2] = 0  # a fresh prompt
    lens = [p + n for p, n in zip(prefix, q_lens)]
    batch = PagedBatch(lens, q_lens, 2 * group, 2, head_dim, page_size, dtype, generator=g)
    scale = 1.0 / math.sqrt(head_dim)
    out = run_prefill(batch, batch.q, scale, is_causal)
    assert_close(out, reference(batch, batch.q, is_causal, scale), dtype)


def assert_uneven_ragged_prefill_matches(seed):
    """A causal bf16 prefill of 5 sequences x 2 kv heads (D = 128, page 16) whose sequences have
    very different numbers of row tiles, 11, 1, 0, 5 and 3, over prefixes from 0 to 1800, against
    the float64 reference."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q_lens = [700, 1, 0, 300, 129]
    lens = [700, 1000, 50, 2100, 129]
    batch = PagedBatch(lens, q_lens, 8, 2, 128, 16, torch.bfloat16, generator=g)
    scale = 1.0 / math.sqrt(128)
    out = run_prefill(batch, batch.q, scale)
    assert_close(out, reference(batch, batch.q, True, scale), torch.bfloat16)


def test_prefill_ragged_batch_with_uneven_row_tiles_per_sequence(prefill_kernel):
    """Every (sequence, kv head, row tile) block of the grid is covered when the sequences have
    very different numbers of row tiles: 11, 1, 0, 5 and 3, over prefixes from 0 to 1800."""
    assert_uneven_ragged_prefill_matches(seed=17)


@pytest.mark.parametrize("panel", ["1", "3", "4", "all"])
def test_prefill_blocks_start_in_panels_of_pairs_and_cover_the_grid(panel, prefill_kernel, tuning):
    """The block order by panels of (sequence, kv head) pairs (query_rows.cuh,
    prefill_block_coordinates; the plan's panel width tuned here): 5 sequences x 2 kv heads are 10
    pairs, in panels of 1, of 3 (the last of 1) and of 4 (the last of 2), or one panel of all.
    Every (pair, row tile) block still runs once, over sequences of 11, 1, 0, 5 and 3 row tiles: a
    block left out leaves its rows poisoned, one run for another pair's rows writes wrong ones."""
    tuning.add(f"prefill_l2_panel={panel}")
    assert_uneven_ragged_prefill_matches(seed=18)


def test_prefill_long_prompt_row_stride_and_zero_length(prefill_kernel):
    """Several row tiles, causal tiles skipped, q with a row stride (a slice of a fused qkv), and
    a sequence with no new tokens between two others."""
    g = torch.Generator(device="cuda").manual_seed(3)
    q_lens = [1500, 0, 333]
    lens = [1500, 40, 900]
    batch = PagedBatch(lens, q_lens, 32, 8, 128, 16, torch.bfloat16, generator=g)
    fused = torch.randn(batch.num_tokens, 48, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    q = fused[:, 8:40]
    scale = 0.11
    out = run_prefill(batch, q, scale)
    assert_close(out, reference(batch, q, True, scale), torch.bfloat16)


@pytest.mark.parametrize("is_causal", [True, False])
def test_prefill_bool_mask(is_causal, prefill_kernel):
    g = torch.Generator(device="cuda").manual_seed(5 + is_causal)
    q_lens = [50, 130]
    lens = [300, 130]
    batch = PagedBatch(lens, q_lens, 8, 2, 64, 16, torch.bfloat16, generator=g)
    mask = torch.rand(batch.num_tokens, 250, generator=g, device="cuda") > 0.5
    mask[3] = False  # a row with no key
    scale = 1.0 / 8
    out = run_prefill(batch, batch.q, scale, is_causal, attn_mask=mask)
    assert_close(out, reference(batch, batch.q, is_causal, scale, mask), torch.bfloat16)
    assert (out[3] == 0).all()


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("scale", [-0.2, 0.0, 0.9])
def test_any_scale_sign(decode, scale, prefill_kernel):
    """A positive scale is folded into the exponent, any other is applied to the scores first:
    both softmax paths match the reference (a zero scale is uniform attention), with split-KV
    decode over several chunks and causal prefill over several tiles."""
    g = torch.Generator(device="cuda").manual_seed(31 + decode)
    lens = [2100, 700, 9]
    q_lens = [1, 1, 1] if decode else [300, 64, 9]
    batch = PagedBatch(lens, q_lens, 8, 2, 128, 16, torch.bfloat16, generator=g)
    poison_next_allocation(batch.q.shape, batch.q.dtype)
    out = batch_cuda_op(
        batch,
        batch.q,
        max(q_lens),
        decode,
        None,
        True,
        scale,
    )[0]
    assert_close(out, reference(batch, batch.q, True, scale), torch.bfloat16)


def launched_kernel_names(call):
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


# PagedAttentionTraits<head dim, decode, blocks per pair, warps, KV element bytes, v head dim>:
# 16-bit KV.
PAIR_KERNEL = "PagedAttentionTraits<128, true, 2, 4, 2, 128>"
SINGLE_KERNEL = "PagedAttentionTraits<128, true, 1, 4, 2, 128>"
EIGHT_WARP_KERNEL = "PagedAttentionTraits<128, true, 1, 8, 2, 128>"


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="block pairs and clusters: an sm_90 GPU",
)
@pytest.mark.parametrize(
    "batch_size,head_dim,merge,expected",
    [
        (16, 128, "pairs", PAIR_KERNEL),  # 128 pair blocks: the split rule's 2, as pairs
        (2, 128, "auto", SINGLE_KERNEL),  # 4 pair blocks do not fill the GPU: a cluster
        (2, 128, "pairs", PAIR_KERNEL),
        (16, 128, "cluster", SINGLE_KERNEL),
        (16, 128, "kernel", "paged_decode_merge_kernel"),
        (2, 64, "pairs", "PagedAttentionTraits<64, true, 1, 4, 2, 64>"),  # 4 per SM: no pair kernel
        (16, 128, "auto", EIGHT_WARP_KERNEL),  # the pairs' grid, a short block table: 1 split
    ],
)
def test_decode_two_splits_run_the_chosen_merge(batch_size, head_dim, merge, expected, tuning):
    """On the H200 two splits run as block pairs at D = 128 where the pairs fill the GPU (one
    launch, no merge kernel), as a cluster where they do not or with block pairs off, and with the
    merge kernel with both off; where the block table holds at most 16384 positions, one split of
    eight-warp blocks replaces the pairs. Batch 16 (Hkv = 8) takes 2 splits from the split rule;
    batch 2 is forced to 2."""
    tuning(splits_tuning(2 if batch_size == 2 else None), MERGE_TUNING[merge])
    g = torch.Generator(device="cuda").manual_seed(5 + batch_size)
    lens = torch.randint(1, 2500, (batch_size,), generator=g, device="cuda").tolist()
    q_heads, kv_heads = (32, 8) if batch_size == 16 else (8, 2)
    batch = PagedBatch(
        lens, [1] * batch_size, q_heads, kv_heads, head_dim, 16, torch.bfloat16, generator=g
    )
    names = launched_kernel_names(lambda: run_decode(batch))
    attention = [n for n in names if "paged_decode_kernel" in n or "merge_kernel" in n]
    assert any(expected in n for n in attention), attention
    assert (merge == "kernel") == any("merge_kernel" in n for n in attention), attention
    ref = reference(batch, batch.q, True, 1.0 / math.sqrt(head_dim))
    assert_close(run_decode(batch), ref, torch.bfloat16)


def force_eight_warp_blocks(tuning):
    tuning("decode_splits=1", MERGE_TUNING["eight"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
@pytest.mark.parametrize("group", [1, 4, 8, 16, 24])
def test_decode_eight_warp_blocks_match_reference(dtype, page_size, group, tuning):
    """One split as eight-warp blocks (D = 128): 128-position tiles whose page ids come from the
    ring in shared memory, one id per row at page 1, one per tile at page 256. Lengths of 1, one
    tile, one tile and one position, a long one and a random one; group 24 takes two row tiles."""
    force_eight_warp_blocks(tuning)
    g = torch.Generator(device="cuda").manual_seed(2000 + page_size + group)
    lens = [1, 128, 129, 8192, int(torch.randint(2, 8192, (1,), generator=g, device="cuda"))]
    batch = PagedBatch(lens, [1] * len(lens), 2 * group, 2, 128, page_size, dtype, generator=g)
    out = run_decode(batch)
    assert_close(out, reference(batch, batch.q, True, 1.0 / math.sqrt(128)), dtype)


def eight_warp_block_fits():
    """The eight-warp block's shared memory (141440 bytes) against the device's opt-in limit."""
    props = torch.cuda.get_device_properties(0)
    return getattr(props, "shared_memory_per_block_optin", 0) >= 141440


@pytest.mark.skipif(
    not torch.cuda.is_available() or not eight_warp_block_fits(),
    reason="eight-warp blocks: a GPU that gives a block 138 KB of shared memory",
)
def test_decode_forced_one_split_runs_eight_warp_blocks(tuning):
    """With one split forced and the switch on, D = 128 runs the eight-warp kernel, which the tests
    of that route above rely on; other head dims keep their 4-warp kernel."""
    force_eight_warp_blocks(tuning)
    g = torch.Generator(device="cuda").manual_seed(43)
    for head_dim, expected in (
        (128, EIGHT_WARP_KERNEL),
        (64, "PagedAttentionTraits<64, true, 1, 4, 2, 64>"),
    ):
        batch = PagedBatch([300, 1500], [1, 1], 8, 2, head_dim, 16, torch.bfloat16, generator=g)
        names = launched_kernel_names(lambda batch=batch: run_decode(batch))
        attention = [n for n in names if "paged_decode_kernel" in n or "merge_kernel" in n]
        assert len(attention) == 1 and expected in attention[0], attention


@pytest.mark.parametrize("scale", [-0.2, 0.0, 0.3])
def test_decode_eight_warp_blocks_with_mask_and_any_scale(scale, tuning):
    """Eight-warp blocks with a user mask (one sequence sees no key: zeros) and scales of any
    sign."""
    force_eight_warp_blocks(tuning)
    g = torch.Generator(device="cuda").manual_seed(31)
    batch = PagedBatch([700, 5, 3000], [1] * 3, 8, 2, 128, 16, torch.bfloat16, generator=g)
    mask = torch.rand(3, 3000, generator=g, device="cuda") > 0.3
    mask[1] = False
    out = run_decode(batch, attn_mask=mask, scale=scale)
    assert_close(out, reference(batch, batch.q, True, scale, mask), torch.bfloat16)
    assert (out[1] == 0).all()


PERSISTENT_KERNEL = "paged_decode_persistent_kernel"


def persistent_decode_fits():
    """The persistent decode block's shared memory (209984 bytes) against the opt-in limit."""
    props = torch.cuda.get_device_properties(0)
    return getattr(props, "shared_memory_per_block_optin", 0) >= 209984


needs_persistent_block = pytest.mark.skipif(
    not torch.cuda.is_available() or not persistent_decode_fits(),
    reason="the persistent decode: a GPU that gives a block 206 KB of shared memory",
)


def force_persistent_decode(tuning, blocks):
    tuning(f"decode_form=persistent,persistent_blocks={blocks}")


@needs_persistent_block
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
@pytest.mark.parametrize("group", [1, 4, 8, 16, 24])
@pytest.mark.parametrize("blocks", [1, 3, 7])
def test_decode_persistent_blocks_match_reference(dtype, page_size, group, blocks, tuning):
    """The persistent decode: each of `blocks` blocks starts with item (sequence, kv head, row
    tile) b, claims the others in turn from the launch's counter and streams their tiles as one
    pipeline. Lengths 0 (zeros), 1 and 128 (one tile: the next item's tile follows at once, and
    its claim is waited for; also as a block's first item), 129, 3000 and a random one; group 24
    takes two row tiles per (sequence, kv head)."""
    force_persistent_decode(tuning, blocks)
    g = torch.Generator(device="cuda").manual_seed(3000 + page_size + group + blocks)
    lens = [
        1,
        128,
        0,
        129,
        1,
        3000,
        128,
        int(torch.randint(2, 5000, (1,), generator=g, device="cuda")),
    ]
    batch = PagedBatch(lens, [1] * len(lens), 2 * group, 2, 128, page_size, dtype, generator=g)
    names = launched_kernel_names(lambda: run_decode(batch))
    assert any(PERSISTENT_KERNEL in n for n in names), names
    out = run_decode(batch)
    assert_close(out, reference(batch, batch.q, True, 1.0 / math.sqrt(128)), dtype)
    assert (out[2] == 0).all()


@needs_persistent_block
@pytest.mark.parametrize("blocks", [2, 5, 132])
def test_decode_persistent_blocks_ragged_batch_covers_every_item(blocks, tuning):
    """A ragged batch of 61 sequences (lengths 1 to 6000, a run of one-tile ones) over 2, 5 or 132
    blocks: every item is claimed once and written (poisoned output, NaN otherwise), whatever the
    order in which the blocks claim them. Three calls in a row, each on a counter that its launch
    zeroes (the caching allocator tends to hand out the last call's, which holds its count), the
    decode started before the reset ends (sm_90)."""
    force_persistent_decode(tuning, blocks)
    g = torch.Generator(device="cuda").manual_seed(59 + blocks)
    lens = torch.randint(1, 6000, (61,), generator=g, device="cuda").tolist()
    lens[10:20] = [1, 2, 128, 1, 5, 128, 1, 1, 64, 3]
    batch = PagedBatch(lens, [1] * 61, 16, 4, 128, 16, torch.bfloat16, generator=g)
    for _ in range(3):
        out = run_decode(batch)
        assert_close(out, reference(batch, batch.q, True, 1.0 / math.sqrt(128)), torch.bfloat16)


@needs_persistent_block
@pytest.mark.parametrize("scale", [-0.2, 0.0, 0.3])
def test_decode_persistent_blocks_with_mask_and_any_scale(scale, tuning):
    """The persistent decode with a user mask (one sequence sees no key: zeros; the mask narrower
    than the longest sequence) and scales of any sign, on 2 blocks."""
    force_persistent_decode(tuning, 2)
    g = torch.Generator(device="cuda").manual_seed(37)
    batch = PagedBatch(
        [700, 5, 3000, 40, 2500], [1] * 5, 8, 2, 128, 16, torch.bfloat16, generator=g
    )
    mask = torch.rand(5, 2600, generator=g, device="cuda") > 0.3
    mask[1] = False
    out = run_decode(batch, attn_mask=mask, scale=scale)
    assert_close(out, reference(batch, batch.q, True, scale, mask), torch.bfloat16)
    assert (out[1] == 0).all()


def device_has_132_sms():
    return torch.cuda.get_device_properties(0).multi_processor_count == 132


@needs_persistent_block
@pytest.mark.skipif(
    not torch.cuda.is_available() or not device_has_132_sms(),
    reason="the rule's measured grids: an H100/H200 SXM (132 SMs)",
)
@pytest.mark.parametrize(
    "batch_size,expected",
    [
        (24, SINGLE_KERNEL),
        (40, PERSISTENT_KERNEL),
        (48, PERSISTENT_KERNEL),
        (64, SINGLE_KERNEL),
        (80, PERSISTENT_KERNEL),
        (128, PERSISTENT_KERNEL),
    ],
)
def test_decode_persistent_blocks_run_where_the_rule_says(batch_size, expected):
    """By default (shapes only) one split runs the persistent decode where its items, one per SM
    at a time, take 3 rounds or 5 and more (B=40, 48, 80 and 128 at Hkv=8: 320, 384, 640 and 1024
    items, 3, 3, 5 and 8 rounds on 132 SMs), and 4-warp blocks at 2 or 4 rounds (B=24, 64)."""
    g = torch.Generator(device="cuda").manual_seed(53 + batch_size)
    lens = torch.randint(1, 1500, (batch_size,), generator=g, device="cuda").tolist()
    batch = PagedBatch(lens, [1] * batch_size, 32, 8, 128, 16, torch.bfloat16, generator=g)
    names = launched_kernel_names(lambda: run_decode(batch))
    attention = [n for n in names if "paged_" in n and "kernel" in n]
    assert len(attention) == 1 and expected in attention[0], attention
    ref = reference(batch, batch.q, True, 1.0 / math.sqrt(128))
    assert_close(run_decode(batch), ref, torch.bfloat16)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="block pairs: an sm_90 GPU",
)
def test_decode_eight_warp_blocks_replace_pairs_up_to_16384_positions():
    """The rule reads the block table's width, never seq_lens: a table of at most 16384 positions
    runs eight-warp blocks on the pairs' grid, a wider one the block pairs, at the same lengths."""
    g = torch.Generator(device="cuda").manual_seed(41)
    lens = torch.randint(1, 2500, (16,), generator=g, device="cuda").tolist()
    for extra_pages, expected in ((2, EIGHT_WARP_KERNEL), (1030, PAIR_KERNEL)):
        batch = PagedBatch(
            lens, [1] * 16, 32, 8, 128, 16, torch.bfloat16, generator=g, extra_width=extra_pages
        )
        names = launched_kernel_names(lambda batch=batch: run_decode(batch))
        attention = [n for n in names if "paged_decode_kernel" in n or "merge_kernel" in n]
        assert len(attention) == 1 and expected in attention[0], attention
        ref = reference(batch, batch.q, True, 1.0 / math.sqrt(128))
        assert_close(run_decode(batch), ref, torch.bfloat16)


@pytest.mark.parametrize("splits,merge", [(None, "auto"), *FORCED_DECODE_FORMS, (24, "auto")])
def test_decode_cuda_graph_replay_with_growing_lengths(splits, merge, tuning):
    """Capture one decode step, then replay it as the sequences grow: the split count and the
    workspace come from shapes, the per-split chunk from the seq_lens read on the device. With the
    heuristic's split count, forced to 1 as eight-warp blocks, to 2 (merged in a block pair or a
    cluster on sm_90, or by the merge kernel) and to 24 (the merge kernel)."""
    tuning(splits_tuning(splits), MERGE_TUNING[merge])
    g = torch.Generator(device="cuda").manual_seed(21)
    hq, hkv, d, page = 32, 8, 128, 16
    max_len = 4096
    batch = PagedBatch([max_len] * 4, [1] * 4, hq, hkv, d, page, torch.bfloat16, generator=g)
    # Fill the whole pool with finite values: every replay makes more of it visible.
    batch.k_cache.copy_(torch.randn(batch.k_cache.shape, generator=g, device="cuda"))
    batch.v_cache.copy_(torch.randn(batch.v_cache.shape, generator=g, device="cuda"))
    static_lens = torch.tensor([3, 1, 17, 100], dtype=torch.int32, device="cuda")
    static_q = batch.q.clone()
    scale = 1.0 / math.sqrt(d)
    args = (
        static_q,
        batch.k_cache,
        batch.v_cache,
        batch.block_table,
        static_lens,
        batch.query_start_loc,
        1,
        True,
        None,
        True,
        scale,
    )
    graph, (static_out, _) = captured_graph(lambda: cuda_op(*args))
    for lens in ([3, 1, 17, 100], [64, 65, 700, 1000], [2048, 129, 4000, 4096]):
        static_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        static_q.copy_(torch.randn(static_q.shape, generator=g, device="cuda"))
        static_out.fill_(float("nan"))
        graph.replay()
        batch.seq_lens_list = lens
        ref = reference(batch, static_q, True, scale)
        assert_close(static_out, ref, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("page_size", [1, 16, 256])
@pytest.mark.parametrize("d,dv", [(128, 128), (192, 128)], ids=["128", "192v128"])
def test_append_kv_writes_slots_and_skips_negative(dtype, page_size, d, dv):
    """Every kept token's k and v rows land in their slot (v's head dim its own where it
    differs: DeepSeek's MHA form); nothing else changes."""
    g = torch.Generator(device="cuda").manual_seed(page_size)
    hkv, t = 4, 300
    pages = max(40, 2 * t // page_size)  # more slots than tokens
    k_cache = torch.randn(pages, page_size, hkv, d, device="cuda", dtype=dtype, generator=g)
    v_cache = torch.randn(pages, page_size, hkv, dv, device="cuda", dtype=dtype, generator=g)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    k = torch.randn(t, hkv, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(t, hkv, dv, device="cuda", dtype=dtype, generator=g)
    slots = torch.randperm(pages * page_size, device="cuda", generator=g)[:t].int()
    slots[::7] = -1
    torch.ops.astr.append_kv(k, v, k_cache, v_cache, slots)
    expected_k = k_before.view(-1, hkv, d).clone()
    expected_v = v_before.view(-1, hkv, dv).clone()
    keep = slots >= 0
    expected_k[slots[keep].long()] = k[keep]
    expected_v[slots[keep].long()] = v[keep]
    assert torch.equal(k_cache.view(-1, hkv, d), expected_k)
    assert torch.equal(v_cache.view(-1, hkv, dv), expected_v)


def test_append_then_decode_round_trip():
    """append_kv writes the new token, then the decode reads it (the serving loop's order)."""
    g = torch.Generator(device="cuda").manual_seed(9)
    batch = PagedBatch([100, 37], [1, 1], 8, 2, 64, 16, torch.float16, generator=g)
    k_new = torch.randn(2, 2, 64, device="cuda", dtype=torch.float16, generator=g)
    v_new = torch.randn_like(k_new)
    lens = [101, 38]
    slots = []
    for b, n in enumerate(lens):
        pos = n - 1
        slots.append(int(batch.block_table[b, pos // 16]) * 16 + pos % 16)
    slot_mapping = torch.tensor(slots, dtype=torch.int32, device="cuda")
    # Make room: the previous sequence lengths must have left a free slot in the owned pages.
    torch.ops.astr.append_kv(k_new, v_new, batch.k_cache, batch.v_cache, slot_mapping)
    batch.seq_lens_list = lens
    batch.seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = run_decode(batch)
    assert_close(out, reference(batch, batch.q, True, 1.0 / 8), torch.float16)


def as_head_major_pages(cache):
    """The same values stored [P, Hkv, S, D] (head-major pages, FlashInfer's HND layout) and
    seen as [P, S, Hkv, D] through strides: slot stride D, head stride S * D."""
    return cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="the warp-specialised prefill: an sm_90 GPU",
)
@pytest.mark.parametrize(
    "page_size,num_kv_heads,head_major,loads,boxes,head_dim",
    [
        (16, 2, False, "auto", True, 64),
        (8, 2, False, "auto", True, 64),  # the smallest box: one 1024-byte swizzle atom
        (256, 2, False, "tma", True, 64),  # boxes of a whole 128-row tile
        (64, 1, False, "auto", True, 64),  # one kv head: a dim of one element in the map
        (16, 2, True, "auto", True, 64),  # head-major pages: the map's dims ordered by stride
        (4, 2, False, "tma", False, 64),  # pages below 8 slots: gathered
        (1, 2, False, "auto", False, 64),
        (16, 2, False, "cp_async", False, 64),  # gathered when tuned so
        # D = 96: the second column block's boxes reach past D (zeros there); gathered, each
        # copy takes its own chunk (12 a row over 128 threads).
        (16, 2, False, "auto", True, 96),
        (16, 2, True, "auto", True, 96),
        (16, 2, False, "cp_async", False, 96),
        (1, 2, False, "auto", False, 96),
    ],
)
def test_warp_specialized_prefill_copies_by_tma_boxes_where_the_pool_allows(
    page_size, num_kv_heads, head_major, loads, boxes, head_dim, tuning
):
    """On sm_90 the warp-specialised prefill copies K and V by TMA boxes (its instantiation with
    PrefillWarpSpecializedTraits<D, true>) for pages of 8 slots or more whose strides a tensor map
    describes, and gathers with cp.async otherwise (<D, false>); the kernel names tell which ran
    (the control), and the answer is the reference's either way. Sequences end inside tiles, so
    every block's last tile is gathered with its rows past the end zero-filled (the pool's
    unowned slots are NaN)."""
    tuning("prefill_kernel=warp_specialized", f"prefill_loads={loads}")
    g = torch.Generator(device="cuda").manual_seed(60 + page_size + num_kv_heads + head_major)
    q_lens = [300, 77, 1]
    lens = [1300, 77, 500]
    batch = PagedBatch(
        lens, q_lens, 8, num_kv_heads, head_dim, page_size, torch.bfloat16, generator=g
    )
    if head_major:
        batch.k_cache = as_head_major_pages(batch.k_cache)
        batch.v_cache = as_head_major_pages(batch.v_cache)
    scale = 1.0 / math.sqrt(head_dim)
    names = launched_kernel_names(lambda: run_prefill(batch, batch.q, scale))
    prefills = [n for n in names if "paged_prefill" in n]
    traits = f"PrefillWarpSpecializedTraits<{head_dim}, {str(boxes).lower()}>"
    assert prefills and all(traits in n for n in prefills), prefills
    out = run_prefill(batch, batch.q, scale)
    assert_close(out, reference(batch, batch.q, True, scale), torch.bfloat16)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="the persistent prefill: an sm_90 GPU",
)
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("page_size,boxes", [(1, False), (16, True), (256, True)])
@pytest.mark.parametrize("blocks", ["", "1", "5"])
@pytest.mark.parametrize("schedule", ["claimed", "round_robin"])
def test_persistent_prefill_takes_every_item_once_across_its_blocks(
    head_dim, page_size, boxes, blocks, schedule, tuning
):
    """prefill_kernel=persistent runs the scheduler's sort and the persistent kernel (the kernel
    names are the control: PrefillPersistentTraits<D, boxes>), on one block per SM, on one block
    that takes every item in turn, and on 5; its items claimed or round robin. A ragged batch with
    cached prefixes whose sequences have 0 to 22 row tiles (GQA 4: 32 tokens a tile), a one-token
    sequence behind a long prefix (the longest item), into a NaN-poisoned output: every row
    matches the float64 reference, so every item ran once and no item's pipeline leaked into the
    next one's."""
    tuning(
        "prefill_kernel=persistent",
        f"persistent_blocks={blocks}" if blocks else "",
        f"prefill_schedule={schedule}",
    )
    g = torch.Generator(device="cuda").manual_seed(head_dim + page_size + len(blocks))
    q_lens = [700, 1, 0, 300, 129, 64]
    lens = [700, 3000, 50, 2100, 129, 64 + 999]
    batch = PagedBatch(lens, q_lens, 8, 2, head_dim, page_size, torch.bfloat16, generator=g)
    scale = 1.0 / math.sqrt(head_dim)
    names = launched_kernel_names(lambda: run_prefill(batch, batch.q, scale))
    assert any("prefill_schedule_kernel" in n for n in names), names
    traits = f"PrefillPersistentTraits<{head_dim}, {str(boxes).lower()}>"
    prefills = [n for n in names if "paged_prefill" in n]
    assert prefills and all(traits in n for n in prefills), prefills
    out = run_prefill(batch, batch.q, scale)  # (into a NaN-poisoned output)
    assert_close(out, reference(batch, batch.q, True, scale), torch.bfloat16)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="the persistent prefill: an sm_90 GPU",
)
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("loads", ["auto", "cp_async"])
def test_persistent_prefill_is_the_grid_kernel_bit_for_bit(head_dim, loads, tuning):
    """The persistent kernel runs the grid kernel's tiles in the grid kernel's order with its
    arithmetic (PrefillPersistentTraits: the same tiles and stages): every row, and its LSE, is
    the same bits whatever block took the item and whatever item it followed, over a ragged batch
    with cached prefixes, a window, softcap and sinks, on 3 blocks."""
    g = torch.Generator(device="cuda").manual_seed(90 + head_dim)
    q_lens = [700, 1, 300, 129]
    lens = [900, 3000, 2100, 129]
    batch = PagedBatch(lens, q_lens, 8, 2, head_dim, 16, torch.bfloat16, generator=g)
    sinks = torch.randn(8, device="cuda", generator=g)
    kwargs = dict(window_left=500, softcap=30.0, sinks=sinks, return_lse=True)

    def run_under(text):
        tuning(text, f"prefill_loads={loads}")
        poison_next_allocation(output_shape(batch, batch.q), batch.q.dtype)
        return batch_cuda_op(batch, batch.q, max(q_lens), False, None, True, 0.1, **kwargs)

    out, lse = run_under("prefill_kernel=warp_specialized")
    persistent_out, persistent_lse = run_under("prefill_kernel=persistent,persistent_blocks=3")
    assert torch.equal(out, persistent_out)
    assert torch.equal(lse, persistent_lse)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_head_major_pages_are_written_and_read_through_strides(page_size, prefill_kernel):
    """A pool stored head-major per page, passed as its [P, S, Hkv, D] view: append_kv writes
    through the strides, decode and prefill read through them."""
    g = torch.Generator(device="cuda").manual_seed(40 + page_size)
    for q_lens in ([1, 1, 1], [1, 30, 77]):
        batch = PagedBatch(
            [1, 300, 2000], q_lens, 8, 2, 128, page_size, torch.bfloat16, generator=g
        )
        batch.k_cache = as_head_major_pages(batch.k_cache)
        batch.v_cache = as_head_major_pages(batch.v_cache)
        assert batch.k_cache.stride(2) == 128 * page_size  # (a lone slot's stride is moot)
        # Overwrite each sequence's last token in place.
        last = [n - 1 for n in batch.seq_lens_list]
        pages = [int(batch.block_table[b, pos // page_size]) for b, pos in enumerate(last)]
        slots = torch.tensor(
            [page * page_size + pos % page_size for page, pos in zip(pages, last)],
            dtype=torch.int32,
            device="cuda",
        )
        k_new = torch.randn(3, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        v_new = torch.randn_like(k_new)
        torch.ops.astr.append_kv(k_new, v_new, batch.k_cache, batch.v_cache, slots)
        for b, (page, pos) in enumerate(zip(pages, last)):
            assert torch.equal(batch.k_cache[page, pos % page_size], k_new[b])
            assert torch.equal(batch.v_cache[page, pos % page_size], v_new[b])
        scale = 1.0 / math.sqrt(128)
        if max(q_lens) == 1:
            out = run_decode(batch)
        else:
            out = run_prefill(batch, batch.q, scale)
        assert_close(out, reference(batch, batch.q, True, scale), torch.bfloat16)


# ---- bad inputs: each raises RuntimeError naming the argument --------------------------------


def small_batch(**overrides):
    batch = PagedBatch([20, 9], [1, 1], 8, 2, 64, 16, torch.bfloat16)
    args = dict(
        q=batch.q,
        k_cache=batch.k_cache,
        v_cache=batch.v_cache,
        block_table=batch.block_table,
        seq_lens=batch.seq_lens,
        query_start_loc=batch.query_start_loc,
        max_query_len=1,
        decode=True,
        attn_mask=None,
        is_causal=True,
        scale=0.125,
    )
    args.update(overrides)
    return args


def call(args):
    return cuda_op(
        args["q"],
        args["k_cache"],
        args["v_cache"],
        args["block_table"],
        args["seq_lens"],
        args["query_start_loc"],
        args["max_query_len"],
        args["decode"],
        args["attn_mask"],
        args["is_causal"],
        args["scale"],
    )[0]


def test_rejects_wrong_q_dtype():
    args = small_batch()
    with pytest.raises(RuntimeError, match="q must be bfloat16 or float16"):
        call({**args, "q": args["q"].float()})


def test_rejects_wrong_q_rank():
    args = small_batch()
    with pytest.raises(RuntimeError, match=r"q must have shape \[T, Hq, D\]"):
        call({**args, "q": args["q"].reshape(2, -1)})


def test_rejects_cache_on_cpu():
    args = small_batch()
    with pytest.raises(RuntimeError, match="k_cache must be a CUDA tensor"):
        call({**args, "k_cache": args["k_cache"].cpu()})


def test_rejects_cache_dtype_mismatch():
    args = small_batch()
    with pytest.raises(RuntimeError, match="v_cache must have the dtype of q"):
        call({**args, "v_cache": args["v_cache"].half()})


def test_rejects_heads_that_do_not_divide():
    args = small_batch()
    with pytest.raises(RuntimeError, match=r"q heads \(5\) must be a multiple of k_cache kv heads"):
        call({**args, "q": args["q"][:, :5]})


def test_rejects_unsupported_head_dim():
    q = torch.randn(2, 8, 80, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(4, 16, 2, 80, device="cuda", dtype=torch.bfloat16)
    args = small_batch(q=q, k_cache=kc, v_cache=kc.clone())
    supported = ", ".join(
        str(d) if d == dv else f"{d}/{dv}"
        for d, dv in ops.BUILD_INFO["paged_kernels"]["head_dim_pairs"]
    )
    with pytest.raises(RuntimeError, match=rf"unsupported head_dim 80 \(supported: {supported}\)"):
        call(args)


def test_rejects_a_head_dim_pair_that_is_no_row():
    """q/k 192 runs with v 128 only (config.h's rows are pairs): v 192 is named as a pair."""
    q = torch.randn(2, 8, 192, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(4, 16, 2, 192, device="cuda", dtype=torch.bfloat16)
    args = small_batch(q=q, k_cache=kc, v_cache=kc.clone())
    with pytest.raises(RuntimeError, match=r"unsupported head_dim 192 \(supported: "):
        call(args)
    vc = torch.randn(4, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"unsupported head_dim 192 with v head_dim 64"):
        call({**args, "v_cache": vc})


def test_rejects_block_table_dtype():
    args = small_batch()
    with pytest.raises(RuntimeError, match="block_table must be int32"):
        call({**args, "block_table": args["block_table"].long()})


def test_rejects_seq_lens_shape():
    args = small_batch()
    with pytest.raises(RuntimeError, match="seq_lens must have shape"):
        call({**args, "seq_lens": args["seq_lens"][:1]})


def test_rejects_query_start_loc_shape_in_prefill():
    args = small_batch(decode=False)
    with pytest.raises(RuntimeError, match="query_start_loc must have shape"):
        call({**args, "query_start_loc": args["query_start_loc"][:2]})


def test_rejects_float_mask():
    args = small_batch()
    with pytest.raises(RuntimeError, match="attn_mask must be bool"):
        call({**args, "attn_mask": torch.zeros(2, 20, device="cuda")})


def test_rejects_decode_with_token_count_mismatch():
    args = small_batch()
    with pytest.raises(RuntimeError, match="decode needs one token per sequence"):
        call({**args, "q": torch.randn(3, 8, 64, device="cuda", dtype=torch.bfloat16)})


def test_append_kv_rejects_bad_arguments():
    kc = torch.randn(4, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    k = torch.randn(3, 2, 64, device="cuda", dtype=torch.bfloat16)
    slots = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="slot_mapping: expected dtype int32"):
        torch.ops.astr.append_kv(k, k, kc, vc, slots.long())
    with pytest.raises(RuntimeError, match="k: dtype BFloat16 does not match k_cache's Half"):
        torch.ops.astr.append_kv(k, k, kc.half(), vc.half(), slots)
    with pytest.raises(RuntimeError, match="k: expected a 3-D tensor"):
        torch.ops.astr.append_kv(k[0], k[0], kc, vc, slots)
    with pytest.raises(RuntimeError, match="v: expected a tensor on cuda"):
        torch.ops.astr.append_kv(k, k.cpu(), kc, vc, slots)


# ---- (q/k, v) head dims of their own: DeepSeek's MHA form (192, 128) ---------------------------


@pytest.mark.parametrize("head_dims", UNEQUAL_HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size,group", [(1, 4), (16, 1), (64, 16), (256, 8)])
@pytest.mark.parametrize("splits,merge", [(1, "auto"), (2, "cluster"), (2, "kernel"), (9, "auto")])
def test_decode_unequal_head_dims_matches_reference(
    head_dims, dtype, page_size, group, splits, merge, tuning
):
    """q and k of one head dim, v (and the output) of another: every decode form that runs them
    (one split, 2 merged in a cluster or by the merge kernel, 9 by the merge kernel)."""
    tuning(splits_tuning(splits), MERGE_TUNING[merge])
    d, dv = head_dims
    g = torch.Generator(device="cuda").manual_seed(d + dv + page_size + group + splits)
    lens = [1, 4000, int(torch.randint(2, 8192, (1,), generator=g, device="cuda"))]
    batch = PagedBatch(lens, [1] * 3, 2 * group, 2, d, page_size, dtype, generator=g, head_dim_v=dv)
    out = run_decode(batch)
    assert out.shape == (3, 2 * group, dv)
    assert_close(out, reference(batch, batch.q, True, 1.0 / math.sqrt(d)), dtype)


@pytest.mark.parametrize("head_dims", UNEQUAL_HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("page_size,group", [(1, 4), (16, 1), (64, 8)])
def test_prefill_unequal_head_dims_matches_reference(head_dims, dtype, is_causal, page_size, group):
    """The mma.sync prefill (the plan's kernel for these rows) over ragged prompts with prefixes;
    a verify-sized call (3 new tokens) runs on the decode forms."""
    d, dv = head_dims
    g = torch.Generator(device="cuda").manual_seed(d * 3 + dv + page_size + group + is_causal)
    for q_lens in ([1, 250, 77], [3, 3, 1]):
        prefix = [int(x) for x in torch.randint(0, 1200, (3,), generator=g, device="cuda")]
        lens = [p + n for p, n in zip(prefix, q_lens)]
        batch = PagedBatch(
            lens, q_lens, 2 * group, 2, d, page_size, dtype, generator=g, head_dim_v=dv
        )
        scale = 1.0 / math.sqrt(d)
        out = run_prefill(batch, batch.q, scale, is_causal)
        assert out.shape == (batch.num_tokens, 2 * group, dv)
        assert_close(out, reference(batch, batch.q, is_causal, scale), dtype)


@pytest.mark.parametrize("head_dims", [(512, 512), *UNEQUAL_HEAD_DIMS])
def test_new_head_dims_return_the_lse_once_per_row(head_dims):
    """D = 512's column chunks write one lse (chunk 0's); decode and prefill, against the
    reference's."""
    d, dv = head_dims
    g = torch.Generator(device="cuda").manual_seed(5 + d + dv)
    for q_lens in ([1, 1, 1], [40, 1, 200]):
        lens = [n + 300 for n in q_lens]
        batch = PagedBatch(lens, q_lens, 8, 2, d, 16, torch.bfloat16, generator=g, head_dim_v=dv)
        scale = 1.0 / math.sqrt(d)
        out, lse = batch_cuda_op(
            batch,
            batch.q,
            max(q_lens),
            q_lens == [1, 1, 1],
            None,
            True,
            scale,
            return_lse=True,
        )
        ref, ref_lse = reference(batch, batch.q, True, scale, return_lse=True)
        assert_close(out, ref, torch.bfloat16)
        torch.testing.assert_close(lse.double(), ref_lse, atol=2e-2, rtol=1e-3)
