"""The benchmark's modules (benchmarks/harness.py, peers.py, report.py, bench_attention.py) import
each other by name, as the driver does when run as a script."""

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
