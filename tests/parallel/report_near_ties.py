"""Where sharded and one-process training part, and why (issue 49; docs/memory_parallel.md): the setup of
test_memory_parallel_training.py (number-wise tables, torchrun, 10 steps) with a checkpoint after every step. At the
first step whose losses differ beyond float32 noise, both runs' models before that step are compared over every
training block: the memory layers' picks that differ, each one's margin, the score noise, and the noise again with the
sharded model given the one-process run's query statistics.

    python tests/parallel/report_near_ties.py batch_whiten      # or none; about 2 minutes
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from launch_support import (  # noqa: E402
    LAUNCHERS,
    base_args,
    python_module,
    run_command,
    training_logs,
    write_config,
    write_corpus,
)
from selection_support import compare_selections  # noqa: E402
from transformers import AutoConfig, AutoTokenizer  # noqa: E402

from ultramem import UltraMemForCausalLM  # noqa: E402

STEPS = 10


def main(query_norm: str) -> None:
    folder = Path(tempfile.mkdtemp(prefix="near-ties-"))
    config, corpus = write_config(folder, aux_loss_alpha=10.0, query_norm=query_norm), write_corpus(folder)
    torch.manual_seed(7)
    UltraMemForCausalLM(AutoConfig.for_model(**json.loads(config.read_text()))).save_pretrained(folder / "start")

    def argv(name: str, batch: int, **flags) -> list[str]:
        args = base_args(config, corpus, folder / name, max_steps=STEPS, per_device_train_batch_size=batch,
                         diagnostics_batch_size=0, model_name_or_path=folder / "start", save_strategy="steps",
                         save_steps=1, **flags)  # fmt: skip
        at = args.index("--config_file")
        return args[:at] + args[at + 2 :]

    run_command(python_module("ultramem.training", *argv("single", 4)), timeout=600)
    command, flags = LAUNCHERS["torchrun"]
    run_command([*command, "ultramem.training", *argv("number", 2, memory_parallel="number"), *flags], timeout=600)
    differences = [
        b["loss"] - a["loss"] for a, b in zip(training_logs(folder / "single"), training_logs(folder / "number"))
    ]
    parted = next((step for step, difference in enumerate(differences, 1) if abs(difference) > 1e-5), None)
    print(f"query_norm={query_norm}, ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', 'native')}")
    print("loss differences by step:", " ".join(f"{difference:.1e}" for difference in differences))
    print("first step beyond 1e-5:", parted or "none")
    step = (parted or STEPS + 1) - 1  # the models both runs started that step from (the last ones if none)
    single, sharded = (
        UltraMemForCausalLM.from_pretrained(folder / run / f"checkpoint-{step}") for run in ("single", "number")
    )
    weights = max((p - q).abs().max().item() for p, q in zip(single.parameters(), sharded.parameters()))
    print(f"largest weight difference after step {step}: {weights:.1e}")
    ids = AutoTokenizer.from_pretrained(folder / "single")(corpus.read_text())["input_ids"]
    blocks = torch.tensor(ids[: len(ids) // 32 * 32]).reshape(-1, 32)
    for training in (True, False):
        found = compare_selections(single, sharded, blocks, training=training)
        print(f"{'training' if training else 'inference'} forward over {blocks.shape[0]} blocks: {len(found.margins)} "
              f"picks differ at (layer, block, token) {found.flipped}; exact-score margins "
              f"{[f'{margin:.1e}' for margin in found.margins]}; score noise {found.score_noise:.1e}")  # fmt: skip
    if query_norm != "none":  # do the statistics add noise of their own? give the sharded model the other's
        sharded.load_state_dict({k: v for k, v in single.state_dict().items() if ".across_tokens." in k}, strict=False)
        found = compare_selections(single, sharded, blocks)
        print(f"inference, the one-process statistics in both: {len(found.margins)} picks differ, "
              f"score noise {found.score_noise:.1e}")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "batch_whiten")
