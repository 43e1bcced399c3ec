"""Every bad input is refused with an error whose message starts with the argument's name.

Each case starts from a valid call (checked by ``test_the_valid_calls_run``) and breaks one
thing. RuntimeError for bad tensors, ValueError for bad names and options (mode, backend,
page_size).
"""

from __future__ import annotations

import pytest
import torch

from astrai.extension import PagedKVCache, attention

# -- valid calls to break --------------------------------------------------------------------

BATCH, Q_HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 16
NUM_PAGES, PAGE_SIZE, WIDTH = 8, 4, 3  # capacity: 12 tokens per sequence


def dense_call(dtype=torch.float32):
    """q [2, 5, 4, 16], k/v [2, 7, 2, 16]."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(BATCH, 5, Q_HEADS, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(BATCH, 7, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(BATCH, 7, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    return dict(q=q, k=k, v=v)


def paged_call(mode="prefill", dtype=torch.float32):
    """Two sequences: 6 and 9 tokens, of which 2 and 3 are new (prefill) or 1 and 1 (decode)."""
    g = torch.Generator().manual_seed(1)
    q_lens = [2, 3] if mode == "prefill" else [1, 1]
    return dict(
        q=torch.randn(sum(q_lens), Q_HEADS, HEAD_DIM, generator=g).to(dtype),
        k_cache=torch.randn(NUM_PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM, generator=g).to(dtype),
        v_cache=torch.randn(NUM_PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM, generator=g).to(dtype),
        block_table=torch.tensor([[3, 0, 5], [1, 7, 2]], dtype=torch.int32),
        seq_lens=torch.tensor([6, 9], dtype=torch.int32),
        query_start_loc=torch.tensor(
            [0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32
        ),
        max_query_len=max(q_lens),
        mode=mode,
        is_causal=True,
    )


def run(call):
    return torch.ops.astr.attention(**call)


def with_(call, **changes):
    call = dict(call)
    call.update(changes)
    return call


def on_meta(t):
    """The same tensor on another device (meta: no data, so no GPU is needed)."""
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def int32(*values):
    return torch.tensor(values, dtype=torch.int32)


def test_the_valid_calls_run():
    assert run(dense_call()).shape == (BATCH, 5, Q_HEADS, HEAD_DIM)
    assert run(paged_call()).shape == (5, Q_HEADS, HEAD_DIM)
    assert run(paged_call("decode")).shape == (2, Q_HEADS, HEAD_DIM)
    assert run(with_(paged_call("decode"), query_start_loc=None)).shape == (2, Q_HEADS, HEAD_DIM)


# -- dense calls -----------------------------------------------------------------------------


def _dense_cases():
    c = dense_call()
    q, k, v = c["q"], c["k"], c["v"]
    return {
        "q 3-D": (with_(c, q=q[0]), "q: expected a 4-D tensor"),
        "q 5-D": (with_(c, q=q[None]), "q: expected a 4-D tensor"),
        "q integer": (with_(c, q=q.to(torch.int32)), "q: expected a floating-point"),
        "k missing": (with_(c, k=None, v=None), "k, v: required for dense calls"),
        "k 3-D": (with_(c, k=k[0]), "k: expected a 4-D tensor"),
        "v 3-D": (with_(c, v=v[0]), "v: expected a 4-D tensor"),
        "k float32 with q bf16": (
            with_(c, q=q.bfloat16(), v=v.bfloat16()),
            "k: expected dtype BFloat16",
        ),
        "v float64 with q float32": (with_(c, v=v.double()), "v: expected dtype Float"),
        "k on another device": (with_(c, k=on_meta(k)), "k: expected a tensor on cpu"),
        "v on another device": (with_(c, v=on_meta(v)), "v: expected a tensor on cpu"),
        "k batch": (with_(c, k=k[:1]), "k: batch 1 does not match q's 2"),
        "v kv_len": (with_(c, v=v[:, :6]), "v: kv_len 6 does not match k's 7"),
        "v kv_heads": (with_(c, v=v[:, :, :1]), "v: kv_heads 1 does not match k's 2"),
        "q heads not a multiple of kv heads": (
            with_(c, k=torch.randn(2, 7, 3, 16), v=torch.randn(2, 7, 3, 16)),
            r"k: q heads \(4\) must be a multiple of kv heads \(3\)",
        ),
        "head_dim mismatch": (with_(c, k=k[..., :8]), "k: head_dim 8 does not match q's 16"),
        "mask int": (
            with_(c, attn_mask=torch.ones(5, 7, dtype=torch.int32)),
            "attn_mask: expected dtype bool",
        ),
        "mask float64 with q float32": (
            with_(c, attn_mask=torch.zeros(5, 7, dtype=torch.float64)),
            "attn_mask: expected dtype bool",
        ),
        "mask 1-D": (
            with_(c, attn_mask=torch.ones(7, dtype=torch.bool)),
            "attn_mask: expected 2 to 4 dims",
        ),
        "mask 5-D": (
            with_(c, attn_mask=torch.ones(1, 2, 4, 5, 7, dtype=torch.bool)),
            "attn_mask: expected 2 to 4 dims",
        ),
        "mask kv_len": (
            with_(c, attn_mask=torch.ones(5, 6, dtype=torch.bool)),
            r"attn_mask: shape \[5, 6\] does not broadcast",
        ),
        "mask heads": (
            with_(c, attn_mask=torch.ones(3, 5, 7, dtype=torch.bool)),
            r"attn_mask: shape \[3, 5, 7\] does not broadcast",
        ),
        "mask batch": (
            with_(c, attn_mask=torch.ones(3, 1, 5, 7, dtype=torch.bool)),
            r"attn_mask: shape \[3, 1, 5, 7\] does not broadcast",
        ),
        "mask on another device": (
            with_(c, attn_mask=torch.empty(5, 7, dtype=torch.bool, device="meta")),
            "attn_mask: expected a tensor on cpu",
        ),
        "paged metadata without k_cache": (
            with_(c, block_table=torch.zeros(2, 1, dtype=torch.int32)),
            "k_cache: block_table/seq_lens/query_start_loc/v_cache given without k_cache",
        ),
    }


DENSE_CASES = _dense_cases()


@pytest.mark.parametrize("case", list(DENSE_CASES))
def test_bad_dense_input_names_the_argument(case):
    call, message = DENSE_CASES[case]
    with pytest.raises(RuntimeError, match=message):
        run(call)


@pytest.mark.parametrize("case", ["q 3-D", "k float32 with q bf16", "mask kv_len"])
def test_bad_dense_input_is_refused_by_explain_too(case):
    call, message = DENSE_CASES[case]
    with pytest.raises(RuntimeError, match=message):
        torch.ops.astr.explain(**call)


def test_bad_dense_input_through_the_python_api():
    c = dense_call()
    with pytest.raises(RuntimeError, match="k: head_dim 8 does not match q's 16"):
        attention(c["q"], c["k"][..., :8], c["v"])


# -- paged calls -----------------------------------------------------------------------------


def _paged_cases():
    c = paged_call()
    d = paged_call("decode")
    table = c["block_table"]
    return {
        "q 4-D": (with_(c, q=c["q"][None]), "q: expected a 3-D tensor"),
        "q 2-D": (with_(c, q=c["q"][0]), "q: expected a 3-D tensor"),
        "k given": (with_(c, k=c["q"][:, :2], v=c["q"][:, :2]), "k, v: must be None"),
        "mode missing": (with_(c, mode=None), "mode: paged calls need mode"),
        "v_cache missing": (with_(c, v_cache=None), "v_cache: required with k_cache"),
        "block_table missing": (with_(c, block_table=None), "block_table: required"),
        "seq_lens missing": (with_(c, seq_lens=None), "seq_lens: required"),
        "k_cache 3-D": (with_(c, k_cache=c["k_cache"][0]), "k_cache: expected a 4-D tensor"),
        "k_cache bf16 with q float32": (
            with_(c, k_cache=c["k_cache"].bfloat16()),
            "k_cache: expected dtype Float",
        ),
        "v_cache float64 with q float32": (
            with_(c, v_cache=c["v_cache"].double()),
            "v_cache: expected dtype Float",
        ),
        "k_cache on another device": (
            with_(c, k_cache=on_meta(c["k_cache"])),
            "k_cache: expected a tensor on cpu",
        ),
        "v_cache pages": (with_(c, v_cache=c["v_cache"][:5]), "v_cache: shape"),
        "k_cache head_dim": (
            with_(c, k_cache=c["k_cache"][..., :8]),
            "k_cache: head_dim 8 does not match q's 16",
        ),
        "q heads not a multiple of kv heads": (
            with_(c, k_cache=torch.randn(8, 4, 3, 16), v_cache=torch.randn(8, 4, 3, 16)),
            r"k_cache: q heads \(4\) must be a multiple of kv heads \(3\)",
        ),
        "block_table int64": (
            with_(c, block_table=table.long()),
            "block_table: expected dtype int32",
        ),
        "block_table 1-D": (with_(c, block_table=table[0]), "block_table: expected a 2-D"),
        "block_table rows": (with_(c, block_table=table[:1]), "block_table: has 1 rows"),
        "block_table on another device": (
            with_(c, block_table=on_meta(table)),
            "block_table: expected a tensor on cpu",
        ),
        "seq_lens int64": (
            with_(c, seq_lens=c["seq_lens"].long()),
            "seq_lens: expected dtype int32",
        ),
        "seq_lens 2-D": (with_(c, seq_lens=c["seq_lens"][None]), "seq_lens: expected a 1-D"),
        "seq_lens wrong size": (
            with_(c, seq_lens=int32(6, 9, 4)),
            r"expected one per sequence \(3, from seq_lens\)",
        ),
        "query_start_loc wrong size": (
            with_(c, query_start_loc=int32(0, 5)),
            "query_start_loc: has 2 entries, expected batch",
        ),
        "query_start_loc int64": (
            with_(c, query_start_loc=c["query_start_loc"].long()),
            "query_start_loc: expected dtype int32",
        ),
        "query_start_loc not from 0": (
            with_(c, query_start_loc=int32(1, 3, 5)),
            "query_start_loc: must start at 0",
        ),
        "query_start_loc last entry": (
            with_(c, query_start_loc=int32(0, 2, 4)),
            "query_start_loc: last entry 4 must equal",
        ),
        "query_start_loc decreasing": (
            with_(
                c,
                q=torch.randn(5, 4, 16),
                block_table=torch.tensor([[3, 0, 5], [1, 7, 2], [4, 6, 0]], dtype=torch.int32),
                query_start_loc=int32(0, 4, 2, 5),
                max_query_len=4,
                seq_lens=int32(6, 9, 4),
            ),
            "query_start_loc: must be non-decreasing, entry 2 is 2 after 4",
        ),
        "query_start_loc missing for prefill": (
            with_(c, query_start_loc=None),
            "query_start_loc: required for paged prefill",
        ),
        "block_table entry negative": (
            with_(c, block_table=torch.tensor([[3, -1, 5], [1, 7, 2]], dtype=torch.int32)),
            r"block_table: entry \[0, 1\] = -1 is out of range for a pool of 8 pages",
        ),
        "block_table entry past the pool": (
            with_(c, block_table=torch.tensor([[3, 0, 5], [1, 7, 8]], dtype=torch.int32)),
            r"block_table: entry \[1, 2\] = 8 is out of range for a pool of 8 pages",
        ),
        "seq_lens larger than the table capacity": (
            with_(c, seq_lens=int32(6, 13)),
            "seq_lens: sequence 1 has length 13 but its block_table row holds only 3 pages",
        ),
        "seq_lens smaller than the new tokens": (
            with_(c, seq_lens=int32(6, 2)),
            "seq_lens: sequence 1 has length 2, fewer than its 3 new tokens",
        ),
        "max_query_len missing for prefill": (
            with_(c, max_query_len=0),
            "max_query_len: required for paged prefill",
        ),
        "max_query_len too small": (
            with_(c, max_query_len=2),
            "max_query_len: 2 is less than sequence 1's 3 new tokens",
        ),
        "decode query_start_loc not one token per sequence": (
            with_(d, query_start_loc=int32(0, 2, 2)),
            r"query_start_loc: decode takes one token per sequence \(0, 1, ..., batch\), "
            "entry 1 is 2 after 0",
        ),
        "decode with T != B": (
            with_(d, q=c["q"]),
            "q: decode takes one token per sequence: expected 2",
        ),
        "mask int": (
            with_(c, attn_mask=torch.ones(5, 12, dtype=torch.int32)),
            "attn_mask: expected dtype bool",
        ),
        "mask 3-D": (
            with_(c, attn_mask=torch.ones(1, 5, 12, dtype=torch.bool)),
            "attn_mask: paged calls take a 2-D mask",
        ),
        "mask rows": (
            with_(c, attn_mask=torch.ones(4, 12, dtype=torch.bool)),
            "attn_mask: paged calls take a 2-D mask",
        ),
    }


PAGED_CASES = _paged_cases()


@pytest.mark.parametrize("case", list(PAGED_CASES))
def test_bad_paged_input_names_the_argument(case):
    call, message = PAGED_CASES[case]
    with pytest.raises(RuntimeError, match=message):
        run(call)


@pytest.mark.parametrize("entry", ["attention", "explain"])
@pytest.mark.parametrize("call", [dense_call(), paged_call()], ids=["dense", "paged"])
def test_unknown_mode_raises_value_error(entry, call):
    with pytest.raises(ValueError, match="mode: expected None, 'prefill' or 'decode', got 'bogus'"):
        getattr(torch.ops.astr, entry)(**with_(call, mode="bogus"))


def test_unknown_fwd_through_the_python_api_raises_value_error():
    c = dense_call()
    with pytest.raises(ValueError, match="mode: .*'bogus'"):
        attention(c["q"], c["k"], c["v"], fwd="bogus")


# -- append_kv -------------------------------------------------------------------------------


def append_call():
    """Three tokens into a pool of 4 pages of 2 slots; the last one skipped (slot -1)."""
    return dict(
        k=torch.randn(3, KV_HEADS, HEAD_DIM),
        v=torch.randn(3, KV_HEADS, HEAD_DIM),
        k_cache=torch.zeros(4, 2, KV_HEADS, HEAD_DIM),
        v_cache=torch.zeros(4, 2, KV_HEADS, HEAD_DIM),
        slot_mapping=torch.tensor([5, 0, -1], dtype=torch.int32),
    )


def test_append_kv_writes_slots_and_skips_negative_ones():
    a = append_call()
    torch.ops.astr.append_kv(**a)
    k_slots = a["k_cache"].view(8, KV_HEADS, HEAD_DIM)
    v_slots = a["v_cache"].view(8, KV_HEADS, HEAD_DIM)
    assert torch.equal(k_slots[5], a["k"][0]) and torch.equal(k_slots[0], a["k"][1])
    assert torch.equal(v_slots[5], a["v"][0]) and torch.equal(v_slots[0], a["v"][1])
    untouched = [1, 2, 3, 4, 6, 7]
    assert not k_slots[untouched].any() and not v_slots[untouched].any()


def _append_cases():
    a = append_call()
    return {
        "slot past the pool": (
            with_(a, slot_mapping=torch.tensor([5, 8, 0], dtype=torch.int32)),
            "slot_mapping: slot 8 is out of range for a pool of 8 slots",
        ),
        "slot_mapping int64": (
            with_(a, slot_mapping=a["slot_mapping"].long()),
            "slot_mapping: expected dtype int32",
        ),
        "slot_mapping length": (
            with_(a, slot_mapping=a["slot_mapping"][:2]),
            r"slot_mapping: expected \[tokens\] = \[3\]",
        ),
        "k dtype": (with_(a, k=a["k"].double()), "k: dtype Double does not match k_cache's Float"),
        "v dtype": (with_(a, v=a["v"].bfloat16()), "v: dtype BFloat16 does not match v_cache's"),
        "k heads": (with_(a, k=torch.randn(3, 1, HEAD_DIM)), "k: shape .* does not match k_cache"),
        "k head_dim": (with_(a, k=torch.randn(3, KV_HEADS, 8)), "k: shape .* does not match"),
        "v heads": (with_(a, v=torch.randn(3, 1, HEAD_DIM)), "v: shape .* does not match v_cache"),
        "v tokens": (with_(a, v=a["v"][:2]), "v: 2 tokens, k has 3"),
        "k 4-D": (with_(a, k=a["k"][None]), "k: expected"),
        "k_cache 3-D": (with_(a, k_cache=a["k_cache"][0]), "k_cache: expected a 4-D tensor"),
        "k_cache not contiguous": (
            with_(a, k_cache=torch.zeros(2, 4, KV_HEADS, HEAD_DIM).transpose(0, 1)),
            "k_cache, v_cache: expected contiguous",
        ),
    }


APPEND_CASES = _append_cases()


@pytest.mark.parametrize("case", list(APPEND_CASES))
def test_bad_append_kv_input_names_the_argument(case):
    call, message = APPEND_CASES[case]
    with pytest.raises(RuntimeError, match=message):
        torch.ops.astr.append_kv(**call)


def test_bad_append_kv_leaves_the_pools_unchanged():
    call, _ = APPEND_CASES["slot past the pool"]
    with pytest.raises(RuntimeError):
        torch.ops.astr.append_kv(**call)
    assert not call["k_cache"].any() and not call["v_cache"].any()


# -- PagedKVCache ----------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [0, 3, 12, 512])
def test_cache_page_size_must_be_a_power_of_two_up_to_256(page_size):
    with pytest.raises(ValueError, match=f"page_size: {page_size} not supported"):
        PagedKVCache(1, 4, page_size, KV_HEADS, HEAD_DIM)


@pytest.mark.parametrize("field", ["num_layers", "num_pages", "num_kv_heads", "head_dim"])
def test_cache_sizes_must_be_positive(field):
    sizes = dict(num_layers=1, num_pages=4, page_size=4, num_kv_heads=2, head_dim=8)
    sizes[field] = 0
    with pytest.raises(ValueError, match=field):
        PagedKVCache(**sizes)


def small_cache():
    return PagedKVCache(2, 4, 4, KV_HEADS, HEAD_DIM, dtype=torch.float32)


BEGIN_STEP_CASES = {
    "lengths differ": (([0, 1], [2]), "seq_ids, num_new_tokens"),
    "empty": (([], []), "seq_ids, num_new_tokens"),
    "a sequence twice": (([0, 0], [1, 1]), "seq_ids: a sequence appears twice"),
    "no new tokens": (([0, 1], [2, 0]), "num_new_tokens: every sequence must add"),
}


@pytest.mark.parametrize("case", list(BEGIN_STEP_CASES))
def test_bad_begin_step_raises_value_error(case):
    (seq_ids, counts), message = BEGIN_STEP_CASES[case]
    cache = small_cache()
    with pytest.raises(ValueError, match=message):
        cache.begin_step(seq_ids, counts)
    assert cache.free_pages == 4


def test_block_table_width_smaller_than_needed_raises():
    with pytest.raises(ValueError, match="block_table_width: 1 pages is fewer than the 2"):
        small_cache().begin_step([0], [5], block_table_width=1)


def test_append_before_begin_step_raises():
    cache = small_cache()
    with pytest.raises(RuntimeError, match="kv_cache: call begin_step"):
        cache.append(0, torch.randn(1, KV_HEADS, HEAD_DIM), torch.randn(1, KV_HEADS, HEAD_DIM))


def test_attention_before_begin_step_raises():
    cache = small_cache()
    q = torch.randn(1, 1, Q_HEADS, HEAD_DIM)
    with pytest.raises(RuntimeError, match="kv_cache: call begin_step"):
        attention(q, None, None, kv_cache=cache, fwd="decode")


@pytest.mark.parametrize("layer_id", [-1, 2])
def test_layer_out_of_range_raises(layer_id):
    with pytest.raises(IndexError, match=f"layer_id: {layer_id} out of range"):
        small_cache().layer(layer_id)


def test_free_of_an_unknown_sequence_raises():
    with pytest.raises(KeyError, match="seq_id: 7"):
        small_cache().free(7)


def test_append_of_wrong_heads_through_the_cache_names_k():
    cache = small_cache()
    cache.begin_step([0], [2])
    with pytest.raises(ValueError, match="k: expected"):
        cache.append(0, torch.randn(2, 1, 2 * HEAD_DIM), torch.randn(2, KV_HEADS, HEAD_DIM))


def test_step_metadata_copy_needs_the_same_shapes():
    cache = small_cache()
    captured = cache.begin_step([0, 1], [1, 1], block_table_width=2)
    other = cache.begin_step([0], [1])
    with pytest.raises(ValueError, match="block_table: shape"):
        captured.copy_(other)


def test_a_malformed_selection_names_the_argument():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="backend_source: expected 0"):
        torch.ops.astr.attention(q, q, q, backend="cuda", backend_source=7)
    with pytest.raises(ValueError, match="backend: 'nope' .backend_source 2, a context."):
        torch.ops.astr.attention(q, q, q, backend="nope", backend_source=2)
    with pytest.raises(ValueError, match="backend: must be None with backend_source 4"):
        torch.ops.astr.attention(q, q, q, backend="cuda", backend_source=4)
