"""What a run of the attention benchmark writes: the JSON (every row), the Markdown tables
(decode TB/s, prefill TFLOP/s, the A/B ratios against a baseline build, verification, errors)
and the two plots. Everything here reads a result dict; nothing measures.

A result holds `env`, `method`, `args` (args["peers"]: the selected peers, in column order),
`ceilings`, `rows` (one per shape and peer), `sets` (which shape keys each table and plot uses,
in order) and, with a baseline, `ab`.
"""

from __future__ import annotations

import json
import os
import re
from typing import Dict, List, Optional, Sequence

from harness import VERIFY_TOLERANCE

AB_THRESHOLD = 0.02  # an after/before ratio further than this from 1 is flagged


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "gpu"


def md_row(cells: Sequence) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def row_key(row: dict) -> tuple:
    return (row["kind"], row["B"], row.get("L"), row.get("S"), row["Hq"], row["Hkv"], row["D"])


def index_rows(rows: List[dict]) -> Dict[tuple, Dict[str, dict]]:
    table: Dict[tuple, Dict[str, dict]] = {}
    for r in rows:
        table.setdefault(row_key(r), {})[r["peer"]] = r
    return table


def shape_label(row: dict) -> str:
    if row["kind"] == "decode":
        return f"decode B={row['B']} L={row['L']} Hq={row['Hq']} Hkv={row['Hkv']} D={row['D']}"
    s = f"T={row['T']} (ragged)" if row["S"] == "ragged" else f"S={row['S']}"
    return f"prefill B={row['B']} {s} Hq={row['Hq']} Hkv={row['Hkv']} D={row['D']}"


def progress_line(row: dict) -> str:
    """One line per finished row, printed while the run goes on: its timing, or why it did not
    run (a peer not installed, or skipped by design, says so; ERROR is for what failed)."""
    head = f"{shape_label(row):50s} {row['peer']:22s}"
    if "error" in row:
        if row["error"].startswith("skipped: "):
            reason = row["error"][len("skipped: ") :]
            return (
                f"{head} {'not installed' if ' not installed ' in reason else 'skipped'}: "
                + (reason[:140])
            )
        return f"{head} ERROR {row['error'][:140]}"
    err = row.get("rel_l2")
    err_text = f"rel_l2 {err:.1e}" if isinstance(err, float) else f"rel_l2 {err}"
    flag = "" if row.get("verified") else "  MISMATCH"
    return f"{head} {row['ms']:9.4f} ms  {err_text}{flag}"


def peer_columns(rows: List[dict], order: Sequence[str]) -> List[str]:
    """The peers present in these rows: those of `order` first, in its order."""
    present = list(dict.fromkeys(r["peer"] for r in rows))
    return [p for p in order if p in present] + [p for p in present if p not in order]


def fmt_cell(row: Optional[dict], value_key: str, pct_key: str, digits: int) -> str:
    if row is None:
        return ""
    if "error" in row:
        return "skip" if row["error"].startswith("skipped") else "err"
    mark = "" if row.get("verified") else " !"
    return f"{row[value_key]:.{digits}f} ({row[pct_key]:.0f}%){mark}"


def fmt_value(row: Optional[dict], value_key: str, digits: int) -> str:
    if row is None:
        return ""
    if "error" in row:
        return "skip" if row["error"].startswith("skipped") else "err"
    return f"{row[value_key]:.{digits}f}" + ("" if row.get("verified") else " !")


# --------------------------------------------------------------------------------------------
# A/B against a baseline build
# --------------------------------------------------------------------------------------------
def ab_comparison(result: dict, threshold: float = AB_THRESHOLD) -> List[dict]:
    """Per shape of every table and each baseline peer measured there: the after/before ratio of
    rates (= the baseline's median time over this build's), and whether it lies within
    +-threshold of 1. A pair where either side raised carries the error instead."""
    table = index_rows(result["rows"])
    keys: List[tuple] = []
    for set_name in ("decode", "decode_sweep", "prefill", "prefill_sweep"):
        for key in result["sets"].get(set_name, []):
            if tuple(key) not in keys:
                keys.append(tuple(key))
    comparisons = []
    for key in keys:
        cells = table.get(key, {})
        for before in cells.values():
            after = cells.get(before.get("partner") or "")
            if after is None:
                continue
            entry = dict(
                kind=after["kind"],
                shape=shape_label(after),
                key=list(key),
                peer=after["peer"],
                baseline_peer=before["peer"],
            )
            if "ms" in after and "ms" in before:
                ratio = before["ms"] / after["ms"]
                entry.update(
                    after_ms=after["ms"],
                    before_ms=before["ms"],
                    ratio=ratio,
                    within=abs(ratio - 1) <= threshold,
                    verified=bool(after.get("verified") and before.get("verified")),
                )
            else:
                entry["error"] = after.get("error") or before.get("error")
            comparisons.append(entry)
    return comparisons


def render_ab(result: dict) -> List[str]:
    ab = result.get("ab")
    if not ab:
        return []
    baseline = result["env"].get("baseline") or {}
    threshold = result.get("ab_threshold", AB_THRESHOLD)
    commit = baseline.get("commit")
    lines = [
        "## After / before: this build against the baseline build",
        "",
        f"`*_before` runs the same call through `torch.ops.{baseline.get('namespace')}.attention`"
        f" of `{baseline.get('lib') or 'this library'}`"
        + (f" (commit {commit})" if commit else "")
        + ", over the same pool; each pair is timed interleaved in this process. after/before ="
        " this build's rate over the baseline's (> 1: faster now); `outside` marks a row more "
        f"than {threshold:.0%} from 1.",
        "",
    ]
    head = ["shape", "peer", "after ms", "before ms", "after/before", ""]
    lines += [md_row(head), md_row(["---"] * len(head))]
    measured = [e for e in ab if "ratio" in e]
    for e in ab:
        if "ratio" not in e:
            cells = [e["shape"], e["peer"], "err", "err", "", (e.get("error") or "")[:80]]
        else:
            flag = "" if e["within"] else "**outside**"
            if not e["verified"]:
                flag = (flag + " unverified").strip()
            cells = [
                e["shape"],
                e["peer"],
                f"{e['after_ms']:.4f}",
                f"{e['before_ms']:.4f}",
                f"{e['ratio']:.3f}",
                flag,
            ]
        lines.append(md_row([c.replace("|", "/") if isinstance(c, str) else c for c in cells]))
    within = sum(1 for e in measured if e["within"])
    lines += [
        "",
        f"{within} of {len(measured)} measured rows within {threshold:.0%}"
        + (
            f"; {len(ab) - len(measured)} without a pair of timings."
            if len(ab) > len(measured)
            else "."
        ),
        "",
    ]
    return lines


# --------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------
def render_markdown(result: dict) -> str:
    env, ceil = result["env"], result["ceilings"]
    build = env.get("astrai_build") or {}
    rows = result["rows"]
    order = result.get("args", {}).get("peers", [])
    lines = [
        f"# astrai attention benchmark: {env['gpu']}, {env['date'][:10]}",
        "",
        f"Command: `{env['command']}`"
        + (f" (tree at {env['commit']})" if env.get("commit") else ""),
        "",
        f"torch {env['torch']}, CUDA {env['cuda']}, cuDNN {env.get('cudnn')}, driver "
        f"{env.get('driver')}, {env.get('sms')} SMs; astrai library built for torch "
        f"{build.get('torch_version', '?')}, archs {build.get('cuda_archs', '?')}.",
        "",
        f"Ceilings measured in this run: device-to-device copy **{ceil['copy_TBps']:.2f} TB/s** "
        f"(read + written), bf16 {ceil.get('matmul_shape', [8192])[0]}^3 matmul "
        f"**{ceil['matmul_TFLOPs']:.0f} TFLOP/s**.",
        "",
        f"Timing: {result.get('method', {}).get('timing', '?')}.",
        "",
        "Cells: value (% of this run's ceiling); `!` = output differs from the float32 "
        f"reference by more than {VERIFY_TOLERANCE:g} rel L2 (FP8 peers: their own tolerance, "
        "in the JSON); `err` = the peer raised (see Errors); `skip` = not run by design.",
        "",
    ]
    sets = result["sets"]
    table = index_rows(rows)

    decode_rows = [r for r in rows if r["kind"] == "decode"]
    if decode_rows:
        peers = peer_columns(decode_rows, order)
        any_decode = decode_rows[0]
        lines += [
            "## Decode: effective TB/s (% of copy)",
            "",
            f"One query token per sequence, D={any_decode['D']}, Hq={any_decode['Hq']}; K/V pages "
            "from a shuffled pool (astrai, FlashInfer), contiguous [B, H, L, D] (SDPA). Bytes = "
            "K+V of the live tokens + q + output; `floor us` = those bytes at the copy ceiling.",
            "",
        ]
        head = ["B", "Hkv", "L", "floor us"] + peers
        lines += [md_row(head), md_row(["---"] * len(head))]
        for key in sets.get("decode", []):
            cells = table.get(tuple(key), {})
            r0 = next(iter(cells.values()), None)
            if r0 is None:
                continue
            lines.append(
                md_row(
                    [r0["B"], r0["Hkv"], r0["L"], f"{r0['floor_us']:.1f}"]
                    + [fmt_cell(cells.get(p), "TBps", "pct_copy", 2) for p in peers]
                )
            )
        sweep = sets.get("decode_sweep", [])
        if sweep:
            first = table.get(tuple(sweep[0]), {})
            r0 = next(iter(first.values()), any_decode)
            lines += ["", f"Context sweep (B={r0['B']}, Hkv={r0['Hkv']}), TB/s:", ""]
            head = ["L"] + peers
            lines += [md_row(head), md_row(["---"] * len(head))]
            for key in sweep:
                cells = table.get(tuple(key), {})
                if cells:
                    length = next(iter(cells.values()))["L"]
                    lines.append(
                        md_row([length] + [fmt_value(cells.get(p), "TBps", 2) for p in peers])
                    )
        lines.append("")

    prefill_rows = [r for r in rows if r["kind"] == "prefill"]
    if prefill_rows:
        peers = peer_columns(prefill_rows, order)
        lines += [
            "## Prefill: TFLOP/s (% of matmul)",
            "",
            (
                "Causal, bf16; FLOPs = 2*B*H*S*S*D (square); "
                if all(r.get("causal", True) for r in prefill_rows)
                else "Non-causal, bf16; FLOPs = 4*B*H*S*S*D (square); "
            )
            + "ragged rows count the visible "
            "(query, key) pairs * 4*D*H. astrai and FlashInfer: one paged call (page 16, "
            "shuffled pool); SDPA: contiguous [B, H, S, D].",
            "",
        ]
        head = ["B", "Hq", "Hkv", "S", "D"] + peers
        lines += [md_row(head), md_row(["---"] * len(head))]
        for key in sets.get("prefill", []):
            cells = table.get(tuple(key), {})
            r0 = next(iter(cells.values()), None)
            if r0 is None:
                continue
            s_text = (
                f"ragged T={r0['T']}, kv<={r0['max_kv_len']}" if r0["S"] == "ragged" else r0["S"]
            )
            lines.append(
                md_row(
                    [r0["B"], r0["Hq"], r0["Hkv"], s_text, r0["D"]]
                    + [fmt_cell(cells.get(p), "TFLOPs", "pct_matmul", 0) for p in peers]
                )
            )
        sweep = sets.get("prefill_sweep", [])
        if sweep:
            first = table.get(tuple(sweep[0]), {})
            r0 = next(iter(first.values()), prefill_rows[0])
            lines += [
                "",
                f"Sequence sweep (B={r0['B']}, Hq={r0['Hq']}, Hkv={r0['Hkv']}, D={r0['D']}), "
                "TFLOP/s:",
                "",
            ]
            head = ["S"] + peers
            lines += [md_row(head), md_row(["---"] * len(head))]
            for key in sweep:
                cells = table.get(tuple(key), {})
                if cells:
                    seq = next(iter(cells.values()))["S"]
                    lines.append(
                        md_row([seq] + [fmt_value(cells.get(p), "TFLOPs", 0) for p in peers])
                    )
        ragged = [r for r in prefill_rows if r["S"] == "ragged"]
        if ragged:
            r0 = ragged[0]
            lines += [
                "",
                f"Ragged mix: prefixes {r0['prefix_lens']}, chunks {r0['chunk_lens']}; SDPA peers "
                "loop over sequences with a bool lower-right causal mask, sdpa_default with "
                "torch's causal_lower_right bias.",
            ]
        lines.append("")

    lines += render_ab(result)

    verified = [r for r in rows if "rel_l2" in r]
    if verified:
        lines += ["## Verification (rel L2 vs float32 reference, worst shape per peer)", ""]
        worst: Dict[str, dict] = {}
        for r in verified:
            value = r["rel_l2"] if isinstance(r["rel_l2"], float) else float("inf")
            if r["peer"] not in worst or value > worst[r["peer"]]["value"]:
                worst[r["peer"]] = dict(value=value, row=r)
        lines += [
            md_row(["peer", "worst rel L2", "at", "all within tolerance"]),
            md_row(["---"] * 4),
        ]
        for peer, w in worst.items():
            ok = all(r.get("verified") for r in verified if r["peer"] == peer)
            lines.append(
                md_row([peer, f"{w['value']:.2e}", shape_label(w["row"]), "yes" if ok else "NO"])
            )
        lines.append("")

    errors = [r for r in rows if "error" in r and not r["error"].startswith("skipped: math")]
    if result.get("shape_errors") or result.get("notes"):
        lines += ["## Shapes that failed before any peer ran, and notes", ""]
        lines += [f"- {e['shape']}: {e['error']}" for e in result.get("shape_errors", [])]
        lines += [f"- {note}" for note in result.get("notes", [])]
        lines.append("")
    if errors:
        lines += ["## Errors (first shape per peer and message)", ""]
        seen = set()
        for r in errors:
            key = (r["peer"], r["error"][:80])
            if key in seen:
                continue
            seen.add(key)
            count = sum(1 for e in errors if (e["peer"], e["error"][:80]) == key)
            message = r["error"][:300].replace("|", "/")
            lines.append(f"- `{r['peer']}` at {shape_label(r)} ({count} shape(s)): {message}")
        lines.append("")
    lines.append(
        f"Elapsed {result.get('elapsed_s', 0):.0f} s; "
        f"peak GPU memory {result.get('peak_memory_GB', 0):.1f} GB."
    )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------
PLOT_STYLES = {"astrai": "-o", "astrai_before": ":o", "flashinfer": "-.^"}  # others: "--s"


def render_plots(result: dict, out_dir: str) -> List[str]:
    """decode_tbps.png and prefill_tflops.png from the sweep sets; returns the files written
    (none, with a note in result['notes'], when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        result.setdefault("notes", []).append(f"plots skipped: matplotlib unavailable ({exc})")
        return []
    table = index_rows(result["rows"])
    order = result.get("args", {}).get("peers", [])
    env = result["env"]
    written = []
    specs = [
        ("decode_sweep", "L", "TBps", "copy_TBps", "copy ceiling", "decode_tbps.png"),
        ("prefill_sweep", "S", "TFLOPs", "matmul_TFLOPs", "matmul ceiling", "prefill_tflops.png"),
    ]
    for set_name, x_key, y_key, ceil_key, ceil_label, file_name in specs:
        keys = result["sets"].get(set_name, [])
        rows = [r for key in keys for r in table.get(tuple(key), {}).values()]
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
        for peer in peer_columns(rows, order):
            points = [(r[x_key], r[y_key]) for r in rows if r["peer"] == peer and y_key in r]
            if points:
                family = next(r.get("family") for r in rows if r["peer"] == peer)
                ax.plot(
                    [p[0] for p in points],
                    [p[1] for p in points],
                    PLOT_STYLES.get(family, "--s"),
                    label=peer,
                    markersize=4,
                )
        ceiling = result["ceilings"][ceil_key]
        ax.axhline(
            ceiling, color="black", linestyle="--", linewidth=1, label=f"{ceil_label} {ceiling:.3g}"
        )
        ax.set_xscale("log", base=2)
        ticks = sorted({r[x_key] for r in rows})
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(t) for t in ticks])
        ax.set_ylim(0, 1.1 * max(max(line.get_ydata()) for line in ax.lines))
        r0 = rows[0]
        if set_name == "decode_sweep":
            ax.set_xlabel("context length L (tokens)")
            ax.set_ylabel("effective TB/s (K+V+q+out bytes / time)")
            ax.set_title(
                f"Decode, B={r0['B']}, Hq={r0['Hq']}, Hkv={r0['Hkv']}, D={r0['D']}, bf16 - "
                f"{env['gpu']}"
            )
        else:
            ax.set_xlabel("sequence length S (tokens)")
            ax.set_ylabel("TFLOP/s (2*B*H*S*S*D / time)")
            ax.set_title(
                f"Causal prefill, B={r0['B']}, Hq={r0['Hq']}, Hkv={r0['Hkv']}, D={r0['D']}, "
                f"bf16 - {env['gpu']}"
            )
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
        fig.text(0.01, 0.01, env["command"], fontsize=6, color="gray")
        fig.tight_layout(rect=(0, 0.03, 1, 1))
        path = os.path.join(out_dir, file_name)
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------
def output_stem(result: dict) -> str:
    return f"bench_{safe_name(result['env']['gpu'])}_{result['env']['date'][:10]}"


def write_json(result: dict, out_dir: str) -> str:
    """The result as JSON, replaced atomically (the driver rewrites it after every shape, so a
    run that dies part-way leaves what it measured)."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, output_stem(result) + ".json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1, allow_nan=False, default=str)
    os.replace(tmp, path)
    return path


def write_outputs(result: dict, out_dir: str) -> List[str]:
    os.makedirs(out_dir, exist_ok=True)
    plots = render_plots(result, out_dir)
    md_path = os.path.join(out_dir, output_stem(result) + ".md")
    with open(md_path, "w") as f:
        f.write(render_markdown(result))
    json_path = write_json(result, out_dir)
    return [json_path, md_path] + plots
