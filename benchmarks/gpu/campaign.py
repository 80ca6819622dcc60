"""The GPU campaign: the kernels checked on the device, then the speed claims measured, planned for short device calls.

A GPU is lent for about 15 minutes in all (its start and every idle wait included), one command at most 10. The
campaign is a fixed list of steps, each with its own time limit, grouped into calls; every call is one device
command (see benchmarks/gpu/README.md for the plan and the seconds per step):

    python benchmarks/gpu/kit.py          # here, once: the wheels the GPU image lacks, into .whl/ (it prints the line)
    python3 -m pip install --no-index --no-deps --target /tmp/ultramem-kit .whl/*.whl \
        && PYTHONPATH=/tmp/ultramem-kit:$PWD python3 benchmarks/gpu/campaign.py --call 1   # on the GPU: 540 s
    PYTHONPATH=/tmp/ultramem-kit:$PWD python3 benchmarks/gpu/campaign.py --call 2          # the next call: 240 s
    python benchmarks/gpu/campaign.py --smoke      # the same driver on CPU at tiny sizes, kernels interpreted (CI)

Call 1: correctness (never skipped), kernel bandwidth, decoding at 680M. Call 2: the 151M training step and decode
latency as the memory grows 16x. Calls 3-5: quality at "small", decoding at 1.6B, offloading at 1.6B. Call 8: the mission (train with
DeepSpeed, lm_eval, model card; benchmarks/gpu/mission.py).
Everything lands in `benchmarks/results/<device>/`: each step's JSON/PNG the moment it exists, its log in `logs/`,
`campaign.json` (device, versions, every step's exact command, exit status and duration) and README.md, the targets
read as met or missed from what has been measured so far. A step that ran is not run again (`--redo NAME` forces
it); a step cut short by the budget runs again, and the quality step resumes its own runs. Before a step starts the
driver checks that at least half its limit is left of the call's budget; if not it stops, and the next invocation
goes on there. Nothing is installed at run time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: `lib`, and this folder as `gpu`

from lib import env, report  # noqa: E402

from gpu import targets  # noqa: E402

TIMED_OUT = 124
# Seconds of the call's device limit the driver may spend (the rest: the kit's install, interpreter start-up, copying
# the results back).
CALL_BUDGETS = {
    1: 500,
    2: 220,
    3: 540,
    4: 500,
    5: 540,
    6: 540,
    7: 500,
    8: 440,
    9: 500,
    10: 500,
    11: 300,
    12: 500,
    13: 150,
}


@dataclass(frozen=True)
class Step:
    """One command of the campaign: `line` (a script under benchmarks/ and its flags; "{results}" is the results folder),
    stopped after `seconds`."""

    name: str
    call: int
    seconds: int
    line: str
    env: dict[str, str] = field(default_factory=dict)
    resumable: bool = False  # a step stopped by its limit runs again next time (it skips what it recorded)

    @property
    def script(self) -> str:
        return self.line.split()[0]

    @property
    def args(self) -> list[str]:
        return self.line.split()[1:]

    def command(self, results: Path) -> list[str]:
        return [sys.executable, str(env.BENCHMARKS / self.script), *[a.format(results=results) for a in self.args]]


OUT = "--results-dir {results}"
DECODE = f"--device cuda --mode eager --moe-impl grouped_mm --warmup 3 --iters 10 {OUT}"
GRAPHS = DECODE.replace("--mode eager", "--mode compile")  # the same step under CUDA graphs
QUALITY = "--results-dir {results} --cache-dir {results}/quality_cache"
TRAIN_151M = (
    "bench_train.py --device cuda --sizes 151m --batch 16 --seq-len 2048 --moe-impl grouped_mm --warmup 2 --iters 5"
)


def decode_680m(mode: str, batches: str, flags: str) -> str:
    """bench_decode.py's dense / UltraMem / MoE comparison at 680M in `mode` (DECODE or GRAPHS) at `batches`."""
    return f"bench_decode.py {mode} --sizes 680m --batch-sizes {batches} --analytic-sizes 680m {flags}"


def gpu_steps() -> list[Step]:
    """The campaign on a CUDA device, in call order. Estimated seconds (before any GPU run) in benchmarks/gpu/README.md."""
    return [
        # call 1 (540 s): correctness, kernel bandwidth, decoding at 680M
        Step("check_gpu", 1, 200, f"gpu/check.py {OUT}"),
        Step("bench_kernels", 1, 120, f"bench_kernels.py --device cuda --ops lookup_reduce --configs 680m --dtypes "
             f"bfloat16 --tokens 4096,16384,65536 --own-shape-only --iters 10 {OUT}"),
        Step("decode_680m", 1, 180, decode_680m(DECODE, "1,16,64", "--name decode_680m")),
        # call 2 (240 s): the 151M training step, decode latency as slots grow 16x
        Step("train_151m", 2, 110, f"{TRAIN_151M} --name train_151m {OUT}"),
        Step("scaling_680m", 2, 110, f"bench_scaling.py {DECODE} --size 680m --batch 16 --slots 1048576,4194304,16777216 "
             "--name scaling_680m"),
        # later calls, each a further slot. Call 7: decoding at 680M under CUDA graphs (torch.compile
        # "reduce-overhead"); the eager steps of call 1 are launch-bound (the first GPU run: 16 ms a dense step,
        # ~15 us a launch), so this is the comparison the paper's memory-access claim is about
        Step("decode_680m_graphs", 7, 400, decode_680m(GRAPHS, "1,16,64", "--name decode_680m_graphs")),
        Step("scaling_680m_graphs", 7, 240, f"bench_scaling.py {GRAPHS} --size 680m "
             "--batch 16 --slots 1048576,4194304,16777216 --name scaling_680m_graphs"),
        Step("quality_small", 3, 540, "bench_quality.py --scale small --rows comparison --seeds 2 --seeded-rows all "
             "--bf16 --max-steps 300 --batch-size 32 --block-size 512 --learning-rate 1e-3 --eval-points 6 "
             f"--eval-blocks 64 {QUALITY}", resumable=True),
        # call 4: the decode comparison at the paper's 1.6B, under CUDA graphs (eager steps are launch-bound)
        Step("decode_1.6b_graphs", 4, 450, f"bench_decode.py {GRAPHS} --sizes 1.6b "
             "--batch-sizes 1,4,16 --analytic-sizes 1.6b --name decode_1.6b_graphs"),
        Step("bench_quantized_kernel", 4, 120, "bench_kernels.py --device cuda --ops quantized_lookup_reduce --configs "
             f"680m,1.6b --dtypes bfloat16 --rows 1048576 --tokens 1024,4096,16384 --name quantized_kernel {OUT}"),
        Step("bench_lookup_dot", 4, 90, "bench_kernels.py --device cuda --ops lookup_dot --configs 680m --dtypes "
             f"bfloat16 --tokens 4096,16384,65536 --iters 10 --name lookup_dot {OUT}"),
        # issue 11 on a GPU: ultramem-1.6b-x12 (a 44 GB checkpoint, built here, deleted after) with its tables in
        # pinned host memory against the same model fully on the GPU; a rerun reuses a checkpoint left by a cut one
        Step("offload_1.6b", 5, 540, "bench_offload.py --device cuda --checkpoints /tmp/ultramem_offload_checkpoints "
             f"--build --cleanup --runs gpu-resident,cpu-offload --batch-sizes 1,8 --name offload {OUT}"),
        # the memory-layer family at equal parameters (docs/variants.md): the comparison rows are call 3's runs (the
        # results are shared and resumed), so this trains UltraMemV2, V2 without PEER and Memory+
        Step("quality_variants_small", 6, 540, "bench_quality.py --scale small --rows all --seeds 2 --seeded-rows "
             "all --bf16 --max-steps 300 --batch-size 32 --block-size 512 --learning-rate 1e-3 --eval-points 6 "
             f"--eval-blocks 64 {QUALITY}", resumable=True),
        # call 8 (480 s, the kit's install included): the mission (issue 35), ultramem-train under DeepSpeed ZeRO-2,
        # lm_eval on its checkpoint, the model card (benchmarks/gpu/mission.py; mission.json)
        Step("mission", 8, 440, "gpu/mission.py --results-dir {results}"),
        # call 9 (issue 34): where the decode step's time goes, split from profiler traces (lib/step_account.py):
        # under CUDA graphs the totals (kernels, copies, gaps, host) and what runs outside the graph; eager, the share
        # of each memory layer
        Step("decode_680m_account", 9, 330, decode_680m(GRAPHS, "1,16", "--account 20 --name decode_680m_account")),
        Step("decode_680m_account_eager", 9, 150, decode_680m(DECODE, "1,16", "--account 5 "
             "--name decode_680m_account_eager")),
        # call 10 (issue 34): `generate` as users call it, default and static cache (Transformers compiles the latter)
        Step("generate_680m", 10, 480, "bench_generate.py --device cuda --sizes 680m --batch-sizes 1,16 --moe-impl "
             f"grouped_mm {OUT} --name generate_680m"),
        # call 11 (issue 34): TDQKR's selection at inference (reference, unfused kernels, one kernel) at decode to
        # prefill sizes
        Step("selection_680m", 11, 90, "bench_kernels.py --device cuda --ops tucker_candidate_topk,tucker_topk "
             f"--configs 680m --dtypes bfloat16 --tokens 1,16,64,4096 --iters 20 --name selection_680m {OUT}"),
        # and the kernels the compiled decode step launches per memory layer (at most 6), counted in Inductor's code
        Step("decode_kernels_680m", 11, 180, f"decode_kernels.py --size 680m --device cuda {OUT}"),
        # call 12 (issue 34): the decode step under CUDA graphs with the Triton path as it ships, then with the opt-in
        # one-kernel selection, each against dense and MoE in its own run
        Step("decode_680m_graphs_unfused", 12, 230, decode_680m(GRAPHS, "1,16", "--name decode_680m_graphs_unfused")),
        Step("decode_680m_graphs_fused_selection", 12, 230, decode_680m(GRAPHS, "1,16", "--fused-selection "
             "--name decode_680m_graphs_fused_selection")),
        # call 13 (issue 34, item 6): call 2's training step with the one-kernel selection (run it after train_151m)
        Step("train_151m_fused_selection", 13, 110, f"{TRAIN_151M} --fused-selection --name train_151m_fused_selection "
             f"{OUT}"),
    ]  # fmt: skip


def smoke_steps() -> list[Step]:
    """The same calls on CPU at tiny sizes, the kernels in Triton's interpreter: the driver itself, and every script
    the GPU steps run, in a few minutes of one core (the limits leave room for a loaded machine)."""
    timing = f"--device cpu --warmup 0 --iters 1 --no-plot {OUT} --moe-impl eager"
    decode = f"bench_decode.py {timing} --sizes tiny --batch-sizes 1 --context 8 --analytic-sizes tiny"
    train = f"bench_train.py {timing} --batch 1 --seq-len 16"
    return [
        Step("check_gpu", 1, 600, f"gpu/check.py --smoke {OUT}", {"TRITON_INTERPRET": "1"}),
        Step("bench_kernels", 1, 300, f"bench_kernels.py --device cpu --smoke {OUT}"),
        Step("bench_quantized_kernel", 1, 300, f"bench_kernels.py --device cpu --smoke --ops quantized_lookup_reduce "
             f"--name quantized_kernel_cpu {OUT}", {"TRITON_INTERPRET": "1"}),
        Step("bench_lookup_dot", 1, 300, f"bench_kernels.py --device cpu --smoke --ops lookup_dot --name lookup_dot_cpu {OUT}"),
        Step("decode_tiny", 1, 300, f"{decode} --name decode_tiny"),
        Step("train_tiny", 2, 300, f"{train} --name train_tiny"),
        Step("scaling_tiny", 2, 300, f"bench_scaling.py {timing} --slots 16384,65536 --batch 1 --context 8 "
             "--name scaling_tiny"),
        Step("quality_tiny", 3, 600, "bench_quality.py --scale tiny --rows Dense,UltraMem --seeds 1 --max-steps 2 "
             f"--batch-size 2 --block-size 32 --eval-points 1 --eval-blocks 2 {QUALITY}", resumable=True),
        Step("mission", 8, 400, "gpu/mission.py --smoke --results-dir {results} --checkpoint-dir {results}/checkpoints"),
        Step("decode_account_tiny", 9, 300, f"{decode} --account 2 --name decode_account_tiny"),
        Step("generate_tiny", 10, 300, f"bench_generate.py {timing} --sizes tiny --batch-sizes 1 --prompt 8 "
             "--new-tokens 3 --name generate_tiny"),
        Step("decode_fused_selection_tiny", 12, 300, f"{decode} --fused-selection --name decode_fused_selection_tiny"),
        Step("train_fused_selection_tiny", 13, 300, f"{train} --fused-selection --name train_fused_selection_tiny"),
    ]  # fmt: skip


def device_name(smoke: bool) -> str:
    """The GPU's name as torch gives it ('cpu-smoke' in smoke mode)."""
    if smoke:
        return "cpu-smoke"
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("campaign.py: no CUDA device is visible; on CPU run it with --smoke")
    return torch.cuda.get_device_name(0)


def load_state(path: Path, device: str) -> dict:
    if path.exists():
        return json.loads(path.read_text())
    return {"device": device, "environment": {**env.versions(), "nvidia_smi": env.nvidia_smi()}, "steps": {}}


def pending(steps: list[Step], state: dict, redo: set[str]) -> list[Step]:
    """The steps still to run: never run, forced by --redo, failed (a failure is fixed on CPU before the next slot, so
    its rerun comes first), cut short by the budget, or resumable and stopped. A step that used its whole own limit
    runs again only under --redo: it would be cut again."""
    done = state["steps"]
    return [
        step
        for step in steps
        if step.name not in done
        or step.name in redo
        or done[step.name]["returncode"] not in (0, TIMED_OUT)
        or done[step.name]["cut_by_budget"]
        or (step.resumable and done[step.name]["returncode"] == TIMED_OUT)
    ]


def run_step(step: Step, results: Path, seconds: float) -> dict:
    """Run one step for at most `seconds`; its output goes to logs/<name>.log, and its last lines are printed."""
    command = step.command(results)
    log = results / "logs" / f"{step.name}.log"
    environment = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **step.env)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [environment.get("PYTHONPATH"), str(env.REPO)]))
    start = time.monotonic()
    with log.open("w") as handle:
        # its own process group, killed whole at the limit: a step's workers (bench_offload's run processes) must
        # not go on holding the GPU while the next step is timed
        process = subprocess.Popen(command, cwd=env.REPO, env=environment, stdout=handle, stderr=subprocess.STDOUT,
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
        "call": step.call,
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
    parser.add_argument("--call", type=int, choices=sorted(CALL_BUDGETS), default=None,
                        help="run this call's steps only, within its budget (default: every pending step in order)")  # fmt: skip
    parser.add_argument("--budget-s", type=int, default=None,
                        help="stop before a step whose limit would overrun this many seconds (default: the call's "
                        f"budget, {CALL_BUDGETS}; 560 without --call)")  # fmt: skip
    parser.add_argument("--results-root", type=Path, default=env.RESULTS_DIR,
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
    args.budget_s = args.budget_s if args.budget_s is not None else CALL_BUDGETS.get(args.call, 560)
    if args.budget_s < 1:
        parser.error(f"--budget-s must be >= 1, got {args.budget_s}")
    only = set(filter(None, args.only.split(",")))
    args.steps = [s for s in steps if (not only or s.name in only) and (args.call is None or s.call == args.call)]
    return args


def main(argv: list[str] | None = None) -> int:
    """Run what is pending within the budget; exit status 1 if any step recorded so far failed."""
    args = parse_args(argv)
    device = device_name(args.smoke)
    results = args.results_root / env.folder_name(device)
    (results / "logs").mkdir(parents=True, exist_ok=True)
    state_path = results / "campaign.json"
    state = load_state(state_path, device)
    report.write_json(state_path, state)  # the device and versions, even if no step runs
    start = time.monotonic()
    todo = pending(args.steps, state, set(filter(None, args.redo.split(","))))
    print(
        f"gpu_campaign: {device}, results in {results}; {len(todo)} step(s) to run: {', '.join(s.name for s in todo)}"
    )
    for step in todo:
        left = args.budget_s - (time.monotonic() - start)
        if left < step.seconds / 2:  # most steps end well inside their limit; one cut short runs again next time
            print(f"gpu_campaign: stopping before {step.name} (limit {step.seconds} s, {left:.0f} s of the budget "
                  "left); run the same command again to go on")  # fmt: skip
            break
        print(f"=== {step.name} (call {step.call}, limit {min(step.seconds, int(left))} s)", flush=True)
        state["steps"][step.name] = run_step(step, results, min(step.seconds, left))
        report.write_json(state_path, state)  # after every step: a killed campaign keeps the rest
        targets.write_readme(results, state)
        outcome = state["steps"][step.name]
        print(f"=== {step.name}: exit {outcome['returncode']} in {outcome['seconds']} s", flush=True)
    remaining = pending(smoke_steps() if args.smoke else gpu_steps(), state, set())
    failed = sorted(name for name, outcome in state["steps"].items() if outcome["returncode"] != 0)
    left_calls = sorted({s.call for s in remaining})
    print(f"gpu_campaign: {'complete' if not remaining else f'{len(remaining)} step(s) left (calls {left_calls})'}"
          f"{'; failed: ' + ', '.join(failed) if failed else ''}")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
