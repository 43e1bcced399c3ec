"""The inputs every peer reads: the shuffled paged pool, and FlashInfer's form of its table."""

import pytest
import torch
from harness import build_paged_cache, query_start_loc
from peers import AttentionProblem, flashinfer_page_index


def read_back(cache: dict, lengths, page_size: int, which: str) -> torch.Tensor:
    """Every sequence's tokens, read through the block table."""
    parts = []
    for b, length in enumerate(lengths):
        pos = torch.arange(length)
        pages = cache["block_table"][b, pos // page_size].long()
        parts.append(cache[which][pages, pos % page_size])
    return torch.cat(parts)


@pytest.mark.parametrize("lengths", [[48, 48, 48], [5, 33, 16, 1]])
@pytest.mark.parametrize("page_size", [1, 16])
def test_tokens_read_back_through_the_block_table(lengths, page_size):
    torch.manual_seed(0)
    k_tokens = torch.randn(sum(lengths), 2, 4)
    v_tokens = torch.randn(sum(lengths), 2, 4)
    cache = build_paged_cache(k_tokens, v_tokens, lengths, page_size)
    assert cache["block_table"].dtype == torch.int32
    assert cache["k_cache"].shape[1:] == (page_size, 2, 4)
    assert torch.equal(read_back(cache, lengths, page_size, "k_cache"), k_tokens)
    assert torch.equal(read_back(cache, lengths, page_size, "v_cache"), v_tokens)
    assert torch.equal(cache["seq_lens"], torch.tensor(lengths, dtype=torch.int32))
    used = set()
    for b, length in enumerate(lengths):
        used |= set(cache["block_table"][b, : -(-length // page_size)].tolist())
    assert len(used) == cache["k_cache"].shape[0]  # the pool holds exactly the pages needed


def test_pages_are_handed_out_in_a_random_order():
    torch.manual_seed(0)
    tokens = torch.randn(64 * 16, 1, 4)
    cache = build_paged_cache(tokens, tokens, [64 * 16], 16)
    table = cache["block_table"][0]
    assert sorted(table.tolist()) == list(range(64))
    assert table.tolist() != list(range(64))


def test_query_start_loc_is_the_prefix_sum_of_new_tokens():
    assert torch.equal(query_start_loc([3, 1, 2], "cpu"), torch.tensor([0, 3, 4, 6]).int())


def test_flashinfer_page_index_lists_each_sequences_pages_in_order():
    page_size, lengths = 16, [5, 33, 16, 1]
    torch.manual_seed(1)
    tokens = torch.randn(sum(lengths), 1, 4)
    cache = build_paged_cache(tokens, tokens, lengths, page_size)
    indptr, indices, last = flashinfer_page_index(cache["block_table"], lengths, page_size)
    assert indptr.tolist() == [0, 1, 4, 5, 6]
    assert last.tolist() == [5, 1, 16, 1]
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32
    # Reading the pool in FlashInfer's form gives back every sequence's tokens.
    for b, length in enumerate(lengths):
        pages = indices[indptr[b] : indptr[b + 1]].long()
        rows = cache["k_cache"][pages].reshape(-1, 1, 4)[:length]
        start = sum(lengths[:b])
        assert torch.equal(rows, tokens[start : start + length])


def test_a_problem_shares_one_pool_per_page_size():
    torch.manual_seed(0)
    batch, hq, hkv, length, head_dim = 2, 4, 2, 40, 8
    q = torch.randn(batch, hq, head_dim)
    k = torch.randn(batch, hkv, length, head_dim)
    v = torch.randn_like(k)
    problem = AttentionProblem(
        "decode", q, [length] * batch, [1] * batch, False, dense=(q[:, :, None], k, v)
    )
    first = problem.paged(16)
    assert problem.paged(16) is first
    other = problem.paged(1)
    assert other is not first and other["k_cache"].shape[1] == 1
    # The pool holds the dense values: sequence b, position p, head h.
    assert torch.equal(read_back(other, [length] * batch, 1, "k_cache")[length + 3], k[1, :, 3])
    assert other["query_start_loc"].tolist() == [0, 1, 2]
