"""The shipped preference table is what `make tune` writes from its runs of record: regenerating
it changes nothing, and each entry's choice is the faster measured backend."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TABLE = os.path.join(ROOT, "csrc", "dispatch", "preference_table.inc")


def test_the_shipped_table_is_what_its_runs_of_record_give(tmp_path):
    with open(TABLE) as f:
        shipped = f.read()
    runs = shipped.splitlines()[0].split("from ", 1)[1].rsplit(": do not edit.", 1)[0]
    out = tmp_path / "table.inc"
    paths = [os.path.join(ROOT, p) for p in runs.split(", ")]
    subprocess.run(
        [sys.executable, "benchmarks/tune_preferences.py", *paths, "--out", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    assert out.read_text() == shipped


def test_every_entry_prefers_the_backend_that_ran_faster():
    with open(TABLE) as f:
        entries = [line for line in f if line.startswith("{")]
    assert entries
    for entry in entries:
        flash = float(entry.split("flash ")[1].split(" ")[0])
        cuda = float(entry.split("vs cuda ")[1].split(" ")[0])
        expected = "Backend::kFlash" if flash > cuda * 1.02 else "Backend::kCuda"
        assert expected in entry, entry
