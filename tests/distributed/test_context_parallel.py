"""Context-parallel paged attention (astrai.distributed) on 2 and 4 gloo processes: every rank
returns single-process attention over the whole sequence (a float64 reference), through
prefills after cached prefixes and decode steps, with sequences shorter than one page per rank.

Each scenario runs in spawned processes (torch.multiprocessing), all drawing the same random
q/k/v from one seed, as ranks that hold replicated activations would.
"""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.reference import sequence_reference

HQ, HKV, D, PAGE = 4, 2, 64, 4  # D=64: a head dim the cuda kernels serve
PROMPTS = [5, 13, 2, 9]  # the last-but-one is shorter than a page: one rank holds all of it
CHUNKS = [3, 7, 1, 4]  # a second prefill over cached prefixes
DECODE_STEPS = 4
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def relative_error(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def run_scenario(rank, world, init_file, dtype, softcap, device, backend):
    from astrai.distributed import ContextParallelCache, owner_rank

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        cache = ContextParallelCache(2, 64, PAGE, HKV, D, dtype=dtype, device=device)
        generator = torch.Generator().manual_seed(7)
        keys = {s: [] for s in range(len(PROMPTS))}
        values = {s: [] for s in range(len(PROMPTS))}
        seq_ids = list(range(len(PROMPTS)))
        steps = [PROMPTS, CHUNKS] + [[1] * len(PROMPTS)] * DECODE_STEPS
        worst = 0.0
        for new_tokens in steps:
            total = sum(new_tokens)
            q = torch.randn(total, HQ, D, generator=generator).to(device, dtype)
            k = torch.randn(total, HKV, D, generator=generator).to(device, dtype)
            v = torch.randn(total, HKV, D, generator=generator).to(device, dtype)
            step = cache.begin_step(seq_ids, new_tokens)
            decode = step.mode == "decode"
            shape = (len(seq_ids), 1) if decode else (1, total)
            out = cache.attention(
                q.view(*shape, HQ, D),
                k.view(*shape, HKV, D),
                v.view(*shape, HKV, D),
                layer_id=1,
                softcap=softcap,
                backend=backend,
            )
            assert out.shape == (*shape, HQ, D) and out.dtype == dtype
            out = out.reshape(total, HQ, D).cpu()
            q, k, v = q.cpu(), k.cpu(), v.cpu()

            start = 0
            for seq, new in zip(seq_ids, new_tokens):
                keys[seq].append(k[start : start + new])
                values[seq].append(v[start : start + new])
                ref = sequence_reference(
                    q[start : start + new],
                    torch.cat(keys[seq]),
                    torch.cat(values[seq]),
                    is_causal=True,
                    softcap=softcap,
                )
                error = relative_error(out[start : start + new], ref)
                worst = max(worst, error)
                assert error < TOLERANCE[dtype], (rank, new_tokens, seq, error)
                start += new

            # Every rank returns the same bytes.
            gathered = [torch.empty_like(out) for _ in range(world)]
            dist.all_gather(gathered, out.contiguous())
            assert all(torch.equal(g, gathered[0]) for g in gathered)

        # The tokens were dealt by page: this rank holds exactly the positions it owns.
        for seq in seq_ids:
            length = cache.seq_len(seq)
            owned = sum(owner_rank(p, PAGE, world) == rank for p in range(length))
            assert cache.local.seq_len(seq) == owned

        # Control: this rank's share alone (no gather, no merge) is far from the reference,
        # so the checks above would fail if the merge were skipped.
        q = torch.randn(len(seq_ids), 1, HQ, D, generator=generator).to(device, dtype)
        step = cache.step
        k_pool, v_pool = cache.local.layer(1)
        alone = torch.ops.astr.attention(
            q.view(-1, HQ, D),
            None,
            None,
            None,
            True,
            None,
            k_pool,
            v_pool,
            step.block_table,
            step.seq_lens,
            step.query_start_loc,
            1,
            "decode",
            backend,
            softcap=softcap,
        ).cpu()
        q = q.cpu()
        long_seq = PROMPTS.index(max(PROMPTS))
        ref = sequence_reference(
            q[long_seq, :, :, :],
            torch.cat(keys[long_seq]),
            torch.cat(values[long_seq]),
            is_causal=True,
            softcap=softcap,
        )
        assert relative_error(alone[long_seq : long_seq + 1], ref) > 20 * TOLERANCE[dtype]
    finally:
        dist.destroy_process_group()


def spawn(world, dtype, softcap=None, device="cpu", backend="torch_native"):
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(
            run_scenario,
            args=(world, init_file, dtype, softcap, device, backend),
            nprocs=world,
            join=True,
        )


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_returns_attention_over_the_whole_sequence(world):
    spawn(world, torch.float32)


def test_bf16_with_softcap_on_two_ranks():
    spawn(2, torch.bfloat16, softcap=5.0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_cuda_kernels_on_two_gloo_ranks_sharing_one_gpu(dtype):
    """One GPU: two ranks on gloo (NCCL refuses two ranks on one device), the cuda backend's
    paged decode over each rank's share; gloo moves the partial results through the host."""
    spawn(2, dtype, softcap=5.0, device="cuda", backend="cuda")


def test_a_cache_needs_a_process_group():
    from astrai.distributed import ContextParallelCache

    with pytest.raises(RuntimeError, match="init_process_group"):
        ContextParallelCache(1, 4, PAGE, HKV, D)


def test_owner_rank_deals_pages_round_robin():
    from astrai.distributed import owner_rank

    assert [owner_rank(p, 4, 3) for p in range(0, 28, 2)] == [
        0, 0, 1, 1, 2, 2, 0, 0, 1, 1, 2, 2, 0, 0
    ]  # fmt: skip
