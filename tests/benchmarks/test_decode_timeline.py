"""benchmarks/decode_timeline.py reads the instrumented decode kernel's lines (CPU, synthetic)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import decode_timeline  # noqa: E402


def block_line(block, split, start, prologue, first, loop_end, end, seq_len=2048):
    # TL grid_x splits block_x split seq_len sm num_tiles start prologue first loop_end end (ns)
    return (
        f"TL 2 2 {block} {split} {seq_len} {block} 16 {start} {prologue} {first} {loop_end} {end}"
    )


def test_calls_are_split_at_the_markers_and_the_cold_call_is_dropped():
    cold = [block_line(0, 0, 0, 9000, 9000, 90000, 99000)]
    warm = [
        block_line(0, 0, 1_000_000, 1_002_000, 1_004_000, 1_030_000, 1_031_000),
        block_line(0, 1, 1_000_100, 1_002_100, 1_004_500, 1_031_000, 1_032_500),
        block_line(1, 0, 1_000_000, 1_003_000, 1_005_000, 1_029_000, 1_030_000),
        block_line(1, 1, 1_000_200, 1_003_200, 1_006_200, 1_033_000, 1_034_000),
    ]
    lines = ["CALL 2x2048 0", *cold, "stray output", "CALL 2x2048 1", *warm[:2], "x", *warm[2:]]
    calls = decode_timeline.parse(lines)
    assert list(calls) == [(2, 2, 2048)]
    assert [len(call) for call in calls[(2, 2, 2048)]] == [1, 4]

    (row,) = decode_timeline.report(calls)
    assert row["calls"] == 1 and row["blocks"] == 4
    assert row["prologue_med"] == pytest.approx(2.5)  # median of 2, 2, 3, 3 us
    assert row["first_tile_min"] == pytest.approx(4.0)
    assert row["loop_end_max"] == pytest.approx(33.0)  # from the first entry, 1_000_000 ns
    assert row["epilogue_min"] == pytest.approx(1.0)
    assert row["end_max"] == pytest.approx(34.0)


def test_lines_before_the_first_marker_are_ignored():
    assert decode_timeline.parse([block_line(0, 0, 0, 1, 2, 3, 4)]) == {}


def test_per_sm_summary_tells_a_slow_sm_from_noise():
    """Four kept calls over three SMs (block b on SM b): SM 2 is 3 us late every time, SMs 0 and
    1 trade places; so the slowest SM mean is SM 2's and even calls predict odd ones."""
    lines = []
    for call, jitter in enumerate([0, 0, 400, -300, 200]):  # call 0 is the cold one, dropped
        lines.append(f"CALL 3x2048 {call}")
        for block, late in ((0, 1000 + jitter), (1, 1000 - jitter), (2, 4000 + jitter // 4)):
            lines.append(block_line(block, 0, 0, 1000, 2000, 30_000 + late, 31_000 + late))
    (row,) = decode_timeline.report(decode_timeline.parse(lines))
    assert row["calls"] == 4
    assert row["sm_slowest"] == pytest.approx(34.01875)  # 30 + 4 us + mean of jitter // 4
    assert row["sm_fastest"] == pytest.approx(30.925)  # SM 1: 31 us - mean jitter (75 ns)
    assert row["sm_repeat_corr"] > 0.9
