"""bench_attention.py end to end at toy sizes (--smoke: the CPU where there is no GPU), its
command line, and the A/B path against another build of the library."""

import json
import os
import subprocess
import sys
from pathlib import Path

import bench_attention
import peers
import pytest
import torch

from astrai.extension import ops

ROOT = Path(__file__).resolve().parents[2]


def run_smoke(tmp_path, *extra):
    out = tmp_path / "out"
    assert bench_attention.main(["--smoke", "--out", str(out), *extra]) == 0
    (json_file,) = out.glob("bench_*.json")
    return json.loads(json_file.read_text())


def rows_of(result, peer):
    return [row for row in result["rows"] if row["peer"] == peer]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    return run_smoke(tmp_path_factory.mktemp("smoke"))


def test_smoke_run_verifies_the_reference_peers_on_every_shape(smoke):
    keys = {tuple(key) for keys in smoke["sets"].values() for key in keys}
    # decode L=24 and 40 (the decode shape is a sweep point), prefill GQA + MHA, ragged GQA + MHA,
    # the prefill sweep S=16 and 40
    assert len(keys) == 2 + 2 + 2 + 2
    for peer in ("torch_native", "sdpa_math", "sdpa_default"):
        rows = rows_of(smoke, peer)
        assert len(rows) == len(keys)
        assert all("ms" in row and row["verified"] for row in rows), peer


def test_smoke_run_gives_every_row_a_result_or_an_error(smoke):
    for row in smoke["rows"]:
        assert ("ms" in row and "rel_l2" in row) or row["error"], row
        if row["kind"] == "decode" and "ms" in row:
            assert row["TBps"] > 0 and row["pct_copy"] > 0
        if row["kind"] == "prefill" and "ms" in row:
            assert row["TFLOPs"] > 0 and row["pct_matmul"] > 0
        assert row["cmd"].startswith("python3 benchmarks/bench_attention.py --smoke --only ")


def test_smoke_run_records_refusals_as_errors(smoke):
    """Without CUDA the cuda backend refuses every call: the resolver's refusal is the row's
    error. With a GPU the rows of a head dim the kernels were built for run (D=64), and the others
    (the D=16 prefill) are the resolver's refusal naming the head dim."""
    head_dims = ops.BUILD_INFO["paged_kernels"]["head_dims"]
    for row in rows_of(smoke, "cuda_ps16"):
        if torch.cuda.is_available() and row["D"] in head_dims:
            assert row["verified"], row
        else:
            assert row["error"].startswith("RuntimeError: resolver chose None for backend='cuda'")
            if torch.cuda.is_available():
                assert f"unsupported head_dim {row['D']}" in row["error"], row
            else:
                assert "needs CUDA tensors (got cpu)" in row["error"]


def test_flashinfer_peers_skip_cleanly_when_it_does_not_import(smoke):
    rows = [row for row in smoke["rows"] if row["family"] == "flashinfer"]
    assert {row["peer"] for row in rows} == {
        "flashinfer_decode",
        "flashinfer_fa3",
        "flashinfer_fa2",
    }
    missing = peers.flashinfer_missing()
    for row in rows:
        if missing:
            assert row["error"] == "skipped: " + missing
        else:
            assert "ms" in row or row["error"]


def test_ratio_of_each_row_against_the_same_build(tmp_path):
    """A/A: --baseline-namespace astr sets this build against itself through the same A/B path
    (interleaved timing, ratios, flags)."""
    result = run_smoke(
        tmp_path,
        "--peers",
        "torch_native,torch_native_before,sdpa_math",
        "--baseline-namespace",
        "astr",
    )
    assert result["env"]["baseline"]["note"].startswith("A/A")
    before = rows_of(result, "torch_native_before")
    assert before and all(row["verified"] and row["partner"] == "torch_native" for row in before)
    keys = {tuple(key) for keys in result["sets"].values() for key in keys}
    assert len(result["ab"]) == len(keys)
    assert all("ratio" in entry and entry["peer"] == "torch_native" for entry in result["ab"])
    markdown = next((tmp_path / "out").glob("bench_*.md")).read_text()
    assert "## After / before" in markdown


def test_a_baseline_namespace_that_nothing_registers_fails_its_rows_only(tmp_path):
    result = run_smoke(
        tmp_path, "--only", "decode", "--peers", "torch_native,torch_native_before",
        "--baseline-namespace", "astr_nowhere",
    )  # fmt: skip
    for row in rows_of(result, "torch_native_before"):
        assert row["error"].startswith("baseline namespace 'astr_nowhere' has no ops")
    assert all(row["verified"] for row in rows_of(result, "torch_native"))
    assert all("error" in entry for entry in result["ab"])


@pytest.mark.skipif(
    not os.environ.get("ASTR_BENCH_BASELINE_LIB"),
    reason="set ASTR_BENCH_BASELINE_LIB to a library built by benchmarks/build_baseline.sh",
)
def test_ab_against_a_baseline_build_in_one_process(tmp_path):
    lib = os.environ["ASTR_BENCH_BASELINE_LIB"]
    command = [
        sys.executable,
        "benchmarks/bench_attention.py",
        "--smoke",
        "--out",
        str(tmp_path),
        "--peers",
        "torch_native,torch_native_before,sdpa_math",
        "--baseline-lib",
        lib,
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(next(tmp_path.glob("bench_*.json")).read_text())
    baseline = result["env"]["baseline"]
    assert baseline["namespace"] == "astr_old" and baseline["lib"] == os.path.abspath(lib)
    assert baseline["build"]["torch_version"]  # build_info() of the loaded library answered
    before = rows_of(result, "torch_native_before")
    assert before and all(row["verified"] for row in before)
    keys = {tuple(key) for keys in result["sets"].values() for key in keys}
    assert {tuple(entry["key"]) for entry in result["ab"] if "ratio" in entry} == keys


def test_peers_and_groups_select_columns_in_table_order():
    args = bench_attention.parse_args(["--quick", "--only", "decode", "--peers", "sdpa_cudnn,cuda"])
    assert args.peers == ["cuda_ps16", "cuda_ps1", "sdpa_cudnn"]
    assert (args.repeats, args.warmup, args.shapes) == (20, 3, bench_attention.QUICK)
    assert bench_attention.parse_args(["--backends", "cuda_ps1"]).peers == ["cuda_ps1"]


def test_default_selection_leaves_fp8_out_and_adds_the_baseline_only_with_one():
    plain = bench_attention.parse_args([])
    assert plain.repeats == 30 and plain.shapes == bench_attention.FULL
    assert not set(plain.peers) & set(peers.FP8_PEERS + peers.BASELINE_PEERS)
    assert "flashinfer_decode" in plain.peers and "sdpa_cudnn" in plain.peers
    with_baseline = bench_attention.parse_args(["--baseline-namespace", "astr"])
    assert set(with_baseline.peers) - set(plain.peers) == {"cuda_ps16_before"}


def test_the_persistent_prefill_peer_runs_only_when_named():
    """cuda_ps16_persistent (prefill_kernel=persistent, never measured yet) sits beside cuda_ps16
    when --peers names it, and is not in the default selection."""
    assert "cuda_ps16_persistent" not in bench_attention.parse_args([]).peers
    args = bench_attention.parse_args(["--peers", "sdpa_cudnn,cuda_ps16_persistent,cuda_ps16"])
    assert args.peers == ["cuda_ps16", "cuda_ps16_persistent", "sdpa_cudnn"]
    assert peers.PEERS["cuda_ps16_persistent"].kinds == ("prefill",)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--peers", "cuda,nope"], "unknown peer 'nope'"),
        (["--peers", "cuda_ps16_before"], "need --baseline-lib"),
        (["--baseline-lib", "/nonexistent/_C.so"], "no file /nonexistent/_C.so"),
        (["--repeats", "0"], "must be at least 1"),
    ],
)
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_attention.parse_args(argv)
    assert message in capsys.readouterr().err


def test_the_reproduce_command_quotes_its_arguments():
    command = bench_attention.reproduce_command(["--quick", "--out", "a b"])
    assert command == "python3 benchmarks/bench_attention.py --quick --out 'a b'"
