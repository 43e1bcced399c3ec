"""The peers of the attention benchmark: what each one runs, over which form of the inputs.

A peer is a name and a factory. The factory takes an AttentionProblem (one call's inputs in every
form a peer reads) and returns the callable to time; it raises when the peer cannot run the call
(not installed, refused by the resolver, a shape it does not take), and the driver records that
as the row's error. `view` turns the peer's output into the reference's [T, Hq, D].

  astrai (torch.ops.astr.attention, the resolver included, over a shuffled paged pool):
    cuda_ps16, cuda_ps1     backend="cuda", page size 16 / 1
    cuda_ps16_fp8           the same over FlashInfer's FP8 peers' e4m3 copy of the pool and
                            scales (decode; not in the default selection)
    cuda_ps16_persistent    cuda_ps16 under the kernel tuning prefill_kernel=persistent (the
                            persistent prefill, opt-in until measured: prefill only; not in the
                            default selection, name it with --peers)
    torch_native            backend="torch_native", page size 16
    astrai_flash            backend="flash" (the flash-attn package: FlashAttention-4/3/2,
                            whichever imports), page size 256 (FlashAttention-2's paged KV needs
                            pages of a multiple of 256 tokens)
  another build of astrai (A/B in one process; bench_attention.py --baseline-lib):
    cuda_ps16_before, cuda_ps1_before, torch_native_before
                            the same call through torch.ops.<namespace>.attention of the library
                            loaded from --baseline-lib, over the same pool as its partner
  FlashInfer (when `import flashinfer` works), over the same [pages, page_size, Hkv, D] pool:
    flashinfer_decode       BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True), decode
    flashinfer_fa3, flashinfer_fa2
                            BatchPrefillWithPagedKVCacheWrapper(backend="fa3"/"fa2"), prefill
    flashinfer_decode_fp8, flashinfer_fa3_fp8
                            the same over an FP8 (e4m3) copy of the pool with one scale per pool
                            (k_scale, v_scale); not in the default selection
  torch SDPA over the same values as contiguous [B, H, L, D] tensors (GQA through enable_gqa):
    sdpa_flash, sdpa_efficient, sdpa_cudnn, sdpa_math
                            F.scaled_dot_product_attention under sdpa_kernel([that backend])
    sdpa_default            F.scaled_dot_product_attention, torch's own choice
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from harness import (
    VERIFY_TOLERANCE,
    build_paged_cache,
    decode_bytes,
    free_cached,
    query_start_loc,
)
from harness import under_tuning as call_under_tuning

FP8_TOLERANCE = 1e-1  # e4m3 keeps 3 mantissa bits: ~4% rounding per element before any math
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
MATH_PREFILL_MAX_S = 4096  # the math backend materializes S x S scores: only short prefills
# torch_native hands SDPA a bool mask; with GQA no fused SDPA kernel takes that (efficient refuses
# GQA, flash refuses masks), so it lands on math, which materializes B*Hq*max_q*capacity scores
# (several times over: scores, softmax). Above this many bytes of bf16 scores the row is skipped
# (B=1 S=16384 would need ~17 GB per copy; the run must stay under 60 GB).
TORCH_NATIVE_GQA_SCORES_LIMIT = 8e9
FLASHINFER_WORKSPACE_BYTES = 256 << 20


# --------------------------------------------------------------------------------------------
# The inputs of one call, in every form a peer reads
# --------------------------------------------------------------------------------------------
@dataclass
class AttentionProblem:
    """One decode or causal prefill call. Every peer reads the same values; the paged pool of a
    page size is built on first use and shared by the peers of that page size (one pool at a time,
    to bound memory)."""

    kind: str  # "decode" or "prefill"
    q_tokens: torch.Tensor  # [T, Hq, D], the new tokens of all sequences in order
    kv_lens: List[int]  # cached tokens of each sequence after this step (what it attends to)
    q_lens: List[int]  # new tokens of each sequence (1 for decode)
    is_causal: bool
    # Uniform lengths: q [B, Hq, Lq, D], k/v [B, Hkv, L, D] contiguous (what SDPA reads).
    dense: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
    # Ragged lengths: per sequence q [1, Hq, c, D], k/v [1, Hkv, L, D], bool mask [c, L].
    per_sequence: Optional[List[tuple]] = None
    # [sum(kv_lens), Hkv, D] each; None when they are derived from `dense` on demand.
    k_tokens: Optional[torch.Tensor] = None
    v_tokens: Optional[torch.Tensor] = None
    _pool: Optional[dict] = field(default=None, repr=False)
    _pool_page_size: int = 0

    @property
    def device(self) -> torch.device:
        return self.q_tokens.device

    @property
    def num_q_heads(self) -> int:
        return self.q_tokens.shape[1]

    @property
    def head_dim(self) -> int:
        return self.q_tokens.shape[2]

    @property
    def num_kv_heads(self) -> int:
        if self.k_tokens is not None:
            return self.k_tokens.shape[1]
        if self.dense is not None:
            return self.dense[1].shape[1]
        return self.per_sequence[0][1].shape[1]

    def kv_tokens(self) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.k_tokens is not None:
            return self.k_tokens, self.v_tokens
        _, k, v = self.dense  # [B, Hkv, L, D] -> [B * L, Hkv, D]
        batch, hkv, length, head_dim = k.shape
        return tuple(x.transpose(1, 2).reshape(batch * length, hkv, head_dim) for x in (k, v))

    def paged(self, page_size: int) -> dict:
        """The paged-op keyword arguments over a pool of this page size whose pages were handed
        out in a random order: k_cache, v_cache [P, page_size, Hkv, D], block_table, seq_lens,
        query_start_loc."""
        if self._pool_page_size != page_size:
            self.release_pool()
            k_tokens, v_tokens = self.kv_tokens()
            pool = build_paged_cache(k_tokens, v_tokens, self.kv_lens, page_size)
            del k_tokens, v_tokens
            pool["query_start_loc"] = query_start_loc(self.q_lens, self.device)
            self._pool, self._pool_page_size = pool, page_size
        return self._pool

    def release_pool(self) -> None:
        self._pool, self._pool_page_size = None, 0
        free_cached(self.device)

    def release_tokens(self) -> None:
        """Drops the token-major K/V once every paged peer has run (the dense copies stay)."""
        self.release_pool()
        if self.dense is not None or self.per_sequence is not None:
            self.k_tokens = self.v_tokens = None
            free_cached(self.device)


def as_tokens(problem: AttentionProblem, out: torch.Tensor) -> torch.Tensor:
    """An output already [T, Hq, D] (astrai, FlashInfer)."""
    return out


# --------------------------------------------------------------------------------------------
# The peers
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Peer:
    name: str
    kinds: Tuple[str, ...]  # which rows it takes part in: "decode", "prefill"
    make: Callable[[AttentionProblem], Callable[[], object]]
    view: Callable[[AttentionProblem, object], torch.Tensor]
    family: str  # "astrai", "astrai_before", "flashinfer" or "sdpa"
    page_size: Optional[int] = None  # the paged pool it reads; None: the dense tensors
    tolerance: float = VERIFY_TOLERANCE
    kv_element_bytes: int = 2
    partner: Optional[str] = None  # for a baseline peer: the peer of this build it is set against
    skip: Callable[[AttentionProblem], Optional[str]] = lambda problem: None
    notes: Callable[[AttentionProblem], dict] = lambda problem: {}


def astrai_attention(
    backend: str,
    page_size: int,
    namespace: str = "astr",
    ask_resolver: bool = True,
    kv_dtype: Optional[torch.dtype] = None,
) -> Callable[[AttentionProblem], Callable]:
    """torch.ops.<namespace>.attention over the paged pool with backend=<backend>, the resolver
    included. With ask_resolver it first asks the library's explain op which backend it would
    use, so that a refusal or a silent fallback is reported instead of timed. kv_dtype FP8: over
    the FP8 copy of the pool that FlashInfer's FP8 peers read (its one scale per pool as every
    kv head's scale)."""

    def make(problem: AttentionProblem) -> Callable:
        ops = getattr(torch.ops, namespace)
        try:
            attention = ops.attention
        except (AttributeError, RuntimeError) as exc:
            raise RuntimeError(
                f"torch.ops.{namespace}.attention does not exist: no library registers the "
                f"namespace {namespace!r} (load one with --baseline-lib)"
            ) from exc
        kwargs = dict(problem.paged(page_size), backend=backend)
        if kv_dtype is not None and kv_dtype != problem.q_tokens.dtype:
            k_pool, v_pool, scales = flashinfer_kv(problem, page_size, kv_dtype)
            heads = problem.num_kv_heads
            kwargs.update(k_cache=k_pool, v_cache=v_pool)
            for name, value in scales.items():
                kwargs[name] = torch.full(
                    (heads,), value, dtype=torch.float32, device=problem.device
                )
        kwargs.update(max_query_len=max(problem.q_lens), mode=problem.kind)
        if problem.is_causal:
            kwargs["is_causal"] = True
        q = problem.q_tokens
        if ask_resolver:
            try:
                decision = json.loads(ops.explain(q, **kwargs))
            except Exception:  # explain is advisory; the call itself says what is wrong
                decision = None
            if decision is not None and decision.get("backend") != backend:
                raise RuntimeError(
                    f"resolver chose {decision.get('backend')!r} for backend={backend!r}: "
                    f"{decision.get('error') or decision.get('reasons')}"
                )
        return lambda: attention(q, None, None, **kwargs)

    return make


def under_tuning(make: Callable[[AttentionProblem], Callable], tuning: str):
    """The peer `make` builds, each call under the kernel tuning `tuning` (plan.h), the previous
    tuning restored after (a few microseconds of host time a call: prefill peers only)."""

    def make_tuned(problem: AttentionProblem) -> Callable:
        return call_under_tuning(tuning, make(problem))

    return make_tuned


def torch_native_skip(problem: AttentionProblem) -> Optional[str]:
    capacity = -(-max(problem.kv_lens) // 16) * 16
    scores = len(problem.kv_lens) * problem.num_q_heads * max(problem.q_lens) * capacity * 2
    gqa = problem.num_q_heads != problem.num_kv_heads
    if problem.kind == "prefill" and gqa and scores > TORCH_NATIVE_GQA_SCORES_LIMIT:
        return (
            f"masked GQA SDPA falls back to math, {scores / 1e9:.0f} GB of scores "
            f"(limit {TORCH_NATIVE_GQA_SCORES_LIMIT / 1e9:.0f} GB)"
        )
    return None


def sdpa(backend: Optional[str]) -> Callable[[AttentionProblem], Callable]:
    """F.scaled_dot_product_attention on the contiguous tensors, under sdpa_kernel([backend])
    (backend: an SDPBackend member name; None = torch's own choice). Ragged batches loop over
    the sequences with a bool lower-right causal mask; torch's own choice gets the
    causal_lower_right bias instead, which lets it pick a kernel that aligns causality to the
    bottom right."""

    def make(problem: AttentionProblem) -> Callable:
        gqa = problem.num_q_heads != problem.num_kv_heads
        if problem.dense is not None:
            q, k, v = problem.dense
            causal = problem.is_causal

            def call():
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

        elif backend is None:
            from torch.nn.attention.bias import causal_lower_right

            seqs = [
                (qs, ks, vs, causal_lower_right(qs.shape[2], ks.shape[2]))
                for qs, ks, vs, _ in problem.per_sequence
            ]

            def call():
                return [
                    F.scaled_dot_product_attention(qs, ks, vs, attn_mask=bias, enable_gqa=gqa)
                    for qs, ks, vs, bias in seqs
                ]

        else:
            seqs = problem.per_sequence

            def call():
                return [
                    F.scaled_dot_product_attention(qs, ks, vs, attn_mask=m, enable_gqa=gqa)
                    for qs, ks, vs, m in seqs
                ]

        if backend is None:
            return call
        from torch.nn.attention import SDPBackend, sdpa_kernel

        member = getattr(SDPBackend, backend)

        def under_backend():
            with sdpa_kernel([member]):
                return call()

        return under_backend

    return make


def sdpa_view(problem: AttentionProblem, out) -> torch.Tensor:
    """[B, Hq, Lq, D] (or one [1, Hq, c, D] per sequence) -> [T, Hq, D]."""
    if isinstance(out, list):
        return torch.cat([o[0].transpose(0, 1) for o in out])
    return out.transpose(1, 2).reshape(problem.q_tokens.shape)


def sdpa_notes(problem: AttentionProblem, backend: Optional[str]) -> dict:
    if problem.per_sequence is None:
        return {}
    return dict(mask="causal_lower_right" if backend is None else "bool [c, L] per sequence")


def sdpa_math_skip(problem: AttentionProblem) -> Optional[str]:
    if problem.dense is not None and problem.kind == "prefill":
        if problem.dense[0].shape[2] > MATH_PREFILL_MAX_S:
            return f"math materializes S x S scores (S > {MATH_PREFILL_MAX_S})"
    return None


@functools.cache
def flashinfer_missing() -> Optional[str]:
    """Why FlashInfer cannot be imported (None when it can): its peers are then skipped."""
    try:
        import flashinfer  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name == "flashinfer":
            return f"flashinfer not installed ({exc}; pip install flashinfer-python)"
        return f"flashinfer not importable ({type(exc).__name__}: {exc})"
    except Exception as exc:  # installed for another torch/CUDA, or broken
        return f"flashinfer not importable ({type(exc).__name__}: {exc})"
    return None


def flashinfer_skip(problem: AttentionProblem) -> Optional[str]:
    return flashinfer_missing()


# FlashInfer 0.7.2's sm90 (fa3) prefill compiles only these head dims: any other fails a static
# assertion in its JIT build after a minute of nvcc (seen at D = 96 on the H100, 2026-12-05).
FLASHINFER_FA3_HEAD_DIMS = (64, 128, 256)


def flashinfer_fa3_skip(problem: AttentionProblem) -> Optional[str]:
    missing = flashinfer_missing()
    if missing or problem.head_dim in FLASHINFER_FA3_HEAD_DIMS:
        return missing
    return f"flashinfer fa3 has no head dim {problem.head_dim} (has {FLASHINFER_FA3_HEAD_DIMS})"


def flashinfer_page_index(
    block_table: torch.Tensor,  # int32 [B, W]
    seq_lens: Sequence[int],
    page_size: int,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's form of a block table: kv_indptr int32 [B + 1] (prefix sums of each
    sequence's page count), kv_indices int32 [sum(pages)] (each sequence's pages in order) and
    kv_last_page_len int32 [B] (tokens in each last page, 1..page_size)."""
    device = block_table.device
    pages = [-(-length // page_size) for length in seq_lens]
    indptr = [0]
    for count in pages:
        indptr.append(indptr[-1] + count)
    indices = torch.cat([block_table[b, :count] for b, count in enumerate(pages)])
    last = [length - (count - 1) * page_size for length, count in zip(seq_lens, pages)]
    as_int32 = dict(dtype=torch.int32, device=device)
    return torch.tensor(indptr, **as_int32), indices.to(torch.int32), torch.tensor(last, **as_int32)


def fp8_pool(pool: torch.Tensor) -> Tuple[torch.Tensor, float]:
    """An e4m3 copy of a pool with one scale (pool ~= copy * scale), the scale chosen so the
    largest magnitude lands on the format's largest finite value."""
    scale = float(pool.abs().amax()) / FP8_MAX or 1.0
    return (pool.float() / scale).to(torch.float8_e4m3fn), scale


def flashinfer_kv(problem: AttentionProblem, page_size: int, kv_dtype: torch.dtype):
    """(k_pool, v_pool, run keyword arguments) of the shared paged pool in kv_dtype."""
    pool = problem.paged(page_size)
    if kv_dtype == problem.q_tokens.dtype:
        return pool["k_cache"], pool["v_cache"], {}
    k_pool, k_scale = fp8_pool(pool["k_cache"])
    v_pool, v_scale = fp8_pool(pool["v_cache"])
    return k_pool, v_pool, dict(k_scale=k_scale, v_scale=v_scale)


@dataclass
class FlashInferInputs:
    """What FlashInfer's decode and prefill wrappers both take over the shared pool."""

    pool: dict  # problem.paged(page_size)
    kv_dtype: torch.dtype
    kv: tuple  # (k_pool, v_pool) in kv_dtype
    scales: dict  # run()'s k_scale / v_scale for an FP8 copy, else empty
    page_index: tuple  # (indptr, indices, last_page_len): flashinfer_page_index
    workspace: torch.Tensor


def flashinfer_inputs(
    problem: AttentionProblem, page_size: int, kv_dtype: Optional[torch.dtype]
) -> FlashInferInputs:
    q = problem.q_tokens
    pool = problem.paged(page_size)
    data_type = kv_dtype or q.dtype
    k_pool, v_pool, scales = flashinfer_kv(problem, page_size, data_type)
    return FlashInferInputs(
        pool=pool,
        kv_dtype=data_type,
        kv=(k_pool, v_pool),
        scales=scales,
        page_index=flashinfer_page_index(pool["block_table"], problem.kv_lens, page_size),
        workspace=torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=q.device),
    )


def flashinfer_decode(
    page_size: int = 16, kv_dtype: Optional[torch.dtype] = None
) -> Callable[[AttentionProblem], Callable]:
    """FlashInfer's batch decode with tensor cores (the faster of its decodes on the H200) over
    the shared pool (NHD: [pages, page_size, Hkv, D]); plan() runs here, outside the timing."""

    def make(problem: AttentionProblem) -> Callable:
        import flashinfer

        q = problem.q_tokens
        inputs = flashinfer_inputs(problem, page_size, kv_dtype)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            inputs.workspace, "NHD", use_tensor_cores=True
        )
        wrapper.plan(
            *inputs.page_index,
            problem.num_q_heads,
            problem.num_kv_heads,
            problem.head_dim,
            page_size,
            pos_encoding_mode="NONE",
            q_data_type=q.dtype,
            kv_data_type=inputs.kv_dtype,
        )
        return lambda: wrapper.run(q, inputs.kv, **inputs.scales)

    return make


def flashinfer_prefill(
    backend: str, page_size: int = 16, kv_dtype: Optional[torch.dtype] = None
) -> Callable[[AttentionProblem], Callable]:
    """FlashInfer's batch prefill (backend "fa3" or "fa2"), causal and aligned bottom-right like
    astrai's paged prefill, over the shared pool; plan() runs here, outside the timing."""

    def make(problem: AttentionProblem) -> Callable:
        import flashinfer

        q = problem.q_tokens
        inputs = flashinfer_inputs(problem, page_size, kv_dtype)
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            inputs.workspace, "NHD", backend=backend
        )
        wrapper.plan(
            inputs.pool["query_start_loc"],
            *inputs.page_index,
            problem.num_q_heads,
            problem.num_kv_heads,
            problem.head_dim,
            page_size,
            causal=problem.is_causal,
            q_data_type=q.dtype,
            kv_data_type=inputs.kv_dtype,
        )
        return lambda: wrapper.run(q, inputs.kv, **inputs.scales)

    return make


SDPA_BACKENDS: Dict[str, Optional[str]] = {  # peer -> torch.nn.attention.SDPBackend member name
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
    "sdpa_cudnn": "CUDNN_ATTENTION",
    "sdpa_math": "MATH",
    "sdpa_default": None,
}
BASELINE_SUFFIX = "_before"
BOTH = ("decode", "prefill")


def fp8_fields(kv_dtype: Optional[torch.dtype]) -> dict:
    """A peer's tolerance and bytes per element over an FP8 copy of the pool."""
    return dict(tolerance=FP8_TOLERANCE, kv_element_bytes=1) if kv_dtype else {}


def registry(baseline_namespace: str = "astr_old") -> Dict[str, Peer]:
    """Every peer, in the order of the tables' columns (a baseline peer right after its
    partner)."""

    def astrai(
        name, backend, page_size, kinds=BOTH, skip=lambda problem: None, kv_dtype=None, tuning=""
    ):
        make = astrai_attention(backend, page_size, kv_dtype=kv_dtype)
        if tuning:
            make = under_tuning(make, tuning)
        return Peer(
            name, kinds, make, as_tokens, "astrai", page_size, skip=skip, **fp8_fields(kv_dtype)
        )

    def before(partner: Peer) -> Peer:
        backend = {"cuda_ps16": "cuda", "cuda_ps1": "cuda", "torch_native": "torch_native"}
        make = astrai_attention(backend[partner.name], partner.page_size, baseline_namespace)
        return Peer(
            partner.name + BASELINE_SUFFIX,
            partner.kinds,
            make,
            as_tokens,
            "astrai_before",
            partner.page_size,
            partner=partner.name,
            skip=partner.skip,
        )

    def sdpa_peer(name):
        backend = SDPA_BACKENDS[name]
        skip = sdpa_math_skip if name == "sdpa_math" else (lambda problem: None)
        return Peer(
            name,
            BOTH,
            sdpa(backend),
            sdpa_view,
            "sdpa",
            skip=skip,
            notes=lambda problem: sdpa_notes(problem, backend),
        )

    def flashinfer(name, kinds, make, kv_dtype=None, skip=flashinfer_skip):
        return Peer(
            name,
            kinds,
            make,
            as_tokens,
            "flashinfer",
            16,
            skip=skip,
            **fp8_fields(kv_dtype),
        )

    fp8 = torch.float8_e4m3fn
    cuda_ps16 = astrai("cuda_ps16", "cuda", 16)
    cuda_ps1 = astrai("cuda_ps1", "cuda", 1, kinds=("decode",))
    torch_native = astrai("torch_native", "torch_native", 16, skip=torch_native_skip)
    peers = [
        cuda_ps16,
        before(cuda_ps16),
        cuda_ps1,
        before(cuda_ps1),
        astrai(
            "cuda_ps16_persistent", "cuda", 16, ("prefill",), tuning="prefill_kernel=persistent"
        ),
        torch_native,
        before(torch_native),
        astrai("astrai_flash", "flash", 256),
        flashinfer("flashinfer_decode", ("decode",), flashinfer_decode()),
        flashinfer(
            "flashinfer_fa3", ("prefill",), flashinfer_prefill("fa3"), skip=flashinfer_fa3_skip
        ),
        flashinfer("flashinfer_fa2", ("prefill",), flashinfer_prefill("fa2")),
        *(sdpa_peer(name) for name in SDPA_BACKENDS),
        astrai("cuda_ps16_fp8", "cuda", 16, kinds=("decode",), kv_dtype=fp8),
        flashinfer("flashinfer_decode_fp8", ("decode",), flashinfer_decode(kv_dtype=fp8), fp8),
        flashinfer(
            "flashinfer_fa3_fp8",
            ("prefill",),
            flashinfer_prefill("fa3", fp8),
            fp8,
            skip=flashinfer_fa3_skip,
        ),
    ]
    return {peer.name: peer for peer in peers}


PEERS = registry()
ALL_PEERS = list(PEERS)
BASELINE_PEERS = [name for name, peer in PEERS.items() if peer.partner]
FP8_PEERS = [name for name in ALL_PEERS if name.endswith("_fp8")]
# Forms not yet measured on a GPU: named with --peers only.
OPT_IN_PEERS = ["cuda_ps16_persistent"]
DEFAULT_PEERS = [
    name for name in ALL_PEERS if name not in BASELINE_PEERS + FP8_PEERS + OPT_IN_PEERS
]
PEER_GROUPS = {
    "astrai": ["cuda_ps16", "cuda_ps1", "torch_native", "astrai_flash"],
    "cuda": ["cuda_ps16", "cuda_ps1"],
    "before": BASELINE_PEERS,
    "flashinfer": ["flashinfer_decode", "flashinfer_fa3", "flashinfer_fa2"],
    "fp8": FP8_PEERS,
    "sdpa": list(SDPA_BACKENDS),
}


def select_peers(spec: Optional[str], with_baseline: bool = False) -> List[str]:
    """Peer names from a comma-separated list of peers and groups, in column order. No list:
    every peer except the FP8 ones, plus cuda_ps16_before when a baseline is loaded."""
    if not spec:
        chosen = DEFAULT_PEERS + (["cuda_ps16" + BASELINE_SUFFIX] if with_baseline else [])
        return [p for p in ALL_PEERS if p in chosen]
    chosen: List[str] = []
    for token in (t.strip() for t in spec.split(",")):
        if not token:
            continue
        if token in PEER_GROUPS:
            chosen += PEER_GROUPS[token]
        elif token in PEERS:
            chosen.append(token)
        else:
            raise ValueError(
                f"unknown peer {token!r} (peers: {', '.join(ALL_PEERS)}; groups: "
                f"{', '.join(PEER_GROUPS)})"
            )
    return [p for p in ALL_PEERS if p in chosen]


def timing_groups(peers: Sequence[Peer]) -> List[List[Peer]]:
    """The order in which a shape's peers run: paged peers by falling page size (the peers of
    one page size share its pool), then the dense ones; a baseline peer in one group with its
    partner, so that the two are timed interleaved."""
    by_name = {peer.name: peer for peer in peers}
    groups: List[List[Peer]] = []
    for peer in peers:
        if peer.partner and peer.partner in by_name:
            continue  # timed with its partner
        group = [peer]
        for other in peers:
            if other.partner == peer.name:
                group.append(other)
        groups.append(group)
    return sorted(groups, key=lambda g: -(g[0].page_size or 0))


def rate_bytes(peer: Peer, row: dict) -> int:
    """The bytes a decode row's rate counts for this peer: an FP8 pool moves half the K/V
    bytes of a bf16 one."""
    if peer.kv_element_bytes == 2:
        return row["bytes"]
    shape = (row["B"], row["L"], row["Hq"], row["Hkv"], row["D"])
    return decode_bytes(*shape, kv_element_bytes=peer.kv_element_bytes)
