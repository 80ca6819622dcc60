"""Reliability in figures (issue 46): training SIGKILLed at seeded random points and resumed, and writes that meet a
full disk.

Kills: a tiny UltraMem run (tests/launch_support.py's config and corpus) is launched with `lib/faults.py`, which
SIGKILLs it at a point drawn from those still ahead (alternately within a step and within a checkpoint write), then
relaunched with `--resume_from_checkpoint true` (from scratch while no checkpoint exists) and killed again,
`--kills` times, then resumed to the end. The final weights and the loss curve are compared with an uninterrupted
run's; figures: kills, resumes, steps lost (steps done that the next launch had to redo). Once in one process, once
under DeepSpeed ZeRO-2 with 2 CPU processes (gloo).

Full disk (`lib/faults.on_small_disk`, a size-limited tmpfs in a private mount namespace): (a) in the one-process
chain, the launch after the first kill runs on a disk with room for half a checkpoint more (its next save fails; the
next launch resumes), (b) `python -m ultramem.quantize` into a disk with room for its precheck's byte count but not
for the files' page-rounded size, (c) `set_value_store("disk")` writing two tables to a disk that holds one and a
half. Each records the exit status, the error line(s) and what was left.
"""

from __future__ import annotations

import json
import random
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers.trainer_utils import get_last_checkpoint

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the training tests' tiny config, corpus, flags and launchers

from launch_support import (  # noqa: E402
    base_args,
    child_env,
    losses,
    python_module,
    run_command,
    write_config,
    write_corpus,
)
from lib.cli import make_parser, resolve  # noqa: E402
from lib.env import RESULTS_DIR  # noqa: E402
from lib.faults import KILL_POINT, SAVE_PHASES, on_small_disk  # noqa: E402
from lib.report import finish, format_table  # noqa: E402

FAULTS = str(REPO / "benchmarks" / "lib" / "faults.py")
DEEPSPEED = ["deepspeed", "--num_gpus", "2"]
GLOBAL_BATCH = 4


def training_flags(config: Path, corpus: Path, output: Path, steps: int, save_every: int, processes: int,
                   **extra: Any) -> list[str]:  # fmt: skip
    """The flags of one tiny deterministic run (`processes` share the global batch; 2 run under ZeRO-2)."""
    deepspeed = {"deepspeed": "zero2"} if processes > 1 else {}
    return base_args(config, corpus, output, max_steps=steps, save_strategy="steps", save_steps=save_every,
                     per_device_train_batch_size=GLOBAL_BATCH // processes, diagnostics_batch_size=0,
                     **deepspeed, **extra)  # fmt: skip


def launch(script: list[str], flags: list[str], processes: int, timeout: int, check: bool = True):
    """`script` (`-m ultramem.training` or the faults wrapper) with `flags`, in one process or under `deepspeed`."""
    if processes == 1:
        return run_command([sys.executable, *script, *flags], timeout=timeout, check=check)
    script = ["--module", script[1]] if script[0] == "-m" else script
    return run_command([*DEEPSPEED, *script, *flags], timeout=timeout, check=check, DS_ACCELERATOR="cpu")


def last_checkpoint(output: Path) -> Path | None:
    """The checkpoint a resume continues from: the Trainer's own choice (`get_last_checkpoint`)."""
    found = get_last_checkpoint(output) if output.is_dir() else None
    return Path(found) if found else None


def step_of(checkpoint: Path | None) -> int:
    return int(checkpoint.name.split("-")[1]) if checkpoint else 0


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def same_checkpoint(checkpoint: Path, reference: Path) -> bool:
    """Whether `checkpoint` holds the files of `reference` (the uninterrupted run's of that step), with the same
    weights and optimizer state byte for byte: whole, and what a resume from it needs."""
    names = sorted(path.name for path in checkpoint.iterdir())
    return names == sorted(path.name for path in reference.iterdir()) and all(
        (checkpoint / name).read_bytes() == (reference / name).read_bytes()
        for name in ("model.safetensors", "optimizer.pt")
    )


def kill_chain(straight: Path, config: Path, corpus: Path, *, kills: int, full_disk: bool, seed: int, steps: int,
               save_every: int, processes: int, timeout: int) -> dict[str, Any]:  # fmt: skip
    """`kills` launches SIGKILLed at seeded random points, each continued by the next (with `full_disk`, the launch
    after the first kill runs on a disk with room for half a checkpoint more), then a last launch to the end; the
    result against `straight`, the uninterrupted run of the same flags, beside which the interrupted one is written."""
    output = straight.with_name(f"interrupted-{processes}p")
    draw = random.Random(seed)
    plan = ["SIGKILL"] * kills
    if full_disk:
        plan.insert(1, "full disk")
    events = []
    for interruption in plan:
        checkpoint = last_checkpoint(output)
        flags = training_flags(config, corpus, output, steps, save_every, processes,
                               **({"resume_from_checkpoint": "true"} if checkpoint else {}))  # fmt: skip
        started = time.perf_counter()
        event = {"interruption": interruption, "started_from_step": step_of(checkpoint)}
        if interruption == "full disk":
            room = folder_bytes(straight / f"checkpoint-{save_every}") // 2
            result = on_small_disk(python_module("ultramem.training", *flags), output, folder_bytes(output) + room, cwd=REPO,
                                   env=child_env())  # fmt: skip
            last = last_checkpoint(output)
            event |= {"exit_status": result.returncode, "error_lines": error_lines(result.stderr),
                      "left": sorted(path.name for path in output.iterdir()),
                      "last_checkpoint_intact": same_checkpoint(last, straight / last.name) if last else None}  # fmt: skip
            failed = re.search(r"could not write \S*checkpoint-(\d+)", result.stderr)
            stopped_after = int(failed[1]) if failed else step_of(last)  # the steps before the save that failed
        else:
            killed_before = sum(event["interruption"] == "SIGKILL" for event in events)
            where = ("step", "save")[killed_before % 2]  # alternately within a step and within a checkpoint write
            killed = launch([FAULTS, str(draw.randrange(2**31)), where], flags, processes, timeout, check=False)
            point = KILL_POINT.search(killed.stderr)
            assert killed.returncode != 0 and point, f"the launch was not killed:\n{killed.stderr[-3000:]}"
            step, phase = int(point[1]), point[2]
            stopped_after = step if phase in SAVE_PHASES else step - 1  # a step in progress is lost
            event |= {"killed_at_step": step, "phase": phase,
                      "left_incomplete": sorted(path.name for path in output.glob(".incomplete-*"))}  # fmt: skip
        events.append(event | {"steps_lost": stopped_after - step_of(last_checkpoint(output)),
                               "seconds": time.perf_counter() - started})  # fmt: skip
    checkpoint = last_checkpoint(output)
    flags = training_flags(config, corpus, output, steps, save_every, processes,
                           **({"resume_from_checkpoint": "true"} if checkpoint else {}))  # fmt: skip
    launch(["-m", "ultramem.training"], flags, processes, timeout)
    starts = [event["started_from_step"] for event in events[1:]] + [step_of(checkpoint)]
    return {"launcher": "deepspeed zero2, 2 processes" if processes > 1 else "one process", "kills": kills,
            "full_disk_failures": int(full_disk), "relaunches": len(starts),
            "resumed_from_a_checkpoint": sum(start > 0 for start in starts),
            "steps_lost": sum(event["steps_lost"] for event in events), "events": events,
            **compare(straight, output)}  # fmt: skip


def compare(straight: Path, resumed: Path) -> dict[str, Any]:
    """The largest differences of the final weights and of the per-step losses, and whether every step was logged."""
    expected, got = losses(straight), losses(resumed)
    final_a, final_b = load_file(str(straight / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    return {
        "logged_steps_match": sorted(got) == sorted(expected),
        "max_loss_difference": max(abs(got[step] - loss) for step, loss in expected.items() if step in got),
        "max_weight_difference": max((final_a[key] - final_b[key]).abs().max().item() for key in final_a),
        "same_weight_names": sorted(final_a) == sorted(final_b),
    }


def error_lines(stderr: str) -> list[str]:
    """The lines of a failed command's output that say it failed (one is the target; a traceback has dozens)."""
    return [line for line in stderr.splitlines() if line.startswith(("ultramem-train: error", "error:", "Traceback"))
            or "Error" in line.split(":")[0]]  # fmt: skip


def disk_quantize(source: Path, folder: Path) -> dict[str, Any]:
    """(b) The int8 converter into a disk with room for the bytes of its output (measured by a conversion on the real
    disk) plus 4 KiB: its free-space precheck passes, but files take whole pages, so the write runs out of room part
    way. Nothing that would load may be left. `source` is a checkpoint of a model with memory layers."""
    from ultramem.quantize import convert

    written = convert(source, folder / "int8-reference", "int8")
    needed = sum(path.stat().st_size for path in written.iterdir())
    output = folder / "full-disk-quantize"
    result = on_small_disk(python_module("ultramem.quantize", str(source), str(output / "int8"), "--format", "int8"),
                           output, needed + 4096, cwd=REPO, env=child_env())  # fmt: skip
    left = sorted(str(path.relative_to(output)) for path in output.rglob("*"))
    return {"case": "quantize --format int8", "exit_status": result.returncode, "error_lines": error_lines(result.stderr),
            "left": left, "loads": (output / "int8" / "config.json").is_file()}  # fmt: skip


# (c): a model with two memory layers written to the disk store; the disk holds one table and a half.
OFFLOAD_WRITE = """
import sys, torch
from transformers import AutoConfig
from ultramem import UltraMemForCausalLM
config = AutoConfig.for_model(**__import__("json").loads(open(sys.argv[1]).read()))
model = UltraMemForCausalLM(config)
try:
    model.set_value_store("disk", directory=sys.argv[2])
except Exception as error:
    sys.exit(f"error: {error}")
"""


def disk_offload(folder: Path, config: Path) -> dict[str, Any]:
    """(c) `set_value_store("disk", directory=...)` on a disk with room for one table and a half of the second."""
    from transformers import AutoConfig

    from ultramem import UltraMemForCausalLM

    spec = {**json.loads(config.read_text()), "num_hidden_layers": 4, "memory_layers": [[0, 1], [2, 3]]}
    two_layers = folder / "two_memory_layers.json"
    two_layers.write_text(json.dumps(spec))
    model = UltraMemForCausalLM(AutoConfig.for_model(**spec))
    table = max(p.numel() * p.element_size() for n, p in model.named_parameters() if n.endswith("values.weight"))
    output = folder / "full-disk-offload"
    result = on_small_disk([sys.executable, "-c", OFFLOAD_WRITE, str(two_layers), str(output)], output,
                           table * 3 // 2, cwd=REPO, env=child_env())  # fmt: skip
    files = sorted(path.name for path in output.iterdir())
    return {"case": "disk value store write", "exit_status": result.returncode, "error_lines": error_lines(result.stderr),
            "left": files, "partial_left": [name for name in files if name.endswith(".partial")]}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = make_parser(__doc__, "reliability_training", device=False, timed=False, plot=False)
    parser.set_defaults(results_dir=RESULTS_DIR / "reliability")
    parser.add_argument("--kills", type=int, default=10, help="SIGKILLs in the one-process run")
    parser.add_argument("--deepspeed-kills", type=int, default=5, help="SIGKILLs under DeepSpeed ZeRO-2 (0: none)")
    parser.add_argument("--steps", type=int, default=12, help="training steps of each run")
    parser.add_argument("--save-every", type=int, default=3, help="checkpoint interval in steps")
    parser.add_argument("--seed", type=int, default=0, help="draws the kill points")
    parser.add_argument("--no-disk", action="store_true", help="skip the full-disk cases (they need --kills > 0)")
    parser.add_argument("--work-dir", type=Path, default=None, help="kept runs (default: a removed temporary folder)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds allowed to each launch")
    args = resolve(parser.parse_args(argv), "reliability_training")
    with tempfile.TemporaryDirectory(prefix="reliability-") as scratch:
        folder = args.work_dir or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        config, corpus = write_config(folder), write_corpus(folder)
        chains = []
        for processes, kills in ((1, args.kills), (2, args.deepspeed_kills)):
            if kills <= 0:
                continue
            straight = training_flags(config, corpus, folder / f"straight-{processes}p", args.steps, args.save_every,
                                      processes)  # fmt: skip
            launch(["-m", "ultramem.training"], straight, processes, args.timeout)
            chains.append(kill_chain(folder / f"straight-{processes}p", config, corpus, kills=kills, full_disk=processes == 1 and not args.no_disk,
                                     seed=args.seed + processes, steps=args.steps, save_every=args.save_every,
                                     processes=processes, timeout=args.timeout))  # fmt: skip
        disks = (
            []
            if args.no_disk or not args.kills
            else [disk_quantize(folder / "straight-1p", folder), disk_offload(folder, config)]
        )
    disk_events = [event for chain in chains for event in chain["events"] if event["interruption"] == "full disk"]
    disks = [{"case": "training checkpoint save", **event} for event in disk_events] + disks
    table = format_table(chains, ["launcher", "kills", "full_disk_failures", "relaunches", "resumed_from_a_checkpoint",
                                  "steps_lost", "max_loss_difference",
                                  "max_weight_difference"])  # fmt: skip
    table += "\n\n" + "\n".join(f"{d['case']}: exit {d['exit_status']}, {d['error_lines']}" for d in disks)
    payload = {"settings": {key: getattr(args, key) for key in ("kills", "deepspeed_kills", "steps", "save_every",
                                                                "seed")}, "kill_chains": chains, "full_disk": disks}  # fmt: skip
    finish(args, payload, table)
    return payload


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
