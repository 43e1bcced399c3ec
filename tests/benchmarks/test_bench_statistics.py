"""benchmarks/bench_attention.py's reading of A/B rounds (CPU)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_attention  # noqa: E402


def test_median_round_takes_the_upper_median_and_its_rate():
    median, tbps = bench_attention.median_round([0.04, 0.02, 0.05, 0.03], 80_000_000)
    assert median == 0.04  # upper of the two middle rounds
    assert tbps == pytest.approx(2.0)  # 80 MB in 40 us


def test_median_round_of_an_odd_count_is_the_middle_round():
    assert bench_attention.median_round([3.0, 1.0, 2.0], 10**12)[0] == 2.0
