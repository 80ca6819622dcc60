"""The mission in one device call (issue 35): train with the real CLI under DeepSpeed ZeRO-2, score the checkpoint
with the plain `lm_eval` command line, write the model card from those scores.

Stages, each a subprocess with its command, exit status, seconds and log recorded in `<results>/mission.json`
(rewritten after every stage, so a killed call keeps what was done; a rerun skips the stages that passed):

1. train:  `python -m torch.distributed.run --nproc_per_node N -m ultramem.training --deepspeed zero2 ...`
   (`ultramem-train` itself: the console script is not installed where the clone is only on PYTHONPATH; torchrun
   even for one process, since DeepSpeed's init_distributed reads the launcher's variables). The Trainer's torch
   AdamW, no DeepSpeed optimizer section: nothing is compiled (DS_BUILD_OPS=0; the GPU image has no nvcc).
2. eval:   `python -m lm_eval --model hf --model_args pretrained=CKPT,trust_remote_code=True,... --include_path
   ultramem/eval/tasks --tasks ultramem_<key>_offline,... --metadata '{"data_dir": ...}' --limit N`.
3. memory: the checkpoint loaded as lm_eval's `hf` model loads it (from_pretrained with trust_remote_code, the same
   dtype, on the same device); the memory implementation is the one its first memory layer resolves there.
4. card:   `ultramem.hub_cards.card.render_card` from lm_eval's results file, written to `<results>/model_card.md`
   (offline: the payload only, nothing is pushed).

    python benchmarks/gpu/mission.py            # GPU: ultramem-151m-x12, bf16, Triton kernels (the device default)
    python benchmarks/gpu/mission.py --smoke    # CPU: tiny-ultramem, gloo, 2 processes, kernels embedding_bag
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for `lib`

from lib import env, report  # noqa: E402

DATA_DIR = env.REPO / "tests" / "eval" / "fixtures" / "eval"  # the shipped offline copies (10 items a task)
TASKS = ("arc_challenge", "boolq", "winogrande", "hellaswag")
REPO_ID = "ultramem/mission"  # the card's name only; nothing is pushed
GPU = dict(
    preset="ultramem-151m-x12", nproc=1, steps=300, batch=8, block=1024, eval_every=100, limit=50, dtype="bfloat16"
)
SMOKE = dict(preset="tiny-ultramem", nproc=2, steps=4, batch=2, block=64, eval_every=2, limit=2, dtype="float32")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help=f"CPU, small sizes: {SMOKE}")
    parser.add_argument("--results-dir", type=Path, default=None,
                        help="where mission.json, the logs and the card go (default: benchmarks/results/<device>/)")  # fmt: skip
    parser.add_argument("--checkpoint-dir", type=Path, default=None,
                        help="where the run writes its checkpoint (default: /tmp/ultramem-mission; not in results)")  # fmt: skip
    for key, value in GPU.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=None,
                            help=f"default {value} (--smoke: {SMOKE[key]})")  # fmt: skip
    parser.add_argument("--tasks", default=",".join(TASKS[:3]), help="comma-separated benchmark keys (>= 3)")
    parser.add_argument("--redo", action="store_true", help="run every stage again")
    args = parser.parse_args(argv)
    for key, value in (SMOKE if args.smoke else GPU).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("nproc", "steps", "batch", "block", "eval_every", "limit"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    args.tasks = [t for t in args.tasks.split(",") if t]
    unknown = sorted(set(args.tasks) - set(TASKS))
    if unknown or len(args.tasks) < 3:
        parser.error(f"--tasks {','.join(args.tasks)}: choose at least 3 of {', '.join(TASKS)}")
    return args


def stage_commands(args: argparse.Namespace, checkpoint: Path, eval_dir: Path) -> dict[str, list[str]]:
    """The exact command lines of the subprocess stages."""
    python = sys.executable
    train = [python, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), "-m", "ultramem.training",
             "--deepspeed", "zero2", "--preset", args.preset, "--output_dir", str(checkpoint),
             "--max_steps", str(args.steps), "--per_device_train_batch_size", str(args.batch),
             "--block_size", str(args.block), "--logging_steps", str(max(1, args.steps // 50)),
             "--eval_strategy", "steps", "--eval_steps", str(args.eval_every), "--save_strategy", "no",
             "--report_to", "none", "--seed", "0"]  # fmt: skip
    if args.smoke:  # a few hundred blocks of the embedded corpus, not the whole of it, on one core
        train += ["--max_train_samples", "64", "--max_eval_samples", "4"]
    if args.dtype == "bfloat16":
        train.append("--bf16")
    model_args = f"pretrained={checkpoint},trust_remote_code=True,dtype={args.dtype}"
    evaluate = [python, "-m", "lm_eval", "--model", "hf", "--model_args", model_args,
                "--include_path", str(env.REPO / "ultramem" / "eval" / "tasks"),
                "--tasks", ",".join(f"ultramem_{t}_offline" for t in args.tasks),
                "--metadata", json.dumps({"data_dir": str(DATA_DIR)}), "--limit", str(args.limit),
                "--device", "cpu" if args.smoke else "cuda", "--batch_size", "4" if args.smoke else "16",
                "--output_path", str(eval_dir)]  # fmt: skip
    probe = [python, str(Path(__file__).resolve()), "--probe-memory", str(checkpoint), args.dtype,
             "cpu" if args.smoke else "cuda"]  # fmt: skip
    return {"train": train, "eval": evaluate, "memory": probe}


def run_stage(name: str, command: list[str], results: Path, extra_env: dict[str, str]) -> dict[str, Any]:
    """One stage as a subprocess, its output in logs/mission_<name>.log."""
    log = results / "logs" / f"mission_{name}.log"
    environment = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                       TOKENIZERS_PARALLELISM="false", **extra_env)  # fmt: skip
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(env.REPO), environment.get("PYTHONPATH")]))
    start = time.monotonic()
    with log.open("w") as handle:
        returncode = subprocess.run(command, cwd=env.REPO, env=environment, stdout=handle,
                                    stderr=subprocess.STDOUT).returncode  # fmt: skip
    print("\n".join(f"    {line}" for line in log.read_text(errors="replace").splitlines()[-8:]))
    return {"command": command, "env": extra_env, "returncode": returncode,
            "seconds": round(time.monotonic() - start, 1), "log": str(log.relative_to(results))}  # fmt: skip


def training_record(checkpoint: Path, block: int) -> dict[str, Any]:
    """What the run itself wrote: the ZeRO stage and world size of the TrainingArguments it saved, losses, speed."""
    import torch

    arguments = torch.load(checkpoint / "training_args.bin", weights_only=False)
    history = json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
    train = [entry["loss"] for entry in history if "loss" in entry]
    evaluation = [entry["eval_loss"] for entry in history if "eval_loss" in entry]
    summary = next(entry for entry in reversed(history) if "train_runtime" in entry)
    health = [entry for entry in history if any(key.startswith("memory/") for key in entry)]
    return {
        "zero_stage": arguments.hf_deepspeed_config.config["zero_optimization"]["stage"],
        "world_size": arguments.world_size,
        "bf16": arguments.bf16,
        "steps": history[-1]["step"],
        "loss_first": train[0],
        "loss_last": train[-1],
        "eval_losses": evaluation,
        "train_runtime_s": summary["train_runtime"],
        # samples are packed blocks of `block` tokens; the runtime includes the in-training evaluations
        "tokens_per_second": round(summary["train_samples_per_second"] * block, 1),
        # per-layer retrieval health (rows read, query similarity) the Trainer logged, first and last: a collapsed
        # memory trains and scores too, so the mission's record says whether its layers kept retrieving
        "memory_health_first": {k: v for k, v in (health or [{}])[0].items() if k.startswith("memory/")},
        "memory_health_last": {k: v for k, v in (health or [{}])[-1].items() if k.startswith("memory/")},
    }


def eval_record(eval_dir: Path, tasks: list[str]) -> dict[str, Any]:
    """lm_eval's newest results file and the percent score of each benchmark in it."""
    from ultramem.eval.benchmarks import select
    from ultramem.eval.report import scores_from_lm_eval

    path = max(eval_dir.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    output = json.loads(path.read_text())
    return {"results_file": str(path), "scores": scores_from_lm_eval(output, select(",".join(tasks))),
            "lm_eval_version": output.get("lm_eval_version")}  # fmt: skip


def write_card(checkpoint: Path, mission: dict[str, Any], results: Path, args: argparse.Namespace) -> Path:
    """The model card of the checkpoint with the scores lm_eval gave (the payload of a push, written, not pushed)."""
    from ultramem.eval.report import ModelResult
    from ultramem.hub_cards.card import render_card

    result = ModelResult(name=REPO_ID.split("/")[-1], checkpoint=str(checkpoint), params_b=None, flops_g=None,
                         scores=mission["eval"]["scores"], val_loss=(mission["train"]["eval_losses"] or [None])[-1])  # fmt: skip
    settings = {"lm_eval": mission["eval"]["lm_eval_version"], "data_dir": "local", "limit": float(args.limit),
                "dtype": args.dtype}  # fmt: skip
    path = results / "model_card.md"
    path.write_text(render_card(checkpoint, REPO_ID, result=result, settings=settings), encoding="utf-8")
    return path


def probe_memory(checkpoint: str, dtype: str, device: str) -> None:
    """Print the memory implementation the checkpoint resolves when loaded as lm_eval's `hf` model loads it."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True, dtype=getattr(torch, dtype))
    model.to(device).eval()
    layer = next(m for m in model.modules() if hasattr(m, "memory_ops"))
    registry = sys.modules[type(layer).__module__.rsplit(".", 1)[0] + ".memory_implementations"]
    ops = layer.memory_ops(torch.device(device))
    names = [name for name in registry.registered_memory_implementations() if registry._lookup(name) is ops]
    print(json.dumps({"memory_implementation": names[0] if names else repr(ops),
                      "configured": getattr(model.config, "_memory_implementation", None), "device": device,
                      "model_class": f"{type(model).__module__}.{type(model).__name__}"}))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run the stages not yet passed; exit 1 if any failed."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--probe-memory"]:
        probe_memory(*argv[1:4])
        return 0
    args = parse_args(argv)
    if not args.smoke:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("mission.py: no CUDA device is visible; on CPU run it with --smoke")
        device = torch.cuda.get_device_name(0)
    results = args.results_dir or env.RESULTS_DIR / env.folder_name("cpu-smoke" if args.smoke else device)
    checkpoint = (args.checkpoint_dir or Path("/tmp/ultramem-mission")).resolve() / args.preset
    (results / "logs").mkdir(parents=True, exist_ok=True)
    path = results / "mission.json"
    mission = json.loads(path.read_text()) if path.exists() and not args.redo else {}
    mission.update(versions=env.versions(), settings={k: getattr(args, k) for k in [*GPU, "tasks", "smoke"]},
                   checkpoint=str(checkpoint), stages=mission.get("stages", {}))  # fmt: skip
    commands = stage_commands(args, checkpoint, results / "lm_eval")
    stage_env = {"train": {"DS_BUILD_OPS": "0", **({"DS_ACCELERATOR": "cpu"} if args.smoke else {})}}
    for name in ("train", "eval", "memory", "card"):
        if mission["stages"].get(name, {}).get("returncode") == 0:
            continue
        print(f"=== mission: {name}", flush=True)
        if name == "card":
            start = time.monotonic()
            mission["card_path"] = str(write_card(checkpoint, mission, results, args))
            stage = {"command": "ultramem.hub_cards.card.render_card (in process)", "returncode": 0,
                     "seconds": round(time.monotonic() - start, 1)}  # fmt: skip
        else:
            stage = run_stage(name, commands[name], results, stage_env.get(name, {}))
        stage["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        mission["stages"][name] = stage
        if stage["returncode"] == 0 and name == "train":
            mission["train"] = training_record(checkpoint, args.block)
        elif stage["returncode"] == 0 and name == "eval":
            mission["eval"] = eval_record(results / "lm_eval", args.tasks)
        elif stage["returncode"] == 0 and name == "memory":
            lines = (results / stage["log"]).read_text().strip().splitlines()
            mission["memory"] = json.loads(lines[-1])
        report.write_json(path, mission)
        print(f"=== mission: {name} exit {stage['returncode']} in {stage['seconds']} s", flush=True)
        if stage["returncode"] != 0:
            return 1
    finite = all(math.isfinite(x) for x in [mission["train"]["loss_first"], mission["train"]["loss_last"]])
    print(f"mission: done; ZeRO-{mission['train']['zero_stage']} x{mission['train']['world_size']}, losses "
          f"{'finite' if finite else 'NOT FINITE'}, scores {mission['eval']['scores']}, memory "
          f"{mission['memory']['memory_implementation']}, card {mission['card_path']}")  # fmt: skip
    return 0 if finite else 1


if __name__ == "__main__":
    sys.exit(main())
