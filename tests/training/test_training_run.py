"""A single-process run through the CLI: split losses, value-LR group, diagnostics, a checkpoint users can load."""

from __future__ import annotations

import json

import pytest
import torch
from launch_support import base_args, training_logs, write_config, write_corpus
from transformers import AutoModelForCausalLM, AutoTokenizer

from ultramem.tokenization import load_tokenizer
from ultramem.training.cli import parse_args, run
from ultramem.training.data import load_raw_datasets, tokenize_and_pack

STEPS = 8


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("run")
    argv = base_args(write_config(folder), write_corpus(folder), folder / "out", max_steps=STEPS)
    return argv, folder / "out", run(argv)


def test_logs_split_losses_value_lr_and_memory_diagnostics(finished_run):
    _, output_dir, _ = finished_run
    logs = training_logs(output_dir)
    assert [entry["step"] for entry in logs] == list(range(1, STEPS + 1))
    for entry in logs:
        assert entry["loss"] == pytest.approx(entry["lm_loss"] + entry["aux_loss"], rel=1e-5)
        assert 0 < entry["aux_loss"] < 0.01
        assert 0 <= entry["memory/tdqkr_recall"] <= 1 and 0 < entry["memory/slot_usage"] <= 1
        assert entry["memory/top1_score"] > 0 and entry["memory/memory_output_std"] > 0
    multipliers = [entry["value_lr_multiplier"] for entry in logs]
    assert multipliers == pytest.approx([10.0 - 9.0 * step / (STEPS - 1) for step in range(STEPS)])
    for entry in logs[1:]:  # step 1 is the warmup step with LR 0
        assert entry["value_learning_rate"] / entry["learning_rate"] == pytest.approx(entry["value_lr_multiplier"])
    assert logs[-1]["lm_loss"] < logs[0]["lm_loss"] - 0.2
    # the settings the schedule ran with are saved beside the log, readable without unpickling training_args.bin
    state = json.loads((output_dir / "trainer_state.json").read_text())
    value_lr = state["stateful_callbacks"]["ValueLearningRate"]["args"]
    assert value_lr == {"value_lr_multiplier": 10.0, "value_lr_decay": True}


def test_checkpoint_loads_with_auto_classes_and_reproduces_the_eval_loss(finished_run):
    argv, output_dir, metrics = finished_run
    assert not [path for path in output_dir.iterdir() if path.name.startswith(".incomplete")]
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    text = "Squire Trelawney, Dr. Livesey, and the rest of these gentlemen"
    assert tokenizer(text)["input_ids"] == load_tokenizer()(text)["input_ids"]

    model = AutoModelForCausalLM.from_pretrained(output_dir, trust_remote_code=True).eval()
    _, data_args, training_args = parse_args(argv)
    blocks = tokenize_and_pack(load_raw_datasets(data_args), tokenizer, data_args, training_args.main_process_first)
    input_ids = torch.tensor(blocks["validation"]["input_ids"])
    with torch.no_grad():
        loss = model(input_ids=input_ids, labels=input_ids).loss
    assert loss.item() == pytest.approx(metrics["eval_loss"], rel=1e-5)
    assert metrics["perplexity"] == pytest.approx(torch.exp(loss).item(), rel=1e-4)


def test_gradient_accumulation_matches_the_full_batch(tmp_path):
    """The aux loss counts once per optimizer step, however the batch is split into micro-batches.

    A large aux weight makes a double-counted aux loss visible in the step loss. Both runs also set the value-table
    LR by its training flags: a constant 4x is what they log.
    """
    # query_norm="none": the query's batch statistics would make two micro-batches differ from their union
    config = write_config(tmp_path, aux_loss_alpha=10.0, query_norm="none")
    corpus = write_corpus(tmp_path, characters=20_000)
    common = {"max_steps": 4, "diagnostics_batch_size": 0, "value_lr_multiplier": 4, "value_lr_decay": "false"}
    run(base_args(config, corpus, tmp_path / "full", per_device_train_batch_size=4, **common))
    run(base_args(config, corpus, tmp_path / "accumulated", per_device_train_batch_size=2,
                  gradient_accumulation_steps=2, **common))  # fmt: skip
    full, accumulated = training_logs(tmp_path / "full"), training_logs(tmp_path / "accumulated")
    for key in ("loss", "lm_loss", "aux_loss"):
        assert [entry[key] for entry in accumulated] == pytest.approx([entry[key] for entry in full], rel=1e-5)
    assert full[0]["aux_loss"] > 0.01
    for entry in full + accumulated:
        assert entry["value_lr_multiplier"] == 4.0
        assert entry["step"] == 1 or entry["value_learning_rate"] / entry["learning_rate"] == pytest.approx(4.0)


def test_train_takes_the_dataclasses_the_command_line_parses(finished_run, tmp_path):
    """`ultramem.training.train` is the command line's run as a function: typed arguments in, the run's metrics and
    log out, the same numbers as `ultramem-train` with the same settings."""
    from launch_support import TINY_ULTRAMEM

    from ultramem.training import DataArguments, ModelArguments, TrainResult, UltraMemTrainingArguments, train

    argv, output_dir, metrics = finished_run
    config_file = argv[argv.index("--config_file") + 1]
    corpus = argv[argv.index("--train_file") + 1]
    assert TINY_ULTRAMEM["model_type"] == "ultramem"
    result = train(
        ModelArguments(config_file=config_file),
        DataArguments(train_file=corpus, block_size=32, max_eval_samples=8),
        UltraMemTrainingArguments(output_dir=str(tmp_path / "library"), max_steps=STEPS, per_device_train_batch_size=4,
                                  learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to="none",
                                  disable_tqdm=True, seed=7, diagnostics_batch_size=2),
    )  # fmt: skip
    assert isinstance(result, TrainResult) and result.resumed_from is None
    assert result.metrics["eval_loss"] == pytest.approx(metrics["eval_loss"], rel=1e-6)
    assert [entry["loss"] for entry in result.log_history if "loss" in entry] == pytest.approx(
        [entry["loss"] for entry in training_logs(output_dir)], rel=1e-6
    )
    assert (tmp_path / "library" / "model.safetensors").is_file()
