"""GPU tests: a prefill whose query_start_loc does not run from 0 to T without decreasing, or
whose sequence holds more tokens than max_query_len, gives NaN rows and never finite wrong numbers
(issue 47, defect 6; csrc/kernels/paged_attention/query_rows.cuh: poison_unplaced_rows_kernel).
The cuda kernels in unchecked mode used to leave the rows that no sequence covers unwritten
(whatever the allocator held: finite garbage), and to place the other sequences as if the
metadata were fine.

The memory the output will take is filled with a finite value first, so that an unwritten row
shows as finite.
"""

import math

import pytest
import torch

from tests.kernels.conftest import PREFILL_KERNEL_TUNINGS, cuda_op
from tests.kernels.test_cuda_kernels import PagedBatch

# Skipped where no GPU is visible (tests/conftest.py).
pytestmark = pytest.mark.cuda

SEQ_LENS, Q_LENS = [300, 200, 150], [40, 24, 30]  # T = 94


def fill_next_allocation(shape, dtype, value=1234.0):
    """The caching allocator hands this block to the op's output next: unwritten rows stay
    finite."""
    block = torch.full(shape, value, dtype=dtype, device="cuda")
    del block


def run(batch, query_start_loc, max_query_len, return_lse=False):
    q = batch.q
    fill_next_allocation(q.shape, q.dtype)
    out, lse = cuda_op(
        q,
        batch.k_cache,
        batch.v_cache,
        batch.block_table,
        batch.seq_lens,
        query_start_loc,
        max_query_len,
        False,
        None,
        True,
        1.0 / math.sqrt(q.shape[-1]),
        return_lse=return_lse,
    )
    torch.cuda.synchronize()
    return out, lse


def starts(*values):
    return torch.tensor(values, dtype=torch.int32, device="cuda")


T = sum(Q_LENS)
CASES = {  # (query_start_loc, max_query_len)
    "first entry 1": ((1, 40, 64, T), 40),
    "first entry -3": ((-3, 40, 64, T), 43),
    "last entry T - 5": ((0, 40, 64, T - 5), 40),
    "last entry T + 7": ((0, 40, 64, T + 7), 40),
    "decreasing": ((0, 50, 40, T), 54),  # tokens 40..49 in two sequences
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kernel", list(PREFILL_KERNEL_TUNINGS))
def test_query_start_loc_not_from_0_to_t_gives_every_row_nan(case, kernel, tuning):
    tuning(PREFILL_KERNEL_TUNINGS[kernel])
    g = torch.Generator(device="cuda").manual_seed(21)
    batch = PagedBatch(SEQ_LENS, Q_LENS, 8, 2, 128, 16, torch.bfloat16, generator=g)
    query_start_loc, max_query_len = CASES[case]
    out, lse = run(batch, starts(*query_start_loc), max_query_len, return_lse=True)
    assert torch.isnan(out).all(), f"{(~torch.isnan(out)).any(-1).any(-1).sum()} rows not NaN"
    assert torch.isnan(lse).all()


@pytest.mark.parametrize("kernel", list(PREFILL_KERNEL_TUNINGS))
def test_a_sequence_longer_than_max_query_len_is_nan_past_the_grid_too(kernel, tuning):
    """The grid covers max_query_len rows of each sequence: the rows past them were never
    written."""
    tuning(PREFILL_KERNEL_TUNINGS[kernel])
    g = torch.Generator(device="cuda").manual_seed(22)
    batch = PagedBatch(SEQ_LENS, Q_LENS, 8, 2, 128, 16, torch.bfloat16, generator=g)
    out, _ = run(batch, batch.query_start_loc, 30)  # sequence 0 has 40 new tokens
    assert torch.isnan(out[:40]).all()
    assert not torch.isnan(out[40:]).any()  # the others fit: computed as usual


@pytest.mark.parametrize("kernel", list(PREFILL_KERNEL_TUNINGS))
def test_control_good_query_start_loc_gives_no_nan(kernel, tuning):
    tuning(PREFILL_KERNEL_TUNINGS[kernel])
    g = torch.Generator(device="cuda").manual_seed(23)
    batch = PagedBatch(SEQ_LENS, Q_LENS, 8, 2, 128, 16, torch.bfloat16, generator=g)
    out, lse = run(batch, batch.query_start_loc, max(Q_LENS), return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
