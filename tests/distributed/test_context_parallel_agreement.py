"""Context-parallel ranks agree on every call before anything collective (issue 47, defects 2
and 3), on 2 and 4 gloo processes: one rank refusing a step, and each kind of mismatch between
ranks, make every rank raise the same named error within seconds; no rank aborts or hangs, the
refused call changes nothing, and the ranks stay in step (a matching call afterwards returns
attention over the whole sequence).

They used to: wait in all_gather until the process group's timeout (one rank refusing), abort a
rank inside gloo (different token counts or dtype sizes), or return wrong numbers silently
(fp16 against bf16, a different softcap, a sequence freed on one rank only).

One spawn per world size runs every scenario in order, each on a fresh cache; each rank records
what each scenario raised and how long that took, and the tests read the records. The spawn has
a hard deadline: a hang fails the tests instead of stalling them.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.reference import sequence_reference

HQ, HKV, D, PAGE = 4, 2, 16, 4
DEADLINE_S = 300  # the whole spawn: process start-up (a few seconds each) and every scenario
WITHIN_S = 10  # each scenario's error on every rank


def make_cache(num_pages=16, dtype=torch.float32):
    from astrai.distributed import ContextParallelCache

    return ContextParallelCache(2, num_pages, PAGE, HKV, D, dtype=dtype)


def qkv(tokens, seed, dtype=torch.float32):
    """The step's q/k/v (prefill shapes), the same on every rank (one seed)."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(1, tokens, HQ, D, generator=g).to(dtype),
        torch.randn(1, tokens, HKV, D, generator=g).to(dtype),
        torch.randn(1, tokens, HKV, D, generator=g).to(dtype),
    )


def causal_reference(q, k, v):
    """float64 causal attention of one fresh sequence over itself, [T, Hq, D]."""
    return sequence_reference(q[0], k[0], v[0], is_causal=True)


def fresh_prefill_runs(cache, seq_id, tokens, seed=11, layer_id=0):
    """A step that every rank makes alike runs, and returns attention over the whole sequence."""
    cache.begin_step([seq_id], [tokens])
    q, k, v = qkv(tokens, seed)
    out = cache.attention(q, k, v, layer_id=layer_id)
    error = ((out[0].double() - causal_reference(q, k, v)).norm() / out.norm()).item()
    assert error < 1e-5, f"a matching step afterwards: relative error {error}"


def unchanged(cache, lengths, free_pages):
    assert {s: cache.seq_len(s) for s in lengths} == lengths, "a refused call changed lengths"
    assert cache.local.free_pages == free_pages, "a refused call took pages"


# -- the scenarios: each returns the call expected to raise on every rank, run by the harness,
# and the checks to make afterwards --------------------------------------------------------


def out_of_pages_on_rank_0(rank, world):
    """Rank 0 holds the first page of every sequence: a step of world pages and one token
    needs two pages there, one elsewhere."""
    cache = make_cache(num_pages=1)

    def after():
        unchanged(cache, {0: 0}, 1)
        assert cache.step is None
        fresh_prefill_runs(cache, 0, PAGE * world)

    return lambda: cache.begin_step([0], [PAGE * world + 1]), after


def token_counts_differ(rank, world):
    cache = make_cache()
    cache.begin_step([0], [3])
    cache.attention(*qkv(3, 1))
    counts = [4] if rank == world - 1 else [3]

    def after():
        unchanged(cache, {0: 3}, 15 if rank == 0 else 16)
        fresh_prefill_runs(cache, 1, 5)

    return lambda: cache.begin_step([0], counts), after


def sequence_ids_differ(rank, world):
    cache = make_cache()
    ids = [7] if rank == world - 1 else [6]

    def after():
        unchanged(cache, {6: 0, 7: 0}, 16)
        fresh_prefill_runs(cache, 8, 3)

    return lambda: cache.begin_step(ids, [2]), after


def dtypes_differ(rank, world):
    """Caches of fp16 on one rank, bf16 on the others: each rank's call is valid on its own."""
    dtype = torch.float16 if rank == world - 1 else torch.bfloat16
    cache = make_cache(dtype=dtype)
    cache.begin_step([0], [3])
    return lambda: cache.attention(*qkv(3, 2, dtype)), lambda: None


def softcaps_differ(rank, world):
    cache = make_cache()
    cache.begin_step([0], [3])
    softcap = 3.0 if rank == world - 1 else 5.0
    pools = [p.clone() for p in cache.local.layer(0)]

    def after():
        assert all(torch.equal(a, b) for a, b in zip(cache.local.layer(0), pools)), "written"
        cache.attention(*qkv(3, 3))  # the same call on every rank then runs

    return lambda: cache.attention(*qkv(3, 3), softcap=softcap), after


def layers_differ(rank, world):
    cache = make_cache()
    cache.begin_step([0], [3])
    layer_id = 1 if rank == world - 1 else 0
    return lambda: cache.attention(*qkv(3, 4), layer_id=layer_id), lambda: None


def one_rank_passes_a_wrong_q(rank, world):
    """A refusal inside attention on one rank (q of the wrong token count there)."""
    cache = make_cache()
    cache.begin_step([0], [3])
    q, k, v = qkv(3, 5)
    if rank == world - 1:
        q = q[:, :2]
    return lambda: cache.attention(q, k, v), lambda: None


def a_sequence_freed_on_one_rank_only(rank, world):
    cache = make_cache()
    cache.begin_step([0, 1], [3, 2])
    cache.attention(*qkv(5, 6))
    if rank == world - 1:
        cache.free(1)

    def after():
        unchanged(cache, {0: 3}, cache.local.free_pages)
        if rank != world - 1:
            cache.free(1)  # freed everywhere now: the ranks agree again
        fresh_prefill_runs(cache, 2, 3)

    return lambda: cache.begin_step([0], [1]), after


def ranks_in_different_calls(rank, world):
    cache = make_cache()
    cache.begin_step([0], [3])
    if rank == world - 1:
        return lambda: cache.begin_step([0], [1]), lambda: None
    return lambda: cache.attention(*qkv(3, 7)), lambda: None


def freeing_a_sequence_outside_the_step_keeps_the_step(rank, world):
    """Not an error: ContextParallelCache.free(seq) used to end the step even when seq was not
    in it."""
    cache = make_cache()
    cache.begin_step([5], [2])
    cache.begin_step([0], [3])

    def call():
        cache.free(5)
        assert cache.step is not None, "the step of sequence 0 ended"
        q, k, v = qkv(3, 8)
        out = cache.attention(q, k, v)
        assert ((out[0].double() - causal_reference(q, k, v)).norm() / out.norm()) < 1e-5

    return call, lambda: None


# name: (scenario, error every rank raises (None: no error), what its message says)
SCENARIOS = {
    "out of pages on rank 0": (
        out_of_pages_on_rank_0,
        "KVCacheFullError",
        r"^rank 0 refused this begin_step: KVCacheFullError: KV cache out of pages",
    ),
    "token counts differ": (
        token_counts_differ,
        "ContextParallelMismatchError",
        r"^begin_step: num_new_tokens differs between ranks: rank 0 has \[3\], .*rank {last} has "
        r"\[4\]",
    ),
    "sequence ids differ": (
        sequence_ids_differ,
        "ContextParallelMismatchError",
        r"^begin_step: seq_ids differs between ranks: rank 0 has \[6\], .*rank {last} has \[7\]",
    ),
    "dtypes differ": (
        dtypes_differ,
        "ContextParallelMismatchError",
        r"^attention: q differs between ranks: rank 0 has torch.bfloat16 \[1, 3, 4, 16\], "
        r".*rank {last} has torch.float16",
    ),
    "softcaps differ": (
        softcaps_differ,
        "ContextParallelMismatchError",
        r"^attention: softcap differs between ranks: rank 0 has 5.0, .*rank {last} has 3.0",
    ),
    "layers differ": (
        layers_differ,
        "ContextParallelMismatchError",
        r"^attention: layer_id differs between ranks: rank 0 has 0, .*rank {last} has 1",
    ),
    "one rank passes a wrong q": (
        one_rank_passes_a_wrong_q,
        "ValueError",
        r"^rank {last} refused this attention: ValueError: q: 2 query tokens",
    ),
    "a sequence freed on one rank only": (
        a_sequence_freed_on_one_rank_only,
        "ContextParallelMismatchError",
        r"^begin_step: sequences freed since the last step differs between ranks: rank 0 has "
        r"\[\], .*rank {last} has \['1'\]",
    ),
    "ranks in different calls": (
        ranks_in_different_calls,
        "ContextParallelMismatchError",
        r"^the ranks are in different calls: rank 0 is in attention, .*rank {last} is in "
        r"begin_step",
    ),
    "freeing a sequence outside the step keeps the step": (
        freeing_a_sequence_outside_the_step_keeps_the_step,
        None,
        None,
    ),
}


def run_scenarios(rank, world, init_file, out_dir):
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),  # a collective left waiting raises instead of hanging
    )
    records = {}
    try:
        for name, (scenario, _, _) in SCENARIOS.items():
            record = {"error": None, "message": "", "seconds": 0.0, "check": ""}
            try:
                call, after = scenario(rank, world)
                start = time.monotonic()
                try:
                    call()
                except Exception as error:
                    record.update(error=type(error).__name__, message=str(error))
                record["seconds"] = time.monotonic() - start
                after()
            except Exception:
                record["check"] = traceback.format_exc()
            records[name] = record
            dist.barrier()  # the ranks are still in step
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(records, f)
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def records(request):
    """{rank: {scenario: record}} of one spawn of `request.param` ranks."""
    world = request.param
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.spawn(
            run_scenarios,
            args=(world, os.path.join(tmp, "init"), tmp),
            nprocs=world,
            join=False,
        )
        deadline = time.monotonic() + DEADLINE_S
        while not context.join(timeout=5):  # raises if a rank died (an abort, an exception)
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                pytest.fail(f"the {world} ranks did not finish within {DEADLINE_S} s: a hang")
        result = {}
        for rank in range(world):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                result[rank] = json.load(f)
    return result


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_rank_raises_the_same_named_error_within_seconds(records, scenario):
    _, error, message = SCENARIOS[scenario]
    world = len(records)
    seen = [records[rank][scenario] for rank in range(world)]
    for rank, record in enumerate(seen):
        assert not record["check"], f"rank {rank}: {record['check']}"
        assert record["error"] == error, f"rank {rank}: {record['error']}: {record['message']}"
        assert record["seconds"] < WITHIN_S, f"rank {rank} took {record['seconds']:.1f} s"
    if error is not None:
        import re

        assert re.search(message.format(last=world - 1), seen[0]["message"]), seen[0]["message"]
        assert all(record["message"] == seen[0]["message"] for record in seen)
