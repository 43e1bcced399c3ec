"""The latent attention ops as ops, on the CPU: the schemas a client outside this repository
depends on, argument checks that name the argument (and leave the pools unchanged), bad metadata
(raised on the CPU; poisoned with NaN where no host check runs, as in compiled code), the
resolver and ``explain_mla``, ``append_mla`` (and its Autograd kernel), opcheck, torch.compile,
and ``PagedLatentCache``."""

from __future__ import annotations

import pytest
import torch

from astrai import PagedLatentCache, attn_backend, explain_mla, mla_attention
from astrai.extension import ops
from tests.mla_batch import LatentBatch
from tests.mla_reference import mla_reference, quantize_latent

ALL_CHECKS = (
    "test_schema",
    "test_autograd_registration",
    "test_faketensor",
    "test_aot_dispatch_dynamic",
)


def small_batch(decode=False, dtype=torch.float32, fp8=False):
    q_lens = (1, 1, 1) if decode else (4, 2, 3)
    return LatentBatch(
        (9, 13, 3), q_lens, heads=16, page_size=4, dtype=dtype, decode=decode, fp8=fp8, seed=3
    )


def call_of(batch) -> dict:
    """The op's arguments by name (torch.ops.astr.mla_attention(**call))."""
    names = (
        "q_nope",
        "q_rope",
        "ckv_cache",
        "krope_cache",
        "block_table",
        "seq_lens",
        "query_start_loc",
        "max_query_len",
        "mode",
        "scale",
    )
    call = dict(zip(names, batch.op_args()))
    if batch.ckv_scale is not None:
        call["ckv_scale"] = batch.ckv_scale
    return call


def with_(call, **changes):
    return {**call, **changes}


def int32(*values):
    return torch.tensor(values, dtype=torch.int32)


# -- the schemas -------------------------------------------------------------------------------


def test_the_schemas_are_the_issues():
    """Names, order and defaults as issue 50 states them (a client depends on them); the extras
    come after `backend`."""
    schema = str(torch.ops.astr.mla_attention.default._schema)
    assert schema.startswith(
        "astr::mla_attention(Tensor q_nope, Tensor q_rope, Tensor ckv_cache, Tensor krope_cache, "
        "Tensor block_table, Tensor seq_lens, Tensor query_start_loc, int max_query_len, "
        "str mode, float scale, bool is_causal=True, str? backend=None, "
    ), schema
    assert schema.endswith(") -> Tensor"), schema
    lse = str(torch.ops.astr.mla_attention.lse._schema)
    assert lse.endswith("*, bool return_lse) -> (Tensor, Tensor)"), lse
    append = str(torch.ops.astr.append_mla.default._schema)
    assert append.startswith(
        "astr::append_mla(Tensor ckv, Tensor krope, Tensor(a!) ckv_cache, "
        "Tensor(b!) krope_cache, Tensor slot_mapping"
    ), append


# -- argument checks ---------------------------------------------------------------------------


def _bad_cases():
    c = call_of(small_batch())
    d = call_of(small_batch(decode=True))
    return {
        "q_nope 4-D": (with_(c, q_nope=c["q_nope"][None]), "q_nope: expected a 3-D tensor"),
        "q_nope int": (with_(c, q_nope=c["q_nope"].int()), "q_nope: expected a floating-point"),
        "q_rope dtype": (with_(c, q_rope=c["q_rope"].double()), "q_rope: expected dtype Float"),
        "q_rope heads": (with_(c, q_rope=c["q_rope"][:, :8]), "q_rope: shape .* does not match"),
        "ckv_cache 4-D": (
            with_(c, ckv_cache=c["ckv_cache"][:, :, None]),
            "ckv_cache: expected a 3-D tensor",
        ),
        "ckv_cache dtype": (
            with_(c, ckv_cache=c["ckv_cache"].double()),
            "ckv_cache: expected dtype Float",
        ),
        "ckv_cache e5m2": (
            with_(c, ckv_cache=c["ckv_cache"].to(torch.float8_e5m2)),
            "ckv_cache: an FP8 latent cache holds float8_e4m3fn",
        ),
        "ckv_cache latent dim": (
            with_(c, ckv_cache=c["ckv_cache"][..., :256]),
            "ckv_cache: latent dim 256 does not match q_nope's 512",
        ),
        "krope_cache dtype": (
            with_(c, krope_cache=c["krope_cache"].bfloat16()),
            "krope_cache: expected dtype Float",
        ),
        "krope_cache pages": (
            with_(c, krope_cache=c["krope_cache"][:3]),
            "krope_cache: shape .* does not match ckv_cache's",
        ),
        "krope_cache rope dim": (
            with_(c, krope_cache=c["krope_cache"][..., :32]),
            "krope_cache: rope dim 32 does not match q_rope's 64",
        ),
        "ckv_scale on a 16-bit latent": (
            with_(c, ckv_scale=torch.ones(1)),
            "ckv_scale: only for an FP8 latent cache",
        ),
        "mode": (with_(c, mode="bogus"), "mode: expected 'prefill' or 'decode', got 'bogus'"),
        "scale nan": (with_(c, scale=float("nan")), "scale: expected a finite number"),
        "scale past float32": (with_(c, scale=1e39), "scale: expected a finite number"),
        "block_table int64": (
            with_(c, block_table=c["block_table"].long()),
            "block_table: expected dtype int32",
        ),
        "block_table rows": (with_(c, block_table=c["block_table"][:1]), "block_table: has 1 rows"),
        "seq_lens 2-D": (with_(c, seq_lens=c["seq_lens"][None]), "seq_lens: expected a 1-D"),
        "query_start_loc entries": (
            with_(c, query_start_loc=int32(0, 4, 9)),
            "query_start_loc: has 3 entries, expected batch",
        ),
        "query_start_loc not from 0": (
            with_(c, query_start_loc=int32(1, 4, 6, 9)),
            "query_start_loc: must start at 0",
        ),
        "query_start_loc last entry": (
            with_(c, query_start_loc=int32(0, 4, 6, 8)),
            "query_start_loc: last entry 8 must equal",
        ),
        "query_start_loc decreasing": (
            with_(c, query_start_loc=int32(0, 4, 2, 9), max_query_len=7),
            "query_start_loc: must be non-decreasing",
        ),
        "max_query_len missing": (with_(c, max_query_len=0), "max_query_len: required"),
        "max_query_len too small": (
            with_(c, max_query_len=3),
            "max_query_len: 3 is less than sequence 0's 4 new tokens",
        ),
        "block_table entry past the pool": (
            with_(c, block_table=c["block_table"].clone().index_fill_(1, torch.tensor([0]), 99)),
            r"block_table: entry \[0, 0\] = 99 is out of range",
        ),
        "seq_lens past the table": (
            with_(c, seq_lens=int32(9, 13, 30)),
            "seq_lens: sequence 2 has length 30 but its block_table",
        ),
        "seq_lens below the new tokens": (
            with_(c, seq_lens=int32(3, 13, 3)),
            "seq_lens: sequence 0 has length 3, fewer than its 4",
        ),
        "decode with T != B": (
            with_(d, q_nope=c["q_nope"], q_rope=c["q_rope"]),
            "q_nope: decode takes one token per sequence",
        ),
        "decode two tokens in one sequence": (
            with_(d, query_start_loc=int32(0, 2, 2, 3)),
            "query_start_loc: decode takes one token",
        ),
    }


BAD_CASES = _bad_cases()


@pytest.mark.parametrize("entry", ["mla_attention", "explain_mla"])
@pytest.mark.parametrize("case", list(BAD_CASES))
def test_a_bad_argument_is_named(case, entry):
    call, message = BAD_CASES[case]
    with pytest.raises((RuntimeError, ValueError), match=message):
        getattr(torch.ops.astr, entry)(**call)


def test_a_bad_fp8_scale_is_named():
    c = call_of(small_batch(dtype=torch.bfloat16, fp8=True))
    for bad in (torch.zeros(1), torch.tensor([float("nan")])):
        with pytest.raises(ValueError, match="ckv_scale: expected positive finite"):
            torch.ops.astr.mla_attention(**with_(c, ckv_scale=bad))
    with pytest.raises(ValueError, match=r"ckv_scale: expected a float32 tensor of shape \[1\]"):
        torch.ops.astr.mla_attention(**with_(c, ckv_scale=torch.ones(2)))


def test_bad_metadata_poisons_the_sequence_where_no_host_check_runs():
    """Compiled code runs no host check (it traces on fake tensors): a sequence whose metadata is
    out of range gets NaN rows, the others their values, as astr::attention's paged calls."""
    batch = small_batch()
    good = mla_attention(*batch.op_args())
    args = list(batch.op_args())
    args[4] = batch.block_table.clone()
    args[4][1, 0] = 99  # a page id outside the pool, in sequence 1's used pages
    compiled = torch.compile(lambda *a: mla_attention(*a), fullgraph=True, dynamic=False)
    out = compiled(*args)
    rows = torch.arange(batch.num_tokens)
    of_seq_1 = (rows >= 4) & (rows < 6)
    assert torch.isnan(out[of_seq_1]).all()
    torch.testing.assert_close(out[~of_seq_1], good[~of_seq_1])
    # A query_start_loc that does not run from 0 to T poisons every row.
    args = list(batch.op_args())
    args[6] = int32(0, 4, 6, 8)
    assert torch.isnan(compiled(*args)).all()


# -- the resolver ----------------------------------------------------------------------------


def test_explain_names_why_each_backend_cannot_run_a_cpu_call():
    decision = explain_mla(*small_batch().op_args())
    assert decision.backend == "torch_native"
    assert any("CUDA" in reason for reason in decision.rejected["cuda"]), decision
    assert decision.rejected["flash"] == [
        "latent attention (mla_attention) not supported by the flash backend"
    ]


def test_a_strict_choice_that_cannot_run_the_call_raises_with_every_reason():
    batch = small_batch()
    with pytest.raises(RuntimeError, match="Explicitly-set backend 'flash'.*latent attention"):
        mla_attention(*batch.op_args(), backend="flash")
    with attn_backend("cuda"):
        with pytest.raises(RuntimeError, match="Explicitly-set backend 'cuda'"):
            mla_attention(*batch.op_args())
        with pytest.raises(RuntimeError, match="Explicitly-set backend 'cuda'"):
            torch.ops.astr.mla_attention(*batch.op_args())  # the thread's context, in C++


def test_the_cuda_rules_name_the_latent_shapes_they_take():
    batch = LatentBatch(
        (5,),
        (1,),
        heads=16,
        page_size=4,
        dtype=torch.float32,
        decode=True,
        latent_dim=256,
        rope_dim=32,
    )
    reasons = explain_mla(*batch.op_args()).rejected["cuda"]
    assert "latent dim 256 and rope dim 32 not supported (supported: 512 and 64)" in reasons
    assert "dtype float32 not supported (supported: float16, bfloat16)" in reasons


def test_a_backend_written_in_python_is_refused_by_name():
    from astrai.extension import AttentionBackend

    class Mine(AttentionBackend):
        name = "mine"

        def forward(self, *args, **kwargs):
            raise AssertionError("never called")

    with pytest.raises(ValueError, match="Mine is written in Python: mla_attention runs only"):
        mla_attention(*small_batch().op_args(), backend=Mine())


# -- append_mla ------------------------------------------------------------------------------


def append_call(fp8=False, dtype=torch.bfloat16, tokens=3):
    g = torch.Generator().manual_seed(5)
    ckv = torch.randn(tokens, 512, generator=g).to(dtype)
    krope = torch.randn(tokens, 64, generator=g).to(dtype)
    pool_dtype = torch.float8_e4m3fn if fp8 else dtype
    return dict(
        ckv=ckv,
        krope=krope,
        ckv_cache=torch.zeros(4, 2, 512, dtype=pool_dtype),
        krope_cache=torch.zeros(4, 2, 64, dtype=dtype),
        slot_mapping=int32(5, 0, -1)[:tokens],
        ckv_scale=torch.tensor([0.01]) if fp8 else None,
    )


def test_append_mla_writes_the_slots_and_skips_negative_ones():
    a = append_call()
    torch.ops.astr.append_mla(**a)
    ckv, krope = a["ckv_cache"].view(8, 512), a["krope_cache"].view(8, 64)
    assert torch.equal(ckv[5], a["ckv"][0]) and torch.equal(ckv[0], a["ckv"][1])
    assert torch.equal(krope[5], a["krope"][0]) and torch.equal(krope[0], a["krope"][1])
    untouched = [1, 2, 3, 4, 6, 7]
    assert not ckv[untouched].any() and not krope[untouched].any()


def test_append_mla_quantizes_an_fp8_latent_with_its_scale():
    a = append_call(fp8=True)
    a["ckv"][0, :4] = torch.tensor([1e6, -1e6, float("nan"), 0.0])  # saturates; NaN stays
    torch.ops.astr.append_mla(**a)
    stored = a["ckv_cache"].view(8, 512)[[5, 0]]
    expected = quantize_latent(a["ckv"][:2], a["ckv_scale"])
    assert torch.equal(stored.view(torch.uint8), expected.view(torch.uint8))
    assert stored[0, 0].float() == 448 and stored[0, 1].float() == -448
    assert torch.isnan(stored[0, 2].float())
    # The rotary keys stay 16-bit, copied.
    assert torch.equal(a["krope_cache"].view(8, 64)[5], a["krope"][0])


def _append_cases():
    a = append_call()
    f = append_call(fp8=True)
    return {
        "slot past the pool": (
            with_(a, slot_mapping=int32(5, 8, 0)),
            "slot_mapping: slot 8 is out of range for a pool of 8 slots",
        ),
        "slot twice": (with_(a, slot_mapping=int32(5, 5, 0)), "slot_mapping: slot 5 appears twice"),
        "slot_mapping int64": (
            with_(a, slot_mapping=a["slot_mapping"].long()),
            "slot_mapping: expected dtype int32",
        ),
        "ckv dtype": (with_(a, ckv=a["ckv"].float()), "ckv: dtype Float does not match"),
        "krope dtype": (with_(a, krope=a["krope"].half()), "krope: dtype Half does not match"),
        "ckv 3-D": (with_(a, ckv=a["ckv"][:, None]), "ckv: expected a 2-D tensor"),
        "ckv latent dim": (with_(a, ckv=a["ckv"][:, :256]), "ckv: shape .* does not match"),
        "krope tokens": (with_(a, krope=a["krope"][:2]), "krope: 2 tokens, ckv has 3"),
        "krope_cache pages": (
            with_(a, krope_cache=a["krope_cache"][:3]),
            "krope_cache: shape .* does not match ckv_cache's",
        ),
        "krope_cache FP8": (
            with_(a, krope_cache=a["krope_cache"].to(torch.float8_e4m3fn)),
            "krope_cache: the rotary keys stay in the model's dtype",
        ),
        "one pool for both": (
            with_(a, ckv=a["krope"], ckv_cache=a["krope_cache"], krope_cache=a["krope_cache"]),
            "krope_cache: the same memory as ckv_cache",
        ),
        "ckv_scale on a 16-bit pool": (
            with_(a, ckv_scale=torch.ones(1)),
            "ckv_scale: only for an FP8 latent cache",
        ),
        "FP8 without its scale": (
            with_(f, ckv_scale=None),
            "ckv_scale: an FP8 latent cache .* needs its float32",
        ),
        "FP8 scale shape": (
            with_(f, ckv_scale=torch.ones(2)),
            r"ckv_scale: expected a float32 tensor of shape \[1\]",
        ),
        "FP8 scale zero": (
            with_(f, ckv_scale=torch.zeros(1)),
            "ckv_scale: expected positive finite",
        ),
    }


APPEND_CASES = _append_cases()


@pytest.mark.parametrize("case", list(APPEND_CASES))
def test_a_bad_append_is_named_and_writes_nothing(case):
    call, message = APPEND_CASES[case]
    before = [call["ckv_cache"].clone(), call["krope_cache"].clone()]
    with pytest.raises((RuntimeError, ValueError), match=message):
        torch.ops.astr.append_mla(**call)
    assert torch.equal(call["ckv_cache"].view(torch.uint8), before[0].view(torch.uint8))
    assert torch.equal(call["krope_cache"], before[1])


def test_append_mla_stores_values_below_autograd():
    """Latents that require grad (a model outside no_grad) are stored as values; the pools never
    join a graph; their version counters count the write."""
    a = append_call(dtype=torch.float32)
    a["ckv"].requires_grad_()
    a["krope"].requires_grad_()
    versions = a["ckv_cache"]._version, a["krope_cache"]._version
    torch.ops.astr.append_mla(**a)
    assert a["ckv_cache"].grad_fn is None and not a["ckv_cache"].requires_grad
    assert a["krope_cache"].grad_fn is None
    assert a["ckv_cache"]._version > versions[0] and a["krope_cache"]._version > versions[1]
    pool = a["ckv_cache"].requires_grad_()
    with pytest.raises(RuntimeError, match="ckv_cache: a pool that requires grad"):
        torch.ops.astr.append_mla(**a)
    assert pool.grad_fn is None


# -- opcheck and compile -----------------------------------------------------------------------


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_mla_attention_passes_opcheck(decode):
    """Every check but AOTAutograd's (the CPU call reads its metadata's values, as astr::attention's
    paged calls do; test_mla_attention_aot_dispatch runs that one)."""
    batch = small_batch(decode=decode)
    torch.library.opcheck(
        torch.ops.astr.mla_attention.default, batch.op_args(), test_utils=ALL_CHECKS[:3]
    )
    torch.library.opcheck(
        torch.ops.astr.mla_attention.lse,
        batch.op_args(),
        {"return_lse": True},
        test_utils=ALL_CHECKS[:3],
    )


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_mla_attention_aot_dispatch(decode):
    batch = small_batch(decode=decode)
    torch.library.opcheck(
        torch.ops.astr.mla_attention.default,
        batch.op_args(),
        test_utils=("test_aot_dispatch_dynamic",),
    )


def test_mla_attention_with_queries_that_require_grad_passes_opcheck():
    batch = small_batch()
    args = list(batch.op_args())
    args[0] = args[0].clone().requires_grad_()
    args[1] = args[1].clone().requires_grad_()
    torch.library.opcheck(
        torch.ops.astr.mla_attention.default, tuple(args), test_utils=ALL_CHECKS[:3]
    )


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_append_mla_passes_opcheck(fp8):
    """FP8: every check but test_schema, whose comparison of the pools before and after (a
    multiplication) torch does not implement for float8_e4m3fn; the bf16 sample runs it."""
    a = append_call(fp8=fp8)
    args = (
        a["ckv"],
        a["krope"],
        a["ckv_cache"],
        a["krope_cache"],
        a["slot_mapping"],
        a["ckv_scale"],
    )
    checks = ALL_CHECKS[1:] if fp8 else ALL_CHECKS
    torch.library.opcheck(torch.ops.astr.append_mla.default, args, test_utils=checks)


def test_a_decode_step_compiles_fullgraph_and_matches_eager():
    cache = PagedLatentCache(1, num_pages=16, page_size=4, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    cache.begin_step([0, 1], [6, 3])
    cache.append(0, torch.randn(9, 512, generator=g), torch.randn(9, 64, generator=g))
    step = cache.begin_step([0, 1], [1, 1], block_table_width=4)
    cache.append(0, torch.randn(2, 512, generator=g), torch.randn(2, 64, generator=g))
    q_nope, q_rope = torch.randn(2, 16, 512, generator=g), torch.randn(2, 16, 64, generator=g)

    def step_fn(q_nope, q_rope, ckv, krope, table, lens, starts):
        return mla_attention(q_nope, q_rope, ckv, krope, table, lens, starts, 1, "decode", 0.04)

    args = (q_nope, q_rope, *cache.layer(0), step.block_table, step.seq_lens, step.query_start_loc)
    compiled = torch.compile(step_fn, fullgraph=True)
    torch.testing.assert_close(compiled(*args), step_fn(*args))


def test_compiled_calls_recompile_when_the_context_changes():
    batch = small_batch()
    counter = torch._dynamo.testing.CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: mla_attention(*a), backend=counter, fullgraph=True)
    compiled(*batch.op_args())
    compiled(*batch.op_args())
    assert counter.frame_count == 1
    with attn_backend("torch_native"):
        compiled(*batch.op_args())
    assert counter.frame_count == 2
    torch._dynamo.reset()


# -- PagedLatentCache --------------------------------------------------------------------------


def test_the_latent_cache_serves_a_prefill_then_decode_steps():
    g = torch.Generator().manual_seed(1)
    cache = PagedLatentCache(2, num_pages=12, page_size=4, dtype=torch.float32)
    for counts in ({0: 7, 1: 3}, {0: 1, 1: 1}, {1: 2}):
        step = cache.begin_step(list(counts), list(counts.values()))
        tokens = sum(counts.values())
        ckv, krope = torch.randn(tokens, 512, generator=g), torch.randn(tokens, 64, generator=g)
        cache.append(1, ckv, krope)
        q_nope = torch.randn(tokens, 16, 512, generator=g)
        q_rope = torch.randn(tokens, 16, 64, generator=g)
        out = cache.attention(1, q_nope, q_rope, 0.05)
        ref = mla_reference(
            q_nope,
            q_rope,
            *cache.layer(1),
            step.block_table,
            step.seq_lens,
            step.query_start_loc,
            scale=0.05,
        )
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    assert cache.seq_len(0) == 8 and cache.seq_len(1) == 6
    assert not cache.layer(0)[0].any(), "layer 0 was never written"
    cache.free(0)
    assert cache.free_pages == 12 - 2


def test_the_latent_cache_counts_its_bytes_per_token():
    assert PagedLatentCache(61, 1, 64).bytes_per_token() == 61 * (512 + 64) * 2
    fp8 = PagedLatentCache(61, 1, 64, latent_dtype=torch.float8_e4m3fn)
    assert fp8.bytes_per_token() == 61 * (512 + 64 * 2)


def test_an_fp8_latent_cache_quantizes_with_the_scale_it_takes_from_data():
    g = torch.Generator().manual_seed(2)
    cache = PagedLatentCache(
        1, num_pages=4, page_size=4, dtype=torch.bfloat16, latent_dtype=torch.float8_e4m3fn
    )
    step = cache.begin_step([0], [5])
    ckv = (torch.randn(5, 512, generator=g) * 30).bfloat16()
    krope = torch.randn(5, 64, generator=g).bfloat16()
    cache.scale_from(0, ckv)
    scale = cache.scale(0)
    assert torch.allclose(scale, ckv.float().abs().max().reshape(1) / 448)
    cache.append(0, ckv, krope)
    q_nope = torch.randn(5, 16, 512, generator=g).bfloat16()
    q_rope = torch.randn(5, 16, 64, generator=g).bfloat16()
    out = cache.attention(0, q_nope, q_rope, 0.04)
    ref = mla_reference(
        q_nope,
        q_rope,
        *cache.layer(0),
        step.block_table,
        step.seq_lens,
        step.query_start_loc,
        scale=0.04,
        ckv_scale=scale,
    )
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="scale: expected one positive finite value"):
        cache.set_scale(0, 0.0)


def test_the_latent_cache_refuses_what_it_cannot_hold():
    with pytest.raises(TypeError, match="latent_dtype: expected None"):
        PagedLatentCache(1, 4, 4, latent_dtype=torch.float8_e5m2)
    with pytest.raises(ValueError, match="page_size: 3 not supported"):
        PagedLatentCache(1, 4, 3)
    cache = PagedLatentCache(1, 4, 4, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="begin_step"):
        cache.append(0, torch.zeros(1, 512), torch.zeros(1, 64))
    cache.begin_step([0], [2])
    with pytest.raises(ValueError, match="ckv: 3 tokens"):
        cache.append(0, torch.zeros(3, 512), torch.zeros(3, 64))
    with pytest.raises(ValueError, match=r"krope: expected \[..., 64\]"):
        cache.append(0, torch.zeros(2, 512), torch.zeros(2, 32))


def test_the_ops_module_wraps_append_mla():
    a = append_call()
    ops.append_mla(a["ckv"], a["krope"], a["ckv_cache"], a["krope_cache"], a["slot_mapping"])
    assert torch.equal(a["ckv_cache"].view(8, 512)[5], a["ckv"][0])
