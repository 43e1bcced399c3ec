"""What a run writes: JSON, the Markdown tables (with the A/B ratios) and the plots, from a
synthetic result shaped like a real one."""

import json
import os
import re

import pytest
from report import (
    AB_THRESHOLD,
    ab_comparison,
    output_stem,
    render_markdown,
    safe_name,
    write_outputs,
)


def decode_row(peer, batch, length, ms, family="astrai", **extra):
    nbytes = 2 * batch * length * 8 * 128 * 2 + 2 * batch * 32 * 128 * 2
    row = dict(kind="decode", B=batch, L=length, Hq=32, Hkv=8, D=128, bytes=nbytes, peer=peer)
    row.update(family=family, floor_us=nbytes / 4.2e6, **extra)
    if ms is None:
        row["error"] = "RuntimeError: No available kernel. Aborting execution."
        return row
    tbps = nbytes / (ms / 1e3) / 1e12
    row.update(ms=ms, rel_l2=3e-3, verified=True, TBps=tbps, pct_copy=100 * tbps / 4.2)
    return row


def prefill_row(peer, seq, ms, rel_l2=4e-3, family="sdpa", **extra):
    flops = 2 * 2 * 32 * seq * seq * 128
    row = dict(kind="prefill", B=2, S=seq, Hq=32, Hkv=8, D=128, flops=flops, peer=peer)
    row.update(family=family, **extra)
    tflops = flops / (ms / 1e3) / 1e12
    row.update(ms=ms, rel_l2=rel_l2, verified=rel_l2 < 2e-2, TFLOPs=tflops)
    row["pct_matmul"] = 100 * tflops / 750
    return row


@pytest.fixture
def result():
    rows = [
        decode_row("cuda_ps16", 16, 4096, 0.0650),
        decode_row("cuda_ps16_before", 16, 4096, 0.0656, "astrai_before", partner="cuda_ps16"),
        decode_row("sdpa_cudnn", 16, 4096, 0.0660, "sdpa"),
        decode_row("sdpa_efficient", 16, 4096, None, "sdpa"),
        decode_row("cuda_ps16", 16, 8192, 0.1300),
        decode_row("cuda_ps16_before", 16, 8192, 0.1261, "astrai_before", partner="cuda_ps16"),
        prefill_row("cuda_ps16", 4096, 0.500, family="astrai"),
        prefill_row("cuda_ps16_before", 4096, 0.497, family="astrai_before", partner="cuda_ps16"),
        prefill_row("torch_native", 4096, 1.5, rel_l2=5e-2, family="astrai"),
    ]
    return dict(
        env=dict(
            gpu="NVIDIA H200 (synthetic)",
            sms=132,
            torch="2.11.0",
            cuda="13.0",
            cudnn=91900,
            driver="580",
            command="python3 benchmarks/bench_attention.py --quick",
            date="2026-12-04T00:00:00+00:00",
            astrai_build=dict(torch_version="2.11.0", cuda_archs="sm_90a"),
            baseline=dict(namespace="astr_old", lib="/tmp/b/astrai/_C.abi3.so", commit="2be0c0e"),
        ),
        method=dict(timing="CUDA events"),
        args=dict(
            peers=["cuda_ps16", "cuda_ps16_before", "torch_native", "sdpa_efficient", "sdpa_cudnn"]
        ),
        ceilings=dict(copy_TBps=4.2, matmul_TFLOPs=750.0, matmul_shape=[8192] * 3),
        rows=rows,
        sets=dict(
            decode=[["decode", 16, 4096, None, 32, 8, 128]],
            decode_sweep=[
                ["decode", 16, 4096, None, 32, 8, 128],
                ["decode", 16, 8192, None, 32, 8, 128],
            ],
            prefill=[["prefill", 2, None, 4096, 32, 8, 128]],
        ),
    )


def test_each_pair_gets_its_ratio_and_a_flag_outside_two_percent(result):
    ab = ab_comparison(result)
    by_shape = {(e["kind"], e["key"][2] or e["key"][3]): e for e in ab}
    assert len(ab) == 3  # one per shape: the sweep repeats the decode row, counted once
    within = by_shape[("decode", 4096)]
    assert within["ratio"] == pytest.approx(0.0656 / 0.0650) and within["within"]
    outside = by_shape[("decode", 8192)]
    assert outside["ratio"] == pytest.approx(0.1261 / 0.1300) and not outside["within"]
    assert by_shape[("prefill", 4096)]["within"]
    assert AB_THRESHOLD == 0.02


def test_a_row_without_a_partner_is_not_compared(result):
    for row in result["rows"]:
        row.pop("partner", None)
    assert ab_comparison(result) == []


def test_a_pair_with_an_error_carries_it_instead_of_a_ratio(result):
    before = result["rows"][1]
    for key in ("ms", "TBps", "pct_copy", "rel_l2", "verified"):
        before.pop(key)
    before["error"] = "baseline namespace 'astr_old' has no ops"
    entry = ab_comparison(result)[0]
    assert "ratio" not in entry and entry["error"] == before["error"]


def test_markdown_has_the_tables_the_ratios_and_the_flags(result):
    result["ab"] = ab_comparison(result)
    markdown = render_markdown(result)
    assert "## Decode" in markdown and "## Prefill" in markdown and "## After / before" in markdown
    ab_lines = [line for line in markdown.splitlines() if line.startswith("| decode B=16 L=")]
    assert ab_lines[0].endswith("| 1.009 |  |")
    assert "| 0.970 | **outside** |" in ab_lines[1]
    assert "2 of 3 measured rows within 2%" in markdown
    assert "commit 2be0c0e" in markdown
    # The verification table flags torch_native's synthetic mismatch, the cells mark it.
    assert re.search(r"\| torch_native \| 5.00e-02 \| .* \| NO \|", markdown)
    assert " !" in markdown
    assert "- `sdpa_efficient` at decode B=16 L=4096" in markdown


def test_files_are_written_with_safe_names_and_the_json_round_trips(result, tmp_path):
    files = write_outputs(result, str(tmp_path))
    names = sorted(os.listdir(tmp_path))
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", n) for n in names)
    stem = output_stem(result)
    assert stem == "bench_NVIDIA-H200-synthetic_2026-12-04"
    assert {f"{stem}.json", f"{stem}.md"} <= set(names)
    with open(tmp_path / f"{stem}.json") as f:
        assert json.load(f)["rows"] == json.loads(json.dumps(result["rows"]))
    if "notes" in result:  # matplotlib missing: said, not silently dropped
        assert result["notes"][0].startswith("plots skipped: matplotlib unavailable")
    else:
        assert sorted(os.path.basename(f) for f in files if f.endswith(".png")) == [
            "decode_tbps.png"
        ]


def test_plots_are_drawn_from_the_sweeps(result, tmp_path):
    pytest.importorskip("matplotlib")
    from report import render_plots

    assert [os.path.basename(p) for p in render_plots(result, str(tmp_path))] == ["decode_tbps.png"]
    assert (tmp_path / "decode_tbps.png").stat().st_size > 10_000


def test_gpu_names_become_file_names():
    assert safe_name("NVIDIA H200 (synthetic)") == "NVIDIA-H200-synthetic"


def test_a_peer_that_is_not_installed_prints_so_not_as_an_error():
    from report import progress_line

    missing = decode_row("flashinfer_fa2", 16, 4096, None, family="flashinfer")
    missing["error"] = "skipped: flashinfer not installed (No module named 'flashinfer')"
    line = progress_line(missing)
    assert "not installed: flashinfer not installed (No module named 'flashinfer')" in line
    assert "ERROR" not in line
    by_design = decode_row("sdpa_math", 16, 4096, None, family="sdpa")
    by_design["error"] = "skipped: math materializes S x S scores (S > 4096)"
    assert "skipped: math materializes" in progress_line(by_design)
    assert "ERROR" in progress_line(decode_row("cuda_ps16", 16, 4096, None))  # a failure is one
