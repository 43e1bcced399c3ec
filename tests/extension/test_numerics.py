"""The torch_native backend computes attention as defined.

    out = softmax(q k^T * scale + mask) v

per sequence, with query head ``h`` reading kv head ``h // (q_heads // kv_heads)`` (GQA), a
boolean mask removing keys (True = attend) and an additive mask added to the scores. Causal
calls let query ``i`` see key ``j`` when ``j <= i`` (dense, aligned top-left like SDPA) or when
``j <= seq_len - q_len + i`` (paged: the new tokens sit after the cached prefix). A query that
sees no key returns zeros.

The reference (tests/reference.py) is written from that definition in float64, never by calling
SDPA. Every input is fresh random data.
"""

from __future__ import annotations

import math

import pytest
import torch

from astrai.extension import KVCacheFullError, PagedKVCache, attention
from tests.reference import dense_reference, paged_reference, sequence_reference

NEG_INF = float("-inf")

# -- helpers ---------------------------------------------------------------------------------

TIGHT = {
    torch.float32: dict(atol=2e-5, rtol=1e-4),
    torch.float64: dict(atol=1e-10, rtol=1e-9),
}
LOW_PRECISION = (torch.bfloat16, torch.float16)


def assert_matches(out, ref):
    """Tight tolerances in float32/float64; relative L2 error < 2e-2 in bf16/fp16."""
    assert out.shape == ref.shape
    assert torch.isfinite(out).all()
    if out.dtype in LOW_PRECISION:
        err = (out.double() - ref).norm() / ref.norm().clamp_min(1e-12)
        assert err < 2e-2, f"relative L2 error {err:.3e}"
    else:
        torch.testing.assert_close(out.double(), ref, **TIGHT[out.dtype])


def make_generator(seed):
    return torch.Generator().manual_seed(seed)


def randn(*shape, g, dtype=torch.float32):
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def random_bool_mask(*shape, g, keep_first_key=True):
    """Random bool mask; key 0 stays visible so that no dense row is fully masked."""
    mask = torch.rand(*shape, generator=g) < 0.6
    if keep_first_key:
        mask[..., 0] = True
    return mask


def random_additive_mask(*shape, g, dtype, keep_first_key=True):
    """Finite random biases with some -inf (removed keys)."""
    mask = randn(*shape, g=g, dtype=torch.float64)
    mask = mask.masked_fill(torch.rand(*shape, generator=g) < 0.3, NEG_INF)
    if keep_first_key:
        mask[..., 0] = 0.0
    return mask.to(dtype)


def dense_inputs(batch, q_len, kv_len, q_heads, kv_heads, head_dim, dtype, seed, head_dim_v=None):
    g = make_generator(seed)
    q = randn(batch, q_len, q_heads, head_dim, g=g, dtype=dtype)
    k = randn(batch, kv_len, kv_heads, head_dim, g=g, dtype=dtype)
    v = randn(batch, kv_len, kv_heads, head_dim_v or head_dim, g=g, dtype=dtype)
    return q, k, v, g


def run_dense(q, k, v, **kwargs):
    return torch.ops.astr.attention(q, k, v, backend="torch_native", **kwargs)


GQA = [(2, 2), (4, 2), (8, 2)]  # (q_heads, kv_heads): ratios 1, 2, 4
GQA_IDS = ["gqa1", "gqa2", "gqa4"]

# -- dense -----------------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [32, 40, 64, 128, 256])
@pytest.mark.parametrize("heads", GQA, ids=GQA_IDS)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_dense_matches_definition(head_dim, heads, is_causal):
    q, k, v, _ = dense_inputs(2, 6, 6, *heads, head_dim, torch.float32, seed=head_dim + heads[0])
    out = run_dense(q, k, v, is_causal=is_causal)
    assert_matches(out, dense_reference(q, k, v, is_causal=is_causal))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", GQA, ids=GQA_IDS)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_dense_matches_definition_in_every_dtype(dtype, heads, is_causal):
    q, k, v, _ = dense_inputs(2, 7, 7, *heads, 64, dtype, seed=11 + heads[0])
    out = run_dense(q, k, v, is_causal=is_causal)
    assert out.dtype == dtype
    assert_matches(out, dense_reference(q, k, v, is_causal=is_causal))


@pytest.mark.parametrize("q_len, kv_len", [(3, 8), (8, 3), (1, 5), (5, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_causal_with_q_len_not_kv_len_aligns_top_left(q_len, kv_len, dtype):
    """Query i sees keys j <= i, whatever the lengths (SDPA's convention)."""
    q, k, v, _ = dense_inputs(2, q_len, kv_len, 4, 2, 32, dtype, seed=q_len * 10 + kv_len)
    out = run_dense(q, k, v, is_causal=True)
    assert_matches(out, dense_reference(q, k, v, is_causal=True))


@pytest.mark.parametrize("q_len, kv_len", [(4, 9), (9, 4)])
def test_dense_non_causal_with_q_len_not_kv_len(q_len, kv_len):
    q, k, v, _ = dense_inputs(1, q_len, kv_len, 4, 1, 32, torch.float32, seed=5)
    assert_matches(run_dense(q, k, v), dense_reference(q, k, v))


# Mask shapes, each broadcastable to [B=2, Hq=4, Lq=5, Lk=7].
MASK_SHAPES = [(5, 7), (4, 5, 7), (2, 1, 5, 7), (1, 4, 1, 7), (2, 1, 1, 7), (2, 4, 5, 7)]


@pytest.mark.parametrize("mask_shape", MASK_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_bool_mask_removes_keys(mask_shape, is_causal, dtype):
    q, k, v, g = dense_inputs(2, 5, 7, 4, 2, 32, dtype, seed=len(mask_shape) + 3 * is_causal)
    mask = random_bool_mask(*mask_shape, g=g)
    out = run_dense(q, k, v, attn_mask=mask, is_causal=is_causal)
    assert_matches(out, dense_reference(q, k, v, attn_mask=mask, is_causal=is_causal))


@pytest.mark.parametrize("mask_shape", MASK_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_additive_mask_is_added_to_scores(mask_shape, is_causal, dtype):
    q, k, v, g = dense_inputs(2, 5, 7, 4, 2, 32, dtype, seed=100 + len(mask_shape))
    mask = random_additive_mask(*mask_shape, g=g, dtype=dtype)
    out = run_dense(q, k, v, attn_mask=mask, is_causal=is_causal)
    assert_matches(out, dense_reference(q, k, v, attn_mask=mask, is_causal=is_causal))


@pytest.mark.parametrize("scale", [0.05, 0.3, 1.0])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_dense_custom_scale_multiplies_scores(scale, is_causal):
    q, k, v, _ = dense_inputs(2, 6, 6, 4, 2, 64, torch.float64, seed=int(scale * 100))
    out = run_dense(q, k, v, is_causal=is_causal, scale=scale)
    assert_matches(out, dense_reference(q, k, v, is_causal=is_causal, scale=scale))


def test_dense_value_head_dim_may_differ_from_query_head_dim():
    q, k, v, _ = dense_inputs(2, 5, 6, 4, 2, 32, torch.float32, seed=21, head_dim_v=48)
    out = run_dense(q, k, v, is_causal=True)
    assert out.shape == (2, 5, 4, 48)
    assert_matches(out, dense_reference(q, k, v, is_causal=True))


def test_dense_through_python_api_matches_definition():
    q, k, v, g = dense_inputs(2, 5, 7, 4, 2, 32, torch.float32, seed=31)
    mask = random_bool_mask(2, 1, 5, 7, g=g)
    out = attention(q, k, v, attn_mask=mask, is_causal=True, backend="torch_native")
    assert_matches(out, dense_reference(q, k, v, attn_mask=mask, is_causal=True))


# -- gradients -------------------------------------------------------------------------------


@pytest.mark.parametrize("mask_kind", [None, "bool", "additive"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_dense_gradients_pass_gradcheck(mask_kind, is_causal):
    q, k, v, g = dense_inputs(1, 3, 4, 2, 1, 4, torch.float64, seed=41)
    mask = None
    if mask_kind == "bool":
        mask = random_bool_mask(3, 4, g=g)
    elif mask_kind == "additive":
        mask = random_additive_mask(3, 4, g=g, dtype=torch.float64)
    inputs = tuple(t.requires_grad_() for t in (q, k, v))

    def call(q, k, v):
        return torch.ops.astr.attention(q, k, v, attn_mask=mask, is_causal=is_causal)

    assert torch.autograd.gradcheck(call, inputs)


# -- paged, through PagedKVCache and attention(..., kv_cache=...) ------------------------------

# Steps of a ragged batch: {seq_id: new tokens}. Step 1 prefills two sequences; step 2 adds a
# chunk to sequences that already have cached tokens and starts a third; then decode steps
# (one token each, in another order, one sequence idle).
RAGGED_STEPS = [
    {0: 5, 1: 3},
    {0: 4, 1: 1, 2: 7},
    {0: 1, 1: 1, 2: 1},
    {2: 1, 0: 1},
]


class PagedRun:
    """Drives PagedKVCache + attention step by step and keeps every k/v written, per
    sequence, so that each step's output can be compared with the reference."""

    def __init__(
        self,
        page_size,
        q_heads,
        kv_heads,
        head_dim,
        dtype,
        seed,
        steps,
        device="cpu",
        spare_pages=1,
        backend="torch_native",
    ):
        final = {}
        for step in steps:
            for seq, new in step.items():
                final[seq] = final.get(seq, 0) + new
        num_pages = sum(math.ceil(n / page_size) for n in final.values()) + spare_pages
        self.cache = PagedKVCache(1, num_pages, page_size, kv_heads, head_dim, dtype, device)
        self.q_heads, self.kv_heads, self.head_dim = q_heads, kv_heads, head_dim
        self.dtype, self.device, self.backend = dtype, device, backend
        self.g = make_generator(seed)
        self.keys = {}
        self.values = {}

    def capacity(self):
        return self.cache.step.block_table.shape[1] * self.cache.page_size

    def step(self, new_tokens, is_causal, mask_maker=None, scale=None):
        """Runs one step; returns (output [T, Hq, D], reference [T, Hq, D])."""
        seq_ids, counts = list(new_tokens), list(new_tokens.values())
        step = self.cache.begin_step(seq_ids, counts)
        tokens = sum(counts)
        q = randn(tokens, self.q_heads, self.head_dim, g=self.g, dtype=self.dtype)
        k = randn(tokens, self.kv_heads, self.head_dim, g=self.g, dtype=self.dtype)
        v = randn(tokens, self.kv_heads, self.head_dim, g=self.g, dtype=self.dtype)
        mask = mask_maker(tokens, self.capacity(), self.g) if mask_maker else None
        # decode: [B, 1, heads, D], one new token per sequence; a ragged prefill packs the
        # new tokens along dim 1: [1, T, heads, D]
        new_dim = 1 if step.mode == "decode" else 0

        def as_input(t):
            return t.unsqueeze(new_dim).to(self.device)

        out = attention(
            as_input(q),
            as_input(k),
            as_input(v),
            kv_cache=self.cache,
            attn_mask=None if mask is None else mask.to(self.device),
            is_causal=is_causal,
            fwd=step.mode,
            backend=self.backend,
            scale=scale,
        )
        out = out.reshape(tokens, self.q_heads, self.head_dim).cpu()

        refs, start = [], 0
        for seq, new in zip(seq_ids, counts):
            rows = slice(start, start + new)
            self.keys[seq] = torch.cat([self.keys.get(seq, k[:0]), k[rows]])
            self.values[seq] = torch.cat([self.values.get(seq, v[:0]), v[rows]])
            refs.append(
                sequence_reference(
                    q[rows],
                    self.keys[seq],
                    self.values[seq],
                    is_causal=is_causal,
                    scale=scale,
                    attn_mask=None if mask is None else mask[rows],
                )
            )
            start += new
        return out, torch.cat(refs)


PAGED_HEADS = [(2, 2), (8, 2), (8, 1)]  # ratios 1, 4, 8
PAGED_HEAD_IDS = ["gqa1", "gqa4", "gqa8"]

PAGED_CAUSAL = [
    pytest.param(False, id="full"),
    pytest.param(True, id="causal"),
]


@pytest.mark.parametrize("page_size", [1, 2, 16, 64, 256])
@pytest.mark.parametrize("heads", PAGED_HEADS, ids=PAGED_HEAD_IDS)
@pytest.mark.parametrize("is_causal", PAGED_CAUSAL)
def test_paged_steps_match_definition_over_everything_cached(page_size, heads, is_causal):
    run = PagedRun(
        page_size, *heads, 32, torch.float32, seed=page_size + heads[0], steps=RAGGED_STEPS
    )
    for new_tokens in RAGGED_STEPS:
        out, ref = run.step(new_tokens, is_causal)
        assert_matches(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [40, 128])
def test_paged_steps_match_definition_in_every_dtype(dtype, head_dim):
    run = PagedRun(16, 4, 2, head_dim, dtype, seed=head_dim, steps=RAGGED_STEPS)
    for new_tokens in RAGGED_STEPS:
        out, ref = run.step(new_tokens, is_causal=True)
        assert out.dtype == dtype
        assert_matches(out, ref)


@pytest.mark.parametrize("scale", [0.1, 0.9])
def test_paged_custom_scale_multiplies_scores(scale):
    run = PagedRun(4, 4, 2, 32, torch.float64, seed=3, steps=RAGGED_STEPS)
    for new_tokens in RAGGED_STEPS:
        out, ref = run.step(new_tokens, is_causal=True, scale=scale)
        assert_matches(out, ref)


def bool_mask_maker(extra_columns):
    """[T, capacity + extra_columns] bool masks (extra < 0: fewer columns than the table)."""
    return lambda tokens, capacity, g: random_bool_mask(
        tokens, max(capacity + extra_columns, 0), g=g, keep_first_key=False
    )


def additive_mask_maker(extra_columns, dtype=torch.float32):
    return lambda tokens, capacity, g: random_additive_mask(
        tokens, max(capacity + extra_columns, 0), g=g, dtype=dtype, keep_first_key=False
    )


@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
@pytest.mark.parametrize(
    "extra_columns", [-3, 0, 5], ids=["K<capacity", "K=capacity", "K>capacity"]
)
@pytest.mark.parametrize("page_size", [2, 16])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_paged_mask_covers_kv_positions_and_masks_the_rest(
    mask_kind, extra_columns, page_size, is_causal
):
    makers = {"bool": bool_mask_maker, "additive": additive_mask_maker}
    run = PagedRun(
        page_size, 4, 2, 32, torch.float32, seed=page_size - extra_columns, steps=RAGGED_STEPS
    )
    for new_tokens in RAGGED_STEPS:
        out, ref = run.step(new_tokens, is_causal, mask_maker=makers[mask_kind](extra_columns))
        assert_matches(out, ref)


def test_paged_low_precision_additive_mask():
    run = PagedRun(16, 4, 2, 64, torch.bfloat16, seed=8, steps=RAGGED_STEPS)
    for new_tokens in RAGGED_STEPS:
        out, ref = run.step(new_tokens, True, mask_maker=additive_mask_maker(0, torch.bfloat16))
        assert_matches(out, ref)


def test_paged_sequence_reusing_freed_pages_sees_only_its_own_tokens():
    run = PagedRun(4, 4, 2, 32, torch.float32, seed=13, steps=[{0: 9, 1: 6}, {2: 5}])
    run.step({0: 9, 1: 6}, is_causal=True)
    freed = run.cache.pages_of(0)
    run.cache.free(0)
    out, ref = run.step({2: 5}, is_causal=True)  # takes pages seq 0 wrote into
    assert set(run.cache.pages_of(2)) <= set(freed)
    assert_matches(out, ref)


# -- paged, straight through torch.ops.astr.attention ----------------------------------------


def shuffled_paged_call(
    seq_lens,
    q_lens,
    page_size,
    width,
    q_heads,
    kv_heads,
    head_dim,
    seed,
    num_pages=40,
    dtype=torch.float32,
):
    """A pool larger than needed, block-table rows pointing at shuffled pages of it."""
    g = make_generator(seed)
    batch = len(seq_lens)
    k_cache = randn(num_pages, page_size, kv_heads, head_dim, g=g, dtype=dtype)
    v_cache = randn(num_pages, page_size, kv_heads, head_dim, g=g, dtype=dtype)
    block_table = torch.randperm(num_pages, generator=g)[: batch * width].view(batch, width)
    q = randn(sum(q_lens), q_heads, head_dim, g=g, dtype=dtype)
    starts = torch.tensor([0] + list(q_lens)).cumsum(0)
    return dict(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=block_table.to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=starts.to(torch.int32),
        max_query_len=max(q_lens),
    ), g


def reference_of(call, is_causal, attn_mask=None):
    """The reference's answer to a shuffled_paged_call."""
    return paged_reference(
        call["q"],
        call["k_cache"],
        call["v_cache"],
        call["block_table"],
        call["seq_lens"],
        call["query_start_loc"],
        is_causal=is_causal,
        attn_mask=attn_mask,
    )


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("heads", PAGED_HEADS, ids=PAGED_HEAD_IDS)
@pytest.mark.parametrize("is_causal", PAGED_CAUSAL)
def test_paged_prefill_op_matches_definition(page_size, heads, is_causal):
    seq_lens, q_lens = [6, 13, 3, 9], [2, 5, 3, 1]
    width = math.ceil(max(seq_lens) / page_size)
    call, _ = shuffled_paged_call(
        seq_lens,
        q_lens,
        page_size,
        width,
        *heads,
        32,
        seed=page_size,
        num_pages=width * len(seq_lens) + 7,
    )
    out = torch.ops.astr.attention(
        mode="prefill", is_causal=is_causal, backend="torch_native", **call
    )
    assert_matches(out, reference_of(call, is_causal))


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("heads", PAGED_HEADS, ids=PAGED_HEAD_IDS)
@pytest.mark.parametrize("with_starts", [True, False], ids=["query_start_loc", "no_starts"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_paged_decode_op_matches_definition(page_size, heads, with_starts, is_causal):
    """Decode: one new token per sequence, at the last position (so it sees the whole
    sequence either way); query_start_loc may be None."""
    seq_lens = [6, 13, 1, 9]
    width = math.ceil(max(seq_lens) / page_size)
    call, _ = shuffled_paged_call(
        seq_lens,
        [1, 1, 1, 1],
        page_size,
        width,
        *heads,
        32,
        seed=50 + page_size,
        num_pages=width * len(seq_lens) + 3,
    )
    ref = reference_of(call, is_causal=is_causal)
    if not with_starts:
        call["query_start_loc"] = None
    out = torch.ops.astr.attention(
        mode="decode", is_causal=is_causal, backend="torch_native", **call
    )
    assert_matches(out, ref)


def test_paged_prefill_sequence_without_new_tokens_is_skipped():
    call, _ = shuffled_paged_call([6, 4, 9], [2, 0, 3], 4, 3, 4, 2, 32, seed=55)
    out = torch.ops.astr.attention(mode="prefill", is_causal=True, backend="torch_native", **call)
    assert_matches(out, reference_of(call, is_causal=True))


def test_paged_max_query_len_may_exceed_the_longest_query():
    call, _ = shuffled_paged_call([6, 4, 9], [2, 1, 3], 4, 3, 4, 2, 32, seed=56)
    call["max_query_len"] = 7
    out = torch.ops.astr.attention(mode="prefill", is_causal=True, backend="torch_native", **call)
    assert_matches(out, reference_of(call, is_causal=True))


def test_paged_value_head_dim_may_differ_from_query_head_dim():
    call, g = shuffled_paged_call([6, 4, 9], [2, 1, 3], 4, 3, 4, 2, 32, seed=57)
    call["v_cache"] = randn(*call["v_cache"].shape[:3], 24, g=g)
    out = torch.ops.astr.attention(mode="prefill", is_causal=True, backend="torch_native", **call)
    assert out.shape == (6, 4, 24)
    assert_matches(out, reference_of(call, is_causal=True))


@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
@pytest.mark.parametrize("columns", [4, 16, 23], ids=["K<capacity", "K=capacity", "K>capacity"])
def test_paged_op_mask_matches_definition(mask_kind, columns):
    seq_lens, q_lens = [6, 13, 3], [2, 5, 3]
    call, g = shuffled_paged_call(seq_lens, q_lens, 4, 4, 4, 2, 32, seed=columns)  # capacity 16
    if mask_kind == "bool":
        mask = random_bool_mask(sum(q_lens), columns, g=g, keep_first_key=False)
    else:
        mask = random_additive_mask(
            sum(q_lens), columns, g=g, dtype=torch.float32, keep_first_key=False
        )
    out = torch.ops.astr.attention(
        mode="prefill", is_causal=True, attn_mask=mask, backend="torch_native", **call
    )
    assert_matches(out, reference_of(call, is_causal=True, attn_mask=mask))


@pytest.mark.parametrize("unused_entry", [-1, 0, 10_000])
def test_paged_block_table_entries_past_a_sequences_pages_are_not_read(unused_entry):
    seq_lens, q_lens = [5, 2], [3, 2]
    call, _ = shuffled_paged_call(seq_lens, q_lens, 4, 5, 4, 2, 32, seed=60)
    ref = reference_of(call, is_causal=True)
    call["block_table"][0, 2:] = unused_entry  # sequence 0 uses 2 pages
    call["block_table"][1, 1:] = unused_entry  # sequence 1 uses 1 page
    out = torch.ops.astr.attention(mode="prefill", is_causal=True, backend="torch_native", **call)
    assert_matches(out, ref)


@pytest.mark.parametrize("mask_kind", ["bool", "additive", "no_columns"])
def test_paged_row_that_sees_no_key_returns_zeros(mask_kind):
    seq_lens, q_lens = [6, 9], [2, 3]
    call, g = shuffled_paged_call(seq_lens, q_lens, 4, 3, 4, 2, 32, seed=70)
    tokens = sum(q_lens)
    if mask_kind == "bool":
        mask = random_bool_mask(tokens, 12, g=g)
        mask[[1, 3]] = False
    elif mask_kind == "additive":
        mask = random_additive_mask(tokens, 12, g=g, dtype=torch.float32)
        mask[[1, 3]] = NEG_INF
    else:  # a mask with no columns masks every position
        mask = torch.ones(tokens, 0, dtype=torch.bool)
    out = torch.ops.astr.attention(
        mode="prefill", is_causal=True, attn_mask=mask, backend="torch_native", **call
    )
    blind = [1, 3] if mask_kind != "no_columns" else list(range(tokens))
    assert torch.equal(out[blind], torch.zeros_like(out[blind]))
    assert_matches(out, reference_of(call, is_causal=True, attn_mask=mask))


# -- the page allocator ----------------------------------------------------------------------


def filled_cache():
    """Three pages of 2 tokens, all in use: sequence 0 holds 3 tokens, sequence 1 holds 2."""
    run = PagedRun(2, 2, 1, 8, torch.float32, seed=80, steps=[{0: 3, 1: 2}], spare_pages=0)
    run.step({0: 3, 1: 2}, is_causal=True)
    assert run.cache.free_pages == 0
    return run


def test_full_cache_raises_and_changes_nothing():
    run = filled_cache()
    cache = run.cache
    k_pool, v_pool = (t.clone() for t in cache.layer(0))
    before = {s: (cache.seq_len(s), cache.pages_of(s)) for s in (0, 1)}
    step = cache.step
    with pytest.raises(KVCacheFullError, match="out of pages"):
        cache.begin_step([0, 1], [1, 1])  # sequence 1 needs a second page
    assert cache.free_pages == 0
    assert {s: (cache.seq_len(s), cache.pages_of(s)) for s in (0, 1)} == before
    assert torch.equal(cache.layer(0)[0], k_pool)
    assert torch.equal(cache.layer(0)[1], v_pool)
    # The step before the refused one is over: no later call may write through its slots.
    assert step is not None and cache.step is None


def test_step_that_fits_in_held_pages_needs_no_free_page():
    run = filled_cache()
    out, ref = run.step({0: 1}, is_causal=True)  # position 3 is the last slot of its page
    assert_matches(out, ref)


def test_free_returns_a_sequences_pages():
    run = filled_cache()
    cache = run.cache
    pages = cache.pages_of(0)
    cache.free(0)
    assert cache.free_pages == len(pages) == 2
    assert cache.seq_len(0) == 0 and cache.pages_of(0) == []
    out, ref = run.step({1: 2}, is_causal=True)  # now fits
    assert_matches(out, ref)


# -- the same on a GPU -----------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("page_size", [1, 16, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_steps_match_definition_on_gpu(page_size, dtype):
    run = PagedRun(page_size, 8, 2, 64, dtype, seed=page_size, steps=RAGGED_STEPS, device="cuda")
    for new_tokens in RAGGED_STEPS:
        out, ref = run.step(new_tokens, is_causal=True)
        assert_matches(out, ref)
