"""Issue 22's targets read from a campaign's results folder: README.md with each target met, missed or not measured.

Rewritten by the campaign after every step, so the folder always says what it shows; the reasons for a miss are
for the person who reads the numbers (add them below the generated table, under "Reading").
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

Reading = tuple[str, bool] | None  # (what was measured, met?) or None when not measured yet


def _load(folder: Path, *stems: str) -> dict[str, Any] | None:
    """The first of `stems` (file names without .json, glob patterns allowed) that exists in `folder`."""
    for stem in stems:
        for path in sorted(folder.glob(f"{stem}.json")):
            return json.loads(path.read_text())
    return None


def correctness(folder: Path) -> Reading:
    report = _load(folder, "check_gpu_*")
    if not report or not report.get("rows"):
        return None
    failed = [
        f"{r['check']} ({r.get('dtype', '')}, {r['error']:.1e} > {r['tolerance']:.0e})"
        for r in report["rows"]
        if not r["passed"]
    ]
    text = f"{len(report['rows']) - len(failed)}/{len(report['rows'])} comparisons within tolerance"
    return text + (": failed " + "; ".join(failed) if failed else ""), not failed


def _kernel_summary(folder: Path) -> list[dict[str, Any]]:
    report = _load(folder, "bench_kernels_*")
    return report.get("summary", []) if report else []


def bandwidth(folder: Path) -> Reading:
    rows = [r for r in _kernel_summary(folder) if r["forward_pct_of_copy"] is not None]
    if not rows:
        return None
    worst = min(rows, key=lambda r: r["forward_pct_of_copy"])
    each = ", ".join(f"{r['tokens']}: {r['forward_pct_of_copy']:.0f}%" for r in rows)
    return f"lowest {worst['forward_pct_of_copy']:.0f}% ({worst['config']} {worst['dtype']}; by tokens {each})", worst[
        "forward_pct_of_copy"
    ] >= 60


def fwd_bwd_speedup(folder: Path) -> Reading:
    rows = [r for r in _kernel_summary(folder) if r["fwd_bwd_speedup_vs_torch"] is not None]
    if not rows:
        return None
    worst = min(rows, key=lambda r: r["fwd_bwd_speedup_vs_torch"])
    bags = [r["fwd_bwd_speedup_vs_embedding_bag"] for r in rows if r["fwd_bwd_speedup_vs_embedding_bag"]]
    bag = f"; vs embedding_bag {min(bags):.2f}x-{max(bags):.2f}x" if bags else ""
    return f"lowest {worst['fwd_bwd_speedup_vs_torch']:.2f}x at {worst['tokens']} tokens{bag}", worst[
        "fwd_bwd_speedup_vs_torch"
    ] >= 3


def _mode(report: dict[str, Any]) -> str:
    """How a decode or scaling run's steps ran: "CUDA graphs" (`--mode compile`) or "eager"."""
    return "CUDA graphs" if report["settings"]["mode"] == "compile" else "eager"


def _ratios(folder: Path) -> tuple[list[dict[str, Any]], str]:
    """The decode ratios, from the CUDA-graph run where there is one, else the eager run; and which it was."""
    report = _load(folder, "decode_680m_graphs", "decode_680m", "decode_tiny")
    if not report:
        return [], ""
    return [r for r in report["ratios"] if r["ultramem/dense"] is not None], _mode(report)


def _mode_note(row: dict[str, Any], mode: str) -> str:
    """How the step ran, and under CUDA graphs which models' steps did not become one graph (> 1 launch a replay)."""
    split = [kind for kind in ("dense", "ultramem", "moe") if (row.get(f"{kind}_ops") or 0) > 1]
    if mode != "CUDA graphs" or not split:
        return mode
    return f"{mode}; {', '.join(split)} not one graph ({', '.join(str(row[f'{k}_ops']) for k in split)} launches)"


def decode_vs_dense(folder: Path) -> Reading:
    ratios, mode = _ratios(folder)
    rows = [r for r in ratios if r["batch"] <= 64]
    if not rows:
        return None
    worst = max(rows, key=lambda r: r["ultramem/dense"])
    each = ", ".join(f"batch {r['batch']}: {r['ultramem/dense']:.2f}" for r in rows)
    return f"highest {worst['ultramem/dense']:.2f} ({each}; {_mode_note(worst, mode)})", worst["ultramem/dense"] <= 1.15


def moe_vs_ultramem(folder: Path) -> Reading:
    ratios, mode = _ratios(folder)
    row = next((r for r in ratios if r["moe/ultramem"] is not None and r["batch"] == 16), None)
    if row is None:
        return None
    analytic = row.get("analytic moe/ultramem")
    note = _mode_note(row, mode)
    return f"{row['moe/ultramem']:.2f}x (memory-access model: {analytic:.2f}x; {note})", row["moe/ultramem"] >= 3


def train_step(folder: Path) -> Reading:
    report = _load(folder, "train_151m", "train_tiny")
    row = (
        next((r for r in report["rows"] if r["kind"] == "ultramem" and r.get("step_vs_dense")), None)
        if report
        else None
    )
    if row is None:
        return None
    return f"{row['step_vs_dense']:.2f} ({row['ms']:.1f} ms per step)", row["step_vs_dense"] <= 1.3


def slot_scaling(folder: Path) -> Reading:
    report = _load(folder, "scaling_680m_graphs", "scaling_680m", "scaling_tiny")
    if not report or report.get("ultramem_latency_spread") is None:
        return None
    grown = report["settings"]["range"]
    met = report["ultramem_latency_spread"] <= 0.10 and grown >= 16
    return f"{100 * report['ultramem_latency_spread']:.1f}% over {grown:.0f}x slots ({_mode(report)})", met


TARGETS: list[tuple[str, Callable[[Path], Reading]]] = [
    ("Correctness: every check within tolerance (fp32 1e-5, bf16 1e-2), generation token for token", correctness),
    ("Fused lookup-reduce forward >= 60% of measured copy bandwidth at >= 4,096 tokens", bandwidth),
    ("Lookup-reduce forward+backward >= 3x faster than the PyTorch path", fwd_bwd_speedup),
    ("Decode UltraMem / dense <= 1.15 at every batch up to 64 (680M)", decode_vs_dense),
    ("Decode MoE / UltraMem >= 3x at batch 16 (680M)", moe_vs_ultramem),
    ("Train step UltraMem / dense <= 1.3 (151M)", train_step),
    ("Decode latency within 10% as slots grow 16x", slot_scaling),
]


READING = "\n## Reading"


def write_readme(folder: Path, state: dict[str, Any]) -> Path:
    """README.md of a campaign folder: the device, the targets' readings, and every step's command and outcome."""
    lines = [f"# GPU campaign: {state['device']}", "", "Versions: " + ", ".join(f"{k} {v}" for k, v in state["environment"].items()), "",
             "| Target | Measured | Met |", "|---|---|---|"]  # fmt: skip
    for target, read in TARGETS:
        try:
            reading = read(folder)
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as error:  # a half-written or older result
            reading = (f"unreadable: {type(error).__name__}: {error}", False)
        measured, met = reading if reading else ("not measured yet", None)
        lines.append(f"| {target} | {measured} | {'-' if met is None else 'met' if met else '**missed**'} |")
    lines += ["", "| Step | Call | Exit | Seconds (limit) | Command |", "|---|---|---|---|---|"]
    for name, step in state["steps"].items():
        lines.append(
            f"| {name} | {step.get('call', '-')} | {step['returncode']} | {step['seconds']} ({step['limit_s']}) | `{step['command']}` |"
        )
    lines += ["", "Generated by `benchmarks/gpu/campaign.py` after every step (logs in `logs/`, each step's JSON and PNG "
              "beside this file). Reading: why a target was met or missed goes below, under a `## Reading` heading, "
              "which the next step's rewrite keeps.", ""]  # fmt: skip
    path = folder / "README.md"
    kept = path.read_text().partition(READING)[1:] if path.is_file() else ("", "")
    path.write_text("\n".join(lines) + "".join(kept))
    return path
