"""GPU tests: bad paged metadata never makes the cuda kernels touch memory outside the pools, the
block table, q, the output and their workspace, and never costs the process its CUDA context.

Unchecked (the default, no host synchronisation): a page id outside the pool is never read, lengths
are clamped to the block table; the rows of the sequence with bad metadata are written as NaN
(params.h: "poison") while every other sequence still matches the reference. Checked mode
(ASTR_CHECK_METADATA=1 or ops.set_metadata_checks(True)): the call raises an error that names the
argument. compute-sanitizer runs scripts/sanitizer_smoke.py over the same cases on the H200.
"""

import math

import pytest
import torch

from astrai.extension import ops
from tests.kernels.conftest import PREFILL_KERNEL_TUNINGS, cuda_op
from tests.kernels.test_cuda_kernels import (
    MERGE_TUNING,
    TOLERANCE,
    PagedBatch,
    poison_next_allocation,
    reference,
    splits_tuning,
)

# Skipped where no GPU is visible (tests/conftest.py).
pytestmark = pytest.mark.cuda


def run(batch, decode, block_table=None, seq_lens=None, query_start_loc=None, max_query_len=None):
    q = batch.q
    poison_next_allocation(q.shape, q.dtype)
    out, _ = cuda_op(
        q,
        batch.k_cache,
        batch.v_cache,
        batch.block_table if block_table is None else block_table,
        batch.seq_lens if seq_lens is None else seq_lens,
        batch.query_start_loc if query_start_loc is None else query_start_loc,
        1 if decode else (max_query_len or max(batch.q_lens_list)),
        decode,
        None,
        True,
        1.0 / math.sqrt(q.shape[-1]),
    )
    torch.cuda.synchronize()  # an illegal access would surface here
    return out


def token_rows(batch, b):
    start = sum(batch.q_lens_list[:b])
    return slice(start, start + batch.q_lens_list[b])


def assert_others_match(out, batch, bad):
    ref = reference(batch, batch.q, True, 1.0 / math.sqrt(batch.q.shape[-1]))
    for b in range(len(batch.seq_lens_list)):
        if b == bad:
            continue
        rows = token_rows(batch, b)
        assert not torch.isnan(out[rows]).any(), f"sequence {b} got NaN from sequence {bad}"
        err = (out[rows].double() - ref[rows]).norm() / ref[rows].norm().clamp_min(1e-30)
        assert err < TOLERANCE[batch.q.dtype], f"sequence {b}: relative L2 error {err:.3e}"


def corrupt(batch, case):
    """(block_table, seq_lens) with sequence 1's metadata broken as `case` says."""
    table, lens = batch.block_table.clone(), batch.seq_lens.clone()
    pages = batch.k_cache.shape[0]
    if case == "negative_page":
        table[1, 0] = -7
    elif case == "page_past_the_pool":
        table[1, 1] = pages + 1000
    elif case == "huge_page":
        table[1, 0] = 2**31 - 1
    elif case == "last_page_negative":  # a split's later tile, not its first
        table[1, (int(lens[1]) - 1) // batch.page_size] = -2
    elif case == "length_past_the_table":
        lens[1] = table.shape[1] * batch.page_size + 5000
    elif case == "negative_length":
        lens[1] = -3
    return table, lens


CASES = [
    "negative_page",
    "page_past_the_pool",
    "huge_page",
    "last_page_negative",
    "length_past_the_table",
    "negative_length",
]
FORMS = [
    (None, "auto"),
    (1, "eight"),
    (1, "persistent"),
    (2, "pairs"),
    (2, "cluster"),
    (2, "kernel"),
    (5, "auto"),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("splits,merge", FORMS)
def test_decode_with_bad_metadata_poisons_only_its_sequence(case, splits, merge, tuning):
    tuning(splits_tuning(splits), MERGE_TUNING[merge])
    g = torch.Generator(device="cuda").manual_seed(13)
    batch = PagedBatch([700, 900, 2000, 33], [1] * 4, 8, 2, 128, 16, torch.bfloat16, generator=g)
    table, lens = corrupt(batch, case)
    out = run(batch, True, table, lens)
    assert torch.isnan(out[1]).all(), "the sequence with bad metadata is written as NaN"
    assert_others_match(out, batch, 1)
    # The process keeps its CUDA context: the same call with good metadata still runs.
    assert_others_match(run(batch, True), batch, -1)


# Each prefill kernel at a head dim that compiles it (config.h; elsewhere the plan runs another);
# the warp-specialised one by TMA boxes (page 16) and by its gather.
PREFILL_KERNEL_HEAD_DIMS = [
    ("warp_specialized", 64),
    ("warp_specialized", 96),
    ("warp_specialized", 128),
    ("warp_specialized_gather", 64),
    ("warp_specialized_gather", 96),
    ("wgmma", 128),
    ("mma_sync", 128),
    ("persistent", 64),
    ("persistent", 128),
    ("persistent", 256),
    ("persistent_3_blocks_gather", 96),
    ("persistent_2_blocks_round_robin", 128),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kernel,head_dim", PREFILL_KERNEL_HEAD_DIMS)
def test_prefill_with_bad_metadata_poisons_only_its_sequence(case, kernel, head_dim, tuning):
    tuning(PREFILL_KERNEL_TUNINGS[kernel])
    g = torch.Generator(device="cuda").manual_seed(17)
    batch = PagedBatch(
        [700, 900, 2000], [50, 130, 64], 8, 2, head_dim, 16, torch.bfloat16, generator=g
    )
    table, lens = corrupt(batch, case)
    out = run(batch, False, table, lens)
    rows = out[token_rows(batch, 1)]
    if case == "last_page_negative":
        # Only the last rows see the last page (causal): they are NaN; each other row is NaN too
        # (its block of rows read the page) or the answer of the good metadata.
        q_len, length = batch.q_lens_list[1], int(lens[1])
        positions = torch.arange(length - q_len, length, device=out.device)
        sees = positions >= (length - 1) // batch.page_size * batch.page_size
        assert torch.isnan(rows[sees]).all()
        ref = reference(batch, batch.q, True, 1.0 / math.sqrt(batch.q.shape[-1]))
        ref_rows = ref[token_rows(batch, 1)]
        for i in torch.nonzero(~sees).flatten().tolist():
            if not torch.isnan(rows[i]).all():
                err = (rows[i].double() - ref_rows[i]).norm() / ref_rows[i].norm()
                assert err < TOLERANCE[batch.q.dtype], f"row {i}: relative L2 error {err:.3e}"
    else:
        assert torch.isnan(rows).all()
    assert_others_match(out, batch, 1)


def test_decode_padding_slot_of_length_zero_is_zeros():
    g = torch.Generator(device="cuda").manual_seed(19)
    batch = PagedBatch([700, 1, 2000], [1] * 3, 8, 2, 128, 16, torch.bfloat16, generator=g)
    lens = batch.seq_lens.clone()
    lens[1] = 0
    out = run(batch, True, seq_lens=lens)
    assert (out[1] == 0).all()
    assert_others_match(out, batch, 1)


@pytest.mark.parametrize("kernel,head_dim", PREFILL_KERNEL_HEAD_DIMS)
def test_prefill_with_a_broken_query_start_loc_stays_inside_its_tensors(kernel, head_dim, tuning):
    """A decreasing query_start_loc, one past the tokens, and more new tokens than max_query_len:
    the call completes (no access outside q and out: compute-sanitizer checks it), and the CUDA
    context survives."""
    tuning(PREFILL_KERNEL_TUNINGS[kernel])
    g = torch.Generator(device="cuda").manual_seed(23)
    batch = PagedBatch(
        [700, 900, 2000], [50, 130, 64], 8, 2, head_dim, 16, torch.bfloat16, generator=g
    )
    t = batch.num_tokens
    for starts in ([0, 50, 40, t], [0, 50, 180, t + 4000], [0, -5, 180, t]):
        qsl = torch.tensor(starts, dtype=torch.int32, device="cuda")
        run(batch, False, query_start_loc=qsl)
    run(batch, False, max_query_len=8)  # fewer than the sequences' new tokens
    assert_others_match(run(batch, False), batch, -1)


@pytest.fixture
def checked():
    ops.set_metadata_checks(True)
    yield
    ops.set_metadata_checks(False)


@pytest.mark.parametrize(
    "case,argument",
    [
        ("negative_page", "block_table"),
        ("page_past_the_pool", "block_table"),
        ("length_past_the_table", "seq_lens"),
        ("negative_length", "seq_lens"),
    ],
)
def test_checked_mode_names_the_bad_argument(case, argument, checked):
    g = torch.Generator(device="cuda").manual_seed(29)
    batch = PagedBatch([700, 900, 2000], [1] * 3, 8, 2, 128, 16, torch.bfloat16, generator=g)
    table, lens = corrupt(batch, case)
    q = batch.q
    with pytest.raises((RuntimeError, ValueError), match=argument):
        torch.ops.astr.attention(
            q,
            k_cache=batch.k_cache,
            v_cache=batch.v_cache,
            block_table=table,
            seq_lens=lens,
            mode="decode",
            is_causal=True,
            backend="cuda",
        )


def test_checked_mode_names_a_decreasing_query_start_loc(checked):
    g = torch.Generator(device="cuda").manual_seed(31)
    batch = PagedBatch([700, 900, 2000], [50, 130, 64], 8, 2, 128, 16, torch.bfloat16, generator=g)
    qsl = torch.tensor([0, 50, 40, batch.num_tokens], dtype=torch.int32, device="cuda")
    with pytest.raises((RuntimeError, ValueError), match="query_start_loc"):
        torch.ops.astr.attention(
            batch.q,
            k_cache=batch.k_cache,
            v_cache=batch.v_cache,
            block_table=batch.block_table,
            seq_lens=batch.seq_lens,
            query_start_loc=qsl,
            max_query_len=130,
            mode="prefill",
            is_causal=True,
            backend="cuda",
        )


def test_checked_mode_passes_good_metadata(checked):
    g = torch.Generator(device="cuda").manual_seed(37)
    batch = PagedBatch([700, 900], [1, 1], 8, 2, 128, 16, torch.bfloat16, generator=g)
    out = torch.ops.astr.attention(
        batch.q,
        k_cache=batch.k_cache,
        v_cache=batch.v_cache,
        block_table=batch.block_table,
        seq_lens=batch.seq_lens,
        mode="decode",
        is_causal=True,
        backend="cuda",
    )
    assert_others_match(out, batch, -1)
