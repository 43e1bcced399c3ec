"""The harness's timing, its reading of timings, and its runner (CPU: host clock, no flush)."""

import pytest
import torch
from harness import Runner, Timer, median_round, summarize_times, under_tuning

import astrai.extension  # noqa: F401  (the kernel-tuning ops)


def test_median_round_takes_the_upper_median_and_its_rate():
    median, tbps = median_round([0.04, 0.02, 0.05, 0.03], 80_000_000)
    assert median == 0.04  # upper of the two middle rounds
    assert tbps == pytest.approx(2.0)  # 80 MB in 40 us


def test_median_round_of_an_odd_count_is_the_middle_round():
    assert median_round([3.0, 1.0, 2.0], 10**12)[0] == 2.0


def test_a_rows_statistics_are_median_min_and_deciles():
    stats = summarize_times([float(t) for t in range(30, 0, -1)])  # 1 .. 30 ms, unordered
    assert stats == dict(ms=16.0, min_ms=1.0, p10_ms=4.0, p90_ms=28.0, repeats=30)


def test_interleaved_timing_rotates_which_callable_goes_first():
    calls = []
    fns = [lambda name=name: calls.append(name) for name in "abc"]
    timer = Timer(warmup=2, repeats=4, device="cpu")
    timings = timer.measure_interleaved(fns)
    assert [t["repeats"] for t in timings] == [4, 4, 4]
    warmup, timed = calls[:6], calls[6:]
    assert warmup == list("abcabc")
    assert timed == list("abcbcacababc")


def test_the_runner_times_what_matches_and_records_what_does_not():
    ref = torch.randn(6, 2, 4, dtype=torch.float32)
    timer = Timer(warmup=1, repeats=3, device="cpu")
    runner = Runner(timer, dict(copy_TBps=1.0, matmul_TFLOPs=1.0))

    def good():
        return lambda: ref.to(torch.bfloat16)

    def wrong():
        return lambda: ref.flip(0)

    def broken():
        raise RuntimeError("this peer cannot run\nthe shape")

    rows = [dict(peer=name) for name in ("good", "wrong", "broken")]
    for row, make in zip(rows, (good, wrong, broken)):
        runner.run(row, make, lambda out: out, ref)
    good_row, wrong_row, broken_row = rows
    assert good_row["verified"] and good_row["rel_l2"] < 1e-2 and good_row["repeats"] == 3
    assert not wrong_row["verified"] and "ms" in wrong_row  # timed, flagged
    assert broken_row["error"] == "RuntimeError: this peer cannot run the shape"
    assert "ms" not in broken_row
    # A looser tolerance (an FP8 peer's) passes what the default one flags.
    loose = runner.run(dict(peer="loose"), wrong, lambda out: out, ref, tolerance=10.0)
    assert loose["verified"]


def test_under_tuning_runs_the_call_under_its_tuning_and_restores_the_previous_one():
    seen = []
    torch.ops.astr.set_kernel_tuning("verify_form=never")
    try:
        call = under_tuning(
            "prefill_kernel=mma_sync", lambda: seen.append(torch.ops.astr.kernel_tuning())
        )
        call()
        assert seen == ["prefill_kernel=mma_sync"]
        assert torch.ops.astr.kernel_tuning() == "verify_form=never"

        def fails():
            raise RuntimeError("the call raised")

        with pytest.raises(RuntimeError, match="the call raised"):
            under_tuning("prefill_kernel=mma_sync", fails)()
        assert torch.ops.astr.kernel_tuning() == "verify_form=never"
    finally:
        torch.ops.astr.set_kernel_tuning("")
