"""The GPU campaign: one resumable command that checks the kernels, measures the speed claims and compares quality.

GPU time comes in short slots (a command may run 10 minutes, a session holds the GPU about 30), so the campaign
is a fixed list of steps, each with its own time limit, run in order under a total budget:

    python benchmarks/gpu_campaign.py                # on the GPU machine; run it again until it says "complete"
    python benchmarks/gpu_campaign.py --smoke        # the same driver on CPU at tiny sizes (tested in CI)

Everything lands in `benchmarks/results/<device>/` (`nvidia-h100-80gb-hbm3/`, ...): each step's JSON/PNG,
its log in `logs/`, and `campaign.json` with the device, the package versions and every step's exact command,
exit status and duration. A step that ran is not run again (`--redo NAME` forces it), except the quality step,
which resumes its own runs when it was stopped by its time limit. Before a step starts, the driver checks that
at least half its limit is left of `--budget-s` (a step cut short by the budget runs again); if not it stops
cleanly, and the next invocation resumes there.
Nothing is installed at run time: bring wheels for missing packages (see benchmarks/SPEED.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
TIMED_OUT = 124


@dataclass(frozen=True)
class Step:
    """One command of the campaign: `script` (a file in benchmarks/) with `args`, stopped after `seconds`."""

    name: str
    seconds: int
    script: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    resumable: bool = False  # a step stopped by its limit runs again next time (it skips what it recorded)

    def command(self, results: Path) -> list[str]:
        return [sys.executable, str(BENCHMARKS / self.script), *[arg.format(results=results) for arg in self.args]]


def gpu_steps() -> list[Step]:
    """The campaign on a CUDA device, in order: correctness first, then speed, then quality."""
    decode = ["--device", "cuda", "--moe-impl", "grouped_mm", "--results-dir", "{results}"]
    return [
        Step("check_gpu", 240, "check_gpu.py", ["--results-dir", "{results}"]),
        Step("bench_kernels", 200, "bench_kernels.py", ["--device", "cuda", "--out-dir", "{results}"]),
        Step("decode_680m", 280, "bench_decode.py",
             [*decode, "--sizes", "680m", "--batch-sizes", "1,4,16,64", "--name", "decode_680m"]),  # fmt: skip
        Step("scaling", 200, "bench_scaling.py", [*decode, "--size", "680m", "--batch", "16"]),
        Step("train_151m", 200, "bench_train.py",
             ["--device", "cuda", "--sizes", "151m", "--batch", "16", "--seq-len", "2048", "--results-dir", "{results}"]),  # fmt: skip
        Step("quality_small", 540, "bench_quality.py",
             ["--scale", "small", "--rows", "comparison", "--seeds", "2", "--seeded-rows", "all", "--bf16",
              "--max-steps", "300", "--batch-size", "32", "--block-size", "512", "--learning-rate", "1e-3",
              "--eval-points", "6", "--eval-blocks", "64", "--output-dir", "{results}",
              "--cache-dir", "{results}/quality_cache"],
             resumable=True),  # fmt: skip
        Step("decode_1.6b", 280, "bench_decode.py",
             [*decode, "--sizes", "1.6b", "--batch-sizes", "1,4,16", "--name", "decode_1.6b"]),  # fmt: skip
        # issue 11 on a GPU: ultramem-1.6b-x12 (a 44 GB checkpoint, built here, deleted after) with its tables in
        # pinned host memory against the same model fully on the GPU; a rerun reuses a checkpoint left by a cut one
        Step("offload_1.6b", 540, "bench_offload.py",
             ["--device", "cuda", "--checkpoints", "/tmp/ultramem_offload_checkpoints", "--build", "--cleanup",
              "--runs", "gpu-resident,cpu-offload", "--batch-sizes", "1,8", "--results-dir", "{results}",
              "--name", "offload"]),  # fmt: skip
    ]


def smoke_steps() -> list[Step]:
    """The same steps on CPU at tiny sizes, the kernels in Triton's interpreter: the driver itself, in about two
    minutes of one idle core (the limits leave room for a loaded machine)."""
    timing = ["--device", "cpu", "--warmup", "0", "--iters", "1", "--no-plot", "--results-dir", "{results}"]
    return [
        Step("check_gpu", 600, "check_gpu.py", ["--smoke", "--results-dir", "{results}"], {"TRITON_INTERPRET": "1"}),
        Step("decode_tiny", 300, "bench_decode.py",
             [*timing, "--sizes", "tiny", "--batch-sizes", "1", "--context", "8", "--moe-impl", "eager"]),  # fmt: skip
        Step("train_tiny", 300, "bench_train.py", [*timing, "--batch", "1", "--seq-len", "16", "--moe-impl", "eager"]),
        Step("quality_tiny", 600, "bench_quality.py",
             ["--scale", "tiny", "--rows", "Dense,UltraMem", "--seeds", "1", "--max-steps", "2", "--batch-size", "2",
              "--block-size", "32", "--eval-points", "1", "--eval-blocks", "2", "--output-dir", "{results}",
              "--cache-dir", "{results}/quality_cache"],
             resumable=True),  # fmt: skip
    ]


def device_name(smoke: bool) -> str:
    """The GPU's name as `nvidia-smi` gives it (CPU in smoke mode)."""
    if smoke:
        return "cpu-smoke"
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_campaign.py: no CUDA device is visible; on CPU run it with --smoke")
    return torch.cuda.get_device_name(0)


def folder_name(device: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9.]+", "-", device.lower()).strip("-")


def environment() -> dict[str, str]:
    """Versions and the GPU as nvidia-smi reports it, recorded once per campaign folder."""
    import torch
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = "not installed"
    try:
        query = "name,memory.total,driver_version,clocks.max.sm"
        smi = ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"]
        info["nvidia_smi"] = subprocess.run(smi, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        info["nvidia_smi"] = "unavailable"
    return info


def load_state(path: Path, device: str) -> dict:
    if path.exists():
        return json.loads(path.read_text())
    return {"device": device, "environment": environment(), "steps": {}}


def pending(steps: list[Step], state: dict, redo: set[str]) -> list[Step]:
    """The steps still to run: never run, forced by --redo, cut short by the budget, or resumable and stopped."""
    done = state["steps"]
    return [
        step
        for step in steps
        if step.name not in done
        or step.name in redo
        or done[step.name]["cut_by_budget"]
        or (step.resumable and done[step.name]["returncode"] == TIMED_OUT)
    ]


def run_step(step: Step, results: Path, seconds: float) -> dict:
    """Run one step for at most `seconds`; its output goes to logs/<name>.log, and its last lines are printed."""
    command = step.command(results)
    log = results / "logs" / f"{step.name}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **step.env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    start = time.monotonic()
    with log.open("w") as handle:
        # its own process group, killed whole at the limit: a step's workers (bench_offload's run processes) must
        # not go on holding the GPU while the next step is timed
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # fmt: skip
        try:
            returncode = process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            returncode = TIMED_OUT
    tail = log.read_text(errors="replace").splitlines()[-15:]
    print("\n".join(f"    {line}" for line in tail))
    return {
        "returncode": returncode,
        "seconds": round(time.monotonic() - start, 1),
        "limit_s": step.seconds,
        "cut_by_budget": returncode == TIMED_OUT and seconds < step.seconds,
        "command": " ".join(command),
        "env": step.env,
        "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, Triton's interpreter")
    parser.add_argument("--budget-s", type=int, default=560,
                        help="stop before a step whose limit would overrun this many seconds (default 560: one "
                        "10-minute command with room to copy the results back)")  # fmt: skip
    parser.add_argument("--results-root", type=Path, default=BENCHMARKS / "results",
                        help="the campaign writes into <results-root>/<device>/")  # fmt: skip
    parser.add_argument("--redo", default="", help="comma-separated step names to run again")
    parser.add_argument("--only", default="", help="comma-separated step names to consider (default: all)")
    args = parser.parse_args(argv)
    steps = smoke_steps() if args.smoke else gpu_steps()
    names = [step.name for step in steps]
    for flag in ("redo", "only"):
        unknown = set(filter(None, getattr(args, flag).split(","))) - set(names)
        if unknown:
            parser.error(f"--{flag} {','.join(sorted(unknown))}: allowed step names are {', '.join(names)}")
    if args.budget_s < 1:
        parser.error(f"--budget-s must be >= 1, got {args.budget_s}")
    only = set(filter(None, args.only.split(",")))
    args.steps = [step for step in steps if not only or step.name in only]
    return args


def main(argv: list[str] | None = None) -> int:
    """Run what is pending within the budget; exit status 1 if any step recorded so far failed."""
    args = parse_args(argv)
    device = device_name(args.smoke)
    results = args.results_root / folder_name(device)
    (results / "logs").mkdir(parents=True, exist_ok=True)
    state_path = results / "campaign.json"
    state = load_state(state_path, device)
    state_path.write_text(json.dumps(state, indent=1))  # the device and versions, even if no step runs
    start = time.monotonic()
    todo = pending(args.steps, state, set(filter(None, args.redo.split(","))))
    print(f"gpu_campaign: {device}, results in {results}; {len(todo)} step(s) to run: {', '.join(s.name for s in todo)}")
    for step in todo:
        left = args.budget_s - (time.monotonic() - start)
        if left < step.seconds / 2:  # most steps end well inside their limit; one cut short runs again next time
            print(f"gpu_campaign: stopping before {step.name} (limit {step.seconds} s, {left:.0f} s of the budget "
                  "left); run the same command again to go on")  # fmt: skip
            break
        print(f"=== {step.name} (limit {min(step.seconds, int(left))} s)", flush=True)
        state["steps"][step.name] = run_step(step, results, min(step.seconds, left))
        state_path.write_text(json.dumps(state, indent=1))  # after every step: a killed campaign keeps the rest
        outcome = state["steps"][step.name]
        print(f"=== {step.name}: exit {outcome['returncode']} in {outcome['seconds']} s", flush=True)
    remaining = pending(args.steps, state, set())
    failed = sorted(name for name, outcome in state["steps"].items() if outcome["returncode"] != 0)
    print(f"gpu_campaign: {'complete' if not remaining else f'{len(remaining)} step(s) left'}"
          f"{'; failed: ' + ', '.join(failed) if failed else ''}")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
