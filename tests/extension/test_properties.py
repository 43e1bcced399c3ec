"""Properties of the torch_native backend over random calls (hypothesis), against the float64
reference written from the definition (tests/reference.py):

- paged prefill and decode: random batch sizes, head counts (GQA), head dims, page sizes
  (1..256, powers of two), ragged lengths, page orders in the pool and spare block-table columns;
- dense calls: random shapes, GQA, causal, bool and additive masks;
- random bad paged metadata: a clear error that names the argument, or (when the metadata
  happens to be valid) the reference's answer; never a crash, never a wrong answer;
- on a GPU (marked cuda): the same paged calls through the cuda kernels at the head dims they
  serve, and the bad metadata in checked mode (a clear error or the right answer); unchecked, the
  kernels' part is to stay inside the pool (scripts/sanitizer_smoke.py under compute-sanitizer).

Each property runs a bounded number of examples so that CI spends a few seconds on each.
"""

from __future__ import annotations

import math

import pytest
import torch

import astrai.extension  # noqa: F401  (loads the native ops)
from tests.reference import assert_close_to_reference, dense_reference, paged_reference

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

PAGE_SIZES = [2**i for i in range(9)]  # 1, 2, 4, ..., 256
HEAD_DIMS = [4, 8, 16]
DTYPES = [torch.float32, torch.bfloat16]
PROPERTY = settings(max_examples=40, deadline=None, derandomize=True)


def randn(*shape, g, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)


@st.composite
def paged_calls(draw, modes=("prefill", "decode"), head_dims=HEAD_DIMS, dtypes=DTYPES):
    """A valid paged call: pages handed out in a random order from a pool with spare pages
    (filled with random values too), block-table rows padded with random pool pages."""
    mode = draw(st.sampled_from(modes))
    page_size = draw(st.sampled_from(PAGE_SIZES))
    kv_heads = draw(st.integers(1, 3))
    q_heads = kv_heads * draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from(head_dims))
    dtype = draw(st.sampled_from(dtypes))
    batch = draw(st.integers(1, 4))
    lengths = st.one_of(st.integers(1, 40), st.integers(200, 300))
    seq_lens = [draw(lengths) for _ in range(batch)]
    if mode == "decode":
        q_lens = [1] * batch
    else:
        q_lens = [draw(st.integers(1, min(length, 24))) for length in seq_lens]
    pages_needed = [math.ceil(length / page_size) for length in seq_lens]
    width = max(pages_needed) + draw(st.integers(0, 2))
    num_pages = sum(pages_needed) + draw(st.integers(0, 3))
    order = draw(st.permutations(range(num_pages)))
    seed = draw(st.integers(0, 2**31 - 1))

    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, num_pages, (batch, width), generator=g, dtype=torch.int32)
    cursor = 0
    for b, need in enumerate(pages_needed):
        table[b, :need] = torch.tensor(order[cursor : cursor + need], dtype=torch.int32)
        cursor += need
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    call = dict(
        q=randn(starts[-1], q_heads, head_dim, g=g, dtype=dtype),
        k_cache=randn(num_pages, page_size, kv_heads, head_dim, g=g, dtype=dtype),
        v_cache=randn(num_pages, page_size, kv_heads, head_dim, g=g, dtype=dtype),
        block_table=table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        max_query_len=max(q_lens),
        mode=mode,
        is_causal=draw(st.booleans()),
    )
    if mode == "decode" and draw(st.booleans()):
        call["query_start_loc"] = None  # optional for decode
    return call


def reference_of(call):
    starts = call["query_start_loc"]
    if starts is None:
        starts = torch.arange(call["q"].shape[0] + 1, dtype=torch.int32)
    return paged_reference(
        call["q"],
        call["k_cache"],
        call["v_cache"],
        call["block_table"],
        call["seq_lens"],
        starts,
        is_causal=call["is_causal"],
    )


@PROPERTY
@given(paged_calls())
def test_paged_calls_match_the_definition(call):
    out = torch.ops.astr.attention(**call, backend="torch_native")
    assert_close_to_reference(out, reference_of(call))


def test_control_the_reference_tells_page_orders_and_causality_apart():
    """The paged property would fail if the backend ignored the block table's order or the
    causal edge: both change the answer on a call of the generator's kind."""
    g = torch.Generator().manual_seed(0)
    call = dict(
        q=randn(5, 2, 8, g=g),
        k_cache=randn(4, 2, 1, 8, g=g),
        v_cache=randn(4, 2, 1, 8, g=g),
        block_table=torch.tensor([[2, 0, 3]], dtype=torch.int32),
        seq_lens=torch.tensor([6], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 5], dtype=torch.int32),
        max_query_len=5,
        mode="prefill",
        is_causal=True,
    )
    out = torch.ops.astr.attention(**call, backend="torch_native")
    assert_close_to_reference(out, reference_of(call))
    in_pool_order = dict(call, block_table=torch.tensor([[0, 2, 3]], dtype=torch.int32))
    not_causal = dict(call, is_causal=False)
    for wrong in (in_pool_order, not_causal):
        with pytest.raises(AssertionError):
            assert_close_to_reference(out, reference_of(wrong))


@st.composite
def dense_calls(draw):
    batch, q_len, kv_len = (
        draw(st.integers(1, 3)),
        draw(st.integers(1, 12)),
        draw(st.integers(1, 12)),
    )
    kv_heads = draw(st.integers(1, 3))
    q_heads = kv_heads * draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from(HEAD_DIMS))
    dtype = draw(st.sampled_from(DTYPES))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    q = randn(batch, q_len, q_heads, head_dim, g=g, dtype=dtype)
    k = randn(batch, kv_len, kv_heads, head_dim, g=g, dtype=dtype)
    v = randn(batch, kv_len, kv_heads, head_dim, g=g, dtype=dtype)
    mask_kind = draw(st.sampled_from(["none", "bool", "additive"]))
    mask = None
    if mask_kind != "none":
        shape = draw(
            st.sampled_from(
                [(q_len, kv_len), (batch, 1, q_len, kv_len), (batch, q_heads, q_len, kv_len)]
            )
        )
        keep = torch.rand(shape, generator=g) < 0.7
        keep[..., 0] = True  # every row sees a key (with top-left causality too)
        if mask_kind == "bool":
            mask = keep
        else:
            mask = torch.where(keep, randn(*shape, g=g), torch.tensor(-math.inf)).to(dtype)
    return q, k, v, draw(st.booleans()), mask


@PROPERTY
@given(dense_calls())
def test_dense_calls_match_the_definition(case):
    q, k, v, is_causal, mask = case
    out = torch.ops.astr.attention(q, k, v, mask, is_causal, backend="torch_native")
    assert_close_to_reference(out, dense_reference(q, k, v, attn_mask=mask, is_causal=is_causal))


# -- random bad metadata ---------------------------------------------------------------------

ARGUMENTS = ("block_table:", "seq_lens:", "query_start_loc:", "max_query_len:", "q:")


@st.composite
def broken_paged_calls(draw, head_dims=HEAD_DIMS, dtype=torch.float32):
    """A valid call with one to three metadata values replaced by random ones, in and out of
    range, or its block table cut to no columns, or its batch to no sequences."""
    call = draw(paged_calls(head_dims=head_dims, dtypes=[dtype]))
    num_pages = call["k_cache"].shape[0]
    capacity = call["block_table"].shape[1] * call["k_cache"].shape[1]
    tokens = call["q"].shape[0]
    targets = ["block_table", "seq_lens", "query_start_loc", "max", "no columns", "no sequences"]
    for _ in range(draw(st.integers(1, 3))):
        target = draw(st.sampled_from(targets))
        if target == "max":
            call["max_query_len"] = draw(st.one_of(st.integers(-2, tokens + 3), st.just(10**15)))
            continue
        if target == "no columns":
            call["block_table"] = call["block_table"][:, :0]
            continue
        if target == "no sequences":
            call["block_table"], call["seq_lens"] = call["block_table"][:0], call["seq_lens"][:0]
            if call["query_start_loc"] is not None:
                call["query_start_loc"] = call["query_start_loc"][:1]
            continue
        if call[target] is None:
            continue
        tensor = call[target] = call[target].clone()
        flat = tensor.view(-1)
        if flat.numel() == 0:
            continue
        index = draw(st.integers(0, flat.numel() - 1))
        bound = {"block_table": num_pages, "seq_lens": capacity, "query_start_loc": tokens}
        flat[index] = draw(st.integers(-3, bound[target] + 3))
    return call


@settings(max_examples=80, deadline=None, derandomize=True)
@given(broken_paged_calls())
def test_bad_paged_metadata_gets_a_clear_error_or_the_right_answer(call):
    try:
        out = torch.ops.astr.attention(**call, backend="torch_native")
    except RuntimeError as error:
        message = str(error).splitlines()[0]
        assert message.startswith(ARGUMENTS), message
        return
    # Accepted: the metadata must be valid, and the answer the definition's.
    assert_close_to_reference(out, reference_of(call))


# -- the cuda kernels (GPU) -------------------------------------------------------------------

CUDA_HEAD_DIMS = [64, 96, 128, 256, 512]  # config.h's equal rows (tests/kernels read the library)
CUDA_PROPERTY = settings(max_examples=40, deadline=None, derandomize=True)


def on_cuda(call):
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in call.items()}


@pytest.mark.cuda
@CUDA_PROPERTY
@given(paged_calls(head_dims=CUDA_HEAD_DIMS, dtypes=[torch.bfloat16, torch.float16]))
def test_cuda_paged_calls_match_the_definition(call):
    out = torch.ops.astr.attention(**on_cuda(call), backend="cuda")
    assert_close_to_reference(out.cpu(), reference_of(call))


@pytest.mark.cuda
@settings(max_examples=60, deadline=None, derandomize=True)
@given(broken_paged_calls(head_dims=CUDA_HEAD_DIMS, dtype=torch.bfloat16))
def test_cuda_checked_mode_gives_bad_metadata_a_clear_error_or_the_right_answer(call):
    from astrai.extension import ops  # noqa: PLC0415

    ops.set_metadata_checks(True)
    try:
        out = torch.ops.astr.attention(**on_cuda(call), backend="cuda")
    except RuntimeError as error:
        message = str(error).splitlines()[0]
        assert message.startswith(ARGUMENTS), message
        return
    finally:
        ops.set_metadata_checks(False)
    assert_close_to_reference(out.cpu(), reference_of(call))
