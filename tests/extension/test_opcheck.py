"""``torch.library.opcheck`` on every astr op that returns a tensor or mutates one.

opcheck runs four checks per sample:

- ``test_schema``: the op mutates exactly what its schema says (``append_kv``: both pools, ``a!``/
  ``b!``) and returns no alias of an input;
- ``test_autograd_registration``: an op whose inputs require grad has an autograd kernel. For
  ``astr::attention`` (CompositeImplicitAutograd) the check passes by construction: autograd
  flows through the ATen ops the composite calls. It is kept (it is cheap and would catch a
  move to an explicit CPU/CUDA kernel without an Autograd one);
- ``test_faketensor``: the op runs on FakeTensors (fake kernel for ``append_kv`` /
  ``cuda_paged_attention``; the composite itself for ``attention``) with the real output's
  metadata;
- ``test_aot_dispatch_dynamic``: AOTAutograd traces the op with dynamic shapes (forward and,
  where inputs require grad, backward) and matches eager. For ``attention`` this traces the C++
  composite (validation, resolver, backend) on FakeTensors.

``astr::explain`` / ``check_backend`` / ``selected_backend`` / ``build_info`` / the status and
override-stack ops return strings or nothing and take no part in a traced graph: not checked.
"""

from __future__ import annotations

import pytest
import torch

from astrai.extension import PagedKVCache

ALL_CHECKS = (
    "test_schema",
    "test_autograd_registration",
    "test_faketensor",
    "test_aot_dispatch_dynamic",
)
# Every check except AOTAutograd; used for the CPU paged samples, whose AOT check is run (and
# expected to fail) separately in test_paged_attention_aot_dispatch_on_cpu.
CHECKS_WITHOUT_AOT = ALL_CHECKS[:3]


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, g, dtype=torch.float32, device="cpu", requires_grad=False):
    t = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)
    return t.requires_grad_(requires_grad)


# -- samples ---------------------------------------------------------------------------------


def dense_sample(
    *,
    batch=2,
    q_len=5,
    kv_len=7,
    q_heads=4,
    kv_heads=2,
    head_dim=16,
    dtype=torch.float32,
    device="cpu",
    mask=None,
    is_causal=False,
    requires_grad=False,
    topk=None,
    seed=0,
):
    """(args, kwargs) of one dense astr::attention call; q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D];
    with ``topk``, topk_indices [B, Lq, topk] (distinct key positions)."""
    g = generator(seed)
    q = randn(
        batch,
        q_len,
        q_heads,
        head_dim,
        g=g,
        dtype=dtype,
        device=device,
        requires_grad=requires_grad,
    )
    k = randn(
        batch,
        kv_len,
        kv_heads,
        head_dim,
        g=g,
        dtype=dtype,
        device=device,
        requires_grad=requires_grad,
    )
    v = randn(
        batch,
        kv_len,
        kv_heads,
        head_dim,
        g=g,
        dtype=dtype,
        device=device,
        requires_grad=requires_grad,
    )
    attn_mask = None
    if mask == "bool":  # [Lq, Lk], broadcast over batch and heads; keep the diagonal visible
        attn_mask = torch.rand(q_len, kv_len, generator=g) > 0.4
        attn_mask |= torch.eye(q_len, kv_len, dtype=torch.bool)
        attn_mask = attn_mask.to(device)
    elif mask == "additive":  # [B, 1, Lq, Lk]
        attn_mask = randn(batch, 1, q_len, kv_len, g=g, dtype=dtype, device=device)
    kwargs = dict(attn_mask=attn_mask, is_causal=is_causal)
    if topk is not None:
        picks = [torch.randperm(kv_len, generator=g)[:topk] for _ in range(batch * q_len)]
        kwargs["topk_indices"] = (
            torch.stack(picks).view(batch, q_len, topk).to(device=device, dtype=torch.int32)
        )
    return (q, k, v), kwargs


DENSE_SAMPLES = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "bool-mask": dict(mask="bool"),
    "additive-mask-causal": dict(mask="additive", is_causal=True),
    "mha": dict(q_heads=2, kv_heads=2),
    "gqa4": dict(q_heads=8, kv_heads=2),
    "mqa": dict(q_heads=4, kv_heads=1, is_causal=True),
    "grad-f32": dict(requires_grad=True, is_causal=True),
    "grad-f64-gqa-mask": dict(requires_grad=True, dtype=torch.float64, mask="bool"),
    "grad-topk-causal": dict(requires_grad=True, is_causal=True, topk=3),
}


def build_cache(
    *, num_pages=8, page_size=4, kv_heads=2, head_dim=16, dtype=torch.float32, device="cpu"
):
    return PagedKVCache(1, num_pages, page_size, kv_heads, head_dim, dtype=dtype, device=device)


def paged_step(cache, new_tokens, *, q_heads=4, g, block_table_width=None):
    """begin_step, append the new tokens' k/v to layer 0, return (q [T, Hq, D], step)."""
    step = cache.begin_step(
        list(new_tokens), list(new_tokens.values()), block_table_width=block_table_width
    )
    tokens = sum(new_tokens.values())
    shape = (tokens, cache.num_kv_heads, cache.head_dim)
    k = randn(*shape, g=g, dtype=cache.dtype, device=cache.device)
    v = randn(*shape, g=g, dtype=cache.dtype, device=cache.device)
    cache.append(0, k, v)
    q = randn(tokens, q_heads, cache.head_dim, g=g, dtype=cache.dtype, device=cache.device)
    return q, step


def attention_paged_args(
    q, cache, step, *, is_causal=True, attn_mask=None, topk_indices=None, tree_mask=None
):
    """(args, kwargs) of a paged astr::attention call over layer 0 of ``cache``."""
    k_pool, v_pool = cache.layer(0)
    kwargs = dict(
        attn_mask=attn_mask,
        is_causal=is_causal,
        k_cache=k_pool,
        v_cache=v_pool,
        block_table=step.block_table,
        seq_lens=step.seq_lens,
        query_start_loc=step.query_start_loc,
        max_query_len=step.max_query_len,
        mode=step.mode,
    )
    if topk_indices is not None:
        kwargs["topk_indices"] = topk_indices
    if tree_mask is not None:
        kwargs["tree_mask"] = tree_mask
    return (q, None, None), kwargs


def topk_rows(step, topk, g):
    """int32 [T, topk]: for each new token, positions within its sequence (-1 where the
    sequence is shorter than topk)."""
    lengths = step.seq_lens.tolist()
    counts = (step.query_start_loc[1:] - step.query_start_loc[:-1]).tolist()
    rows = []
    for length, count in zip(lengths, counts):
        for _ in range(count):
            row = torch.randperm(length, generator=g)[:topk].tolist()
            rows.append(row + [-1] * (topk - len(row)))
    return torch.tensor(rows, dtype=torch.int32, device=step.seq_lens.device)


def paged_samples(
    *, dtype=torch.float32, device="cpu", head_dim=16, page_size=4, q_heads=4, kv_heads=2, seed=1
):
    """Samples over one cache: a ragged causal prefill, a chunked prefill onto cached tokens
    with a boolean mask, a verify of trees of drafts, and decode steps (causal and not)."""
    g = generator(seed)
    cache = build_cache(
        page_size=page_size,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device=device,
        num_pages=16,
    )
    samples = {}
    q, step = paged_step(cache, {0: 5, 1: 3}, q_heads=q_heads, g=g)
    samples["prefill"] = attention_paged_args(q, cache, step)
    q, step = paged_step(cache, {0: 2, 1: 4, 2: 3}, q_heads=q_heads, g=g)
    capacity = step.block_table.shape[1] * page_size
    mask = (torch.rand(q.shape[0], capacity, generator=g) > 0.3).to(device)
    samples["prefill-chunk-mask"] = attention_paged_args(q, cache, step, attn_mask=mask)
    samples["prefill-chunk-topk"] = attention_paged_args(
        q, cache, step, topk_indices=topk_rows(step, 4, g)
    )
    q, step = paged_step(cache, {0: 3, 1: 4}, q_heads=q_heads, g=g)
    tree = torch.tensor(
        [
            [1, 0, 0, 0],
            [1, 1, 0, 0],
            [1, 0, 1, 0],
            [1, 0, 0, 0],
            [0, 1, 0, 0],
            [1, 1, 1, 0],
            [0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    samples["verify-tree"] = attention_paged_args(q, cache, step, tree_mask=tree.to(device))
    q, step = paged_step(cache, {0: 1, 1: 1, 2: 1}, q_heads=q_heads, g=g)
    samples["decode"] = attention_paged_args(q, cache, step)
    samples["decode-topk"] = attention_paged_args(
        q, cache, step, topk_indices=topk_rows(step, 3, g)
    )
    q, step = paged_step(cache, {2: 1, 0: 1}, q_heads=q_heads, g=g)
    samples["decode-noncausal"] = attention_paged_args(q, cache, step, is_causal=False)
    return samples


def append_kv_sample(*, dtype=torch.float32, device="cpu", skip_one=False, seed=2):
    """(args,) of astr::append_kv: the k/v of a ragged step and its slot mapping."""
    g = generator(seed)
    cache = build_cache(dtype=dtype, device=device)
    cache.begin_step([0, 1], [5, 2])
    k = randn(7, cache.num_kv_heads, cache.head_dim, g=g, dtype=dtype, device=device)
    v = randn(7, cache.num_kv_heads, cache.head_dim, g=g, dtype=dtype, device=device)
    slots = cache.step.slot_mapping.clone()
    if skip_one:
        slots[3] = -1  # a negative slot skips the token
    k_pool, v_pool = cache.layer(0)
    return (k, v, k_pool, v_pool, slots)


# -- CPU -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(DENSE_SAMPLES))
def test_dense_attention_passes_opcheck(name):
    args, kwargs = dense_sample(**DENSE_SAMPLES[name])
    torch.library.opcheck(torch.ops.astr.attention.default, args, kwargs, test_utils=ALL_CHECKS)


@pytest.mark.parametrize(
    "name",
    [
        "prefill",
        "prefill-chunk-mask",
        "prefill-chunk-topk",
        "verify-tree",
        "decode",
        "decode-topk",
        "decode-noncausal",
    ],
)
def test_paged_attention_passes_opcheck_on_cpu(name):
    args, kwargs = paged_samples()[name]
    torch.library.opcheck(
        torch.ops.astr.attention.default, args, kwargs, test_utils=CHECKS_WITHOUT_AOT
    )


@pytest.mark.parametrize(
    "name", ["prefill", "verify-tree", "decode", "prefill-chunk-topk", "decode-topk"]
)
def test_paged_attention_aot_dispatch_on_cpu(name):
    args, kwargs = paged_samples()[name]
    torch.library.opcheck(
        torch.ops.astr.attention.default, args, kwargs, test_utils=("test_aot_dispatch_dynamic",)
    )


@pytest.mark.parametrize("skip_one", [False, True], ids=["all-slots", "negative-slot"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_append_kv_passes_opcheck(dtype, skip_one):
    args = append_kv_sample(dtype=dtype, skip_one=skip_one)
    torch.library.opcheck(torch.ops.astr.append_kv.default, args, test_utils=ALL_CHECKS)


def test_append_kv_writes_only_the_pools():
    """What test_schema relies on: the pools change, k/v/slot_mapping do not."""
    k, v, k_pool, v_pool, slots = append_kv_sample()
    before = [t.clone() for t in (k, v, slots)]
    torch.ops.astr.append_kv(k, v, k_pool, v_pool, slots)
    for old, new in zip(before, (k, v, slots)):
        assert torch.equal(old, new)
    flat = k_pool.view(-1, *k_pool.shape[2:])
    assert torch.equal(flat[slots.long()], k)


# -- CUDA ------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(DENSE_SAMPLES))
def test_dense_attention_passes_opcheck_on_cuda(name):
    args, kwargs = dense_sample(device="cuda", **DENSE_SAMPLES[name])
    torch.library.opcheck(torch.ops.astr.attention.default, args, kwargs, test_utils=ALL_CHECKS)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "name", ["prefill", "prefill-chunk-mask", "verify-tree", "decode", "decode-noncausal"]
)
@pytest.mark.parametrize(
    "dtype, head_dim",
    [(torch.float32, 16), (torch.bfloat16, 64), (torch.bfloat16, 128)],
    ids=["f32-d16-torch_native", "bf16-d64-cuda", "bf16-d128-cuda"],
)
def test_paged_attention_passes_opcheck_on_cuda(name, dtype, head_dim):
    """On CUDA the composite skips the host-side metadata checks, so every check applies,
    AOTAutograd included. bf16 with head_dim 64/128 resolves to the cuda backend."""
    args, kwargs = paged_samples(dtype=dtype, device="cuda", head_dim=head_dim)[name]
    torch.library.opcheck(torch.ops.astr.attention.default, args, kwargs, test_utils=ALL_CHECKS)


@pytest.mark.cuda
@pytest.mark.parametrize("skip_one", [False, True], ids=["all-slots", "negative-slot"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_append_kv_passes_opcheck_on_cuda(dtype, skip_one):
    args = append_kv_sample(dtype=dtype, device="cuda", skip_one=skip_one)
    torch.library.opcheck(torch.ops.astr.append_kv.default, args, test_utils=ALL_CHECKS)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "name", ["prefill", "prefill-chunk-mask", "verify-tree", "decode", "decode-noncausal"]
)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cuda_paged_attention_passes_opcheck(name, head_dim):
    """The cuda backend's op itself (CUDA kernel + Python fake), bf16."""
    args, kwargs = paged_samples(dtype=torch.bfloat16, device="cuda", head_dim=head_dim)[name]
    q = args[0]
    step_kwargs = {name: value for name, value in kwargs.items() if name not in ("k", "v")}
    step_kwargs["scale"] = head_dim**-0.5
    torch.library.opcheck(
        torch.ops.astr.cuda_paged_attention.default, (q,), step_kwargs, test_utils=ALL_CHECKS
    )
