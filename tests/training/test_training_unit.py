"""Fast checks of the training pieces: LR multiplier, schedule groups, packing, embedded corpus, recipe defaults,
and how the Trainer treats the model's labels, losses and predictions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import get_scheduler

from ultramem.presets import get_config
from ultramem.training.arguments import DataArguments
from ultramem.training.cli import parse_args
from ultramem.training.data import load_raw_datasets, pack_blocks
from ultramem.training.errors import UsageError
from ultramem.training.schedule import VALUE_GROUP, ValueLearningRate, value_lr_multiplier, with_value_multiplier
from ultramem.training.trainer_overrides import _failed_to_write


def test_value_lr_multiplier_falls_linearly_from_start_to_one():
    factors = [value_lr_multiplier(step, 10, 10.0, True) for step in range(10)]
    assert factors[0] == 10.0 and factors[-1] == pytest.approx(1.0)
    assert all(a - b == pytest.approx(1.0) for a, b in zip(factors, factors[1:]))


def test_value_lr_multiplier_is_constant_without_decay():
    assert {value_lr_multiplier(step, 10, 4.0, False) for step in range(10)} == {4.0}


def test_only_the_value_group_gets_the_multiplier_on_top_of_the_cosine_schedule():
    dense, values = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW(
        [{"params": [dense], "ultramem_group": "decay"}, {"params": [values], "ultramem_group": VALUE_GROUP}], lr=1.0
    )
    total = 100
    base = get_scheduler(
        "cosine_with_min_lr", optimizer, num_warmup_steps=1, num_training_steps=total,
        scheduler_specific_kwargs={"min_lr_rate": 0.1},
    )  # fmt: skip
    scheduler = with_value_multiplier(base, optimizer, total, ValueLearningRate(10.0, True))
    dense_lrs, value_lrs = [], []
    for _ in range(total):
        dense_lrs.append(optimizer.param_groups[0]["lr"])
        value_lrs.append(optimizer.param_groups[1]["lr"])
        optimizer.step()
        scheduler.step()
    assert dense_lrs[0] == 0.0 and dense_lrs[1] == pytest.approx(1.0)  # one warmup step, then the peak
    assert dense_lrs[-1] == pytest.approx(0.1, abs=2e-3)  # cosine down to 10%
    for step in range(1, total):
        assert value_lrs[step] / dense_lrs[step] == pytest.approx(10.0 - 9.0 * step / (total - 1))


def test_pack_blocks_cuts_full_blocks_and_copies_labels():
    packed = pack_blocks({"input_ids": [[1, 2, 3], [4, 5, 6, 7], [8]]}, block_size=3)
    assert packed["input_ids"] == [[1, 2, 3], [4, 5, 6]]  # tokens 7 and 8 do not fill a block
    assert packed["labels"] == packed["input_ids"]
    assert packed["labels"][0] is not packed["input_ids"][0]


def test_embedded_corpus_has_disjoint_train_and_validation_books():
    raw = load_raw_datasets(DataArguments())
    train_chars = sum(len(text) for text in raw["train"]["text"])
    valid_chars = sum(len(text) for text in raw["validation"]["text"])
    assert train_chars > 5_000_000 and valid_chars > 300_000
    assert not set(raw["train"]["pg_id"]) & set(raw["validation"]["pg_id"])


def test_defaults_are_the_paper_recipe(tmp_path):
    _, data_args, args = parse_args(["--preset", "tiny-ultramem", "--output_dir", str(tmp_path)])
    assert (args.adam_beta1, args.adam_beta2, args.weight_decay) == (0.9, 0.95, 0.1)
    assert args.lr_scheduler_type == "cosine_with_min_lr" and args.lr_scheduler_kwargs == {"min_lr_rate": 0.1}
    assert args.get_warmup_steps(1000) == 10 and math.isclose(args.warmup_steps, 0.01)
    assert data_args.train_file is None  # the embedded corpus
    assert (args.value_lr_multiplier, args.value_lr_decay) == (None, None)  # unset: the paper's 10x -> 1x
    assert ValueLearningRate.resolve(args, get_config("tiny-ultramem")) == ValueLearningRate(10.0, True)


def test_value_lr_is_a_training_flag(tmp_path, capsys):
    """`--value_lr_multiplier` and `--value_lr_decay` are training arguments (the model config held them until 0.2),
    listed by `--help`; a bad multiplier is one line naming the flag."""
    _, _, args = parse_args(["--value_lr_multiplier", "4", "--value_lr_decay", "false", "--output_dir", str(tmp_path)])
    assert ValueLearningRate.resolve(args, get_config("tiny-ultramem")) == ValueLearningRate(4.0, False)
    with pytest.raises(UsageError, match=r"^--value_lr_multiplier 0.0: must be > 0$"):
        parse_args(["--value_lr_multiplier", "0", "--output_dir", str(tmp_path)])
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--value-lr-multiplier VALUE_LR_MULTIPLIER Learning rate of the memory value tables" in help_text
    assert "--value-lr-decay VALUE_LR_DECAY true: the value tables' multiplier falls linearly" in help_text


def test_a_preset_recommends_training_arguments_the_caller_can_override(tmp_path):
    """The PKM presets train their value tables at a constant LR (the decay is UltraMem's): `train()` applies that
    where the flag is unset, never over a given flag or a (deprecated) config value."""
    from ultramem.training.arguments import ModelArguments
    from ultramem.training.model_setup import apply_preset_training_arguments

    pkm = ModelArguments(preset="tiny-pkm")
    _, _, unset = parse_args(["--output_dir", str(tmp_path)])
    assert apply_preset_training_arguments(pkm, unset, get_config("tiny-pkm")) == {"value_lr_decay": False}
    assert ValueLearningRate.resolve(unset, get_config("tiny-pkm")) == ValueLearningRate(10.0, False)
    _, _, given = parse_args(["--value_lr_decay", "true", "--output_dir", str(tmp_path)])
    assert apply_preset_training_arguments(pkm, given, get_config("tiny-pkm")) == {} and given.value_lr_decay
    _, _, other = parse_args(["--output_dir", str(tmp_path)])
    assert (
        apply_preset_training_arguments(ModelArguments(preset="tiny-ultramem"), other, get_config("tiny-ultramem"))
        == {}
    )
    assert other.value_lr_decay is None


def test_a_config_with_the_deprecated_value_lr_fields_still_sets_the_trainers_value_lr(tmp_path):
    """A config.json written before 0.2 with a value LR other than the default loads with a FutureWarning, and the
    trainer keeps its meaning (here: a constant 4x) unless the training arguments say otherwise."""
    import json
    from pathlib import Path

    from transformers import AutoConfig

    from ultramem import UltraMemForCausalLM
    from ultramem.training.arguments import UltraMemTrainingArguments
    from ultramem.training.trainer import UltraMemTrainer

    fixture = Path(__file__).parents[1] / "model" / "fixtures" / "checkpoint_v0_1" / "config.json"
    saved = json.loads(fixture.read_text())
    assert (saved["value_lr_multiplier"], saved["value_lr_decay"]) == (10.0, True)  # the defaults: dropped silently
    (tmp_path / "config.json").write_text(json.dumps({**saved, "value_lr_multiplier": 4, "value_lr_decay": False}))
    with pytest.warns(FutureWarning) as warned:
        config = AutoConfig.from_pretrained(tmp_path)
    messages = sorted(str(warning.message) for warning in warned)
    assert [message.split(" is deprecated")[0] for message in messages] == [
        "UltraMemConfig.value_lr_decay",
        "UltraMemConfig.value_lr_multiplier",
    ]
    assert all("a training argument now" in message for message in messages)
    assert "value_lr" not in config.to_json_string()

    def value_lr_ratios(**flags) -> list[float]:
        args = UltraMemTrainingArguments(tmp_path, report_to="none", use_cpu=True, warmup_steps=0, **flags)
        trainer = UltraMemTrainer(model=UltraMemForCausalLM(config), args=args)
        trainer.create_optimizer_and_scheduler(num_training_steps=3)
        ratios = []
        for _ in range(3):
            lrs = {group["ultramem_group"]: group["lr"] for group in trainer.optimizer.param_groups}
            ratios.append(lrs[VALUE_GROUP] / lrs["decay"])
            trainer.optimizer.step()
            trainer.lr_scheduler.step()
        return ratios

    assert value_lr_ratios() == pytest.approx([4.0, 4.0, 4.0])
    assert value_lr_ratios(value_lr_multiplier=2.0, value_lr_decay=True) == pytest.approx([2.0, 1.5, 1.0])


def test_evaluation_is_capped_by_default(tmp_path):
    """`--max_eval_samples` defaults to a cap (evaluating every held-out block took minutes); 0 lifts it."""
    from ultramem.tokenization import load_tokenizer
    from ultramem.training.arguments import DEFAULT_MAX_EVAL_SAMPLES
    from ultramem.training.data import tokenize_and_pack

    text = tmp_path / "text.txt"
    text.write_text("one two three four five six seven eight\n" * 600)
    _, data, training = parse_args(["--preset", "tiny-dense", "--output_dir", str(tmp_path), "--train_file", str(text),
                             "--validation_file", str(text), "--block_size", "8"])  # fmt: skip
    raw, tokenizer = load_raw_datasets(data), load_tokenizer()
    blocks = tokenize_and_pack(raw, tokenizer, data, training.main_process_first)
    assert data.max_eval_samples == DEFAULT_MAX_EVAL_SAMPLES and len(blocks["validation"]) == DEFAULT_MAX_EVAL_SAMPLES
    data.max_eval_samples = 0
    assert len(tokenize_and_pack(raw, tokenizer, data, training.main_process_first)["validation"]) == len(
        blocks["train"]
    )


def test_atomic_checkpoints_are_their_own_piece(tmp_path):
    """Any Trainer gets whole-or-nothing checkpoints from `AtomicCheckpointTrainer`; the recipe trainer adds none."""
    from model_support import small_config
    from transformers import TrainingArguments

    from ultramem import UltraMemForCausalLM
    from ultramem.training.checkpointing import AtomicCheckpointTrainer
    from ultramem.training.trainer import UltraMemTrainer

    assert issubclass(UltraMemTrainer, AtomicCheckpointTrainer)
    assert not {"_save_checkpoint", "_get_output_dir"} & set(vars(UltraMemTrainer))
    ids = torch.randint(1, 97, (4, 8))
    args = TrainingArguments(tmp_path, max_steps=2, save_steps=1, save_total_limit=1, per_device_train_batch_size=2,
                             report_to="none", use_cpu=True, disable_tqdm=True)  # fmt: skip
    data = [{"input_ids": row, "labels": row} for row in ids]
    AtomicCheckpointTrainer(model=UltraMemForCausalLM(small_config()), args=args, train_dataset=data).train()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["checkpoint-2"]


@pytest.mark.parametrize("trainer_class", ["Trainer", "UltraMemTrainer"])
def test_label_smoothing_shifts_the_labels_and_keeps_the_aux_loss(trainer_class, tmp_path):
    """The Trainer's label smoother shifts labels only for models in Transformers' static causal-LM table (UltraMem
    adds itself); it computes the LM loss from the logits, so UltraMemTrainer adds the aux loss back."""
    import torch.nn.functional as F
    from model_support import small_config
    from transformers import Trainer, TrainingArguments

    from ultramem import UltraMemForCausalLM
    from ultramem.training.trainer import UltraMemTrainer

    torch.manual_seed(0)
    model = UltraMemForCausalLM(small_config(hidden_dropout=0.0, attention_dropout=0.0, aux_loss_alpha=10.0))
    args = TrainingArguments(tmp_path, label_smoothing_factor=0.1, report_to=[], use_cpu=True)
    trainer = {"Trainer": Trainer, "UltraMemTrainer": UltraMemTrainer}[trainer_class](model=model, args=args)
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which this test calls into
    input_ids = torch.randint(1, 97, (2, 8), generator=torch.Generator().manual_seed(1))
    loss = trainer.compute_loss(model, {"input_ids": input_ids, "labels": input_ids.clone()})
    logits = model(input_ids).logits
    smoothed = F.cross_entropy(logits[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten(), label_smoothing=0.1)
    aux = model.model.aux_loss()
    assert aux > 0.01
    expected = smoothed + aux if trainer_class == "UltraMemTrainer" else smoothed
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def test_trainer_predictions_are_the_logits_alone(tmp_path):
    """As for Llama: `compute_metrics` gets a (samples, T, vocab) array, not a tuple with the loss parts."""
    from datasets import Dataset
    from model_support import small_config
    from transformers import Trainer, TrainingArguments

    from ultramem import UltraMemForCausalLM

    torch.manual_seed(0)
    model = UltraMemForCausalLM(small_config())
    input_ids = torch.randint(1, 97, (3, 8), generator=torch.Generator().manual_seed(1))
    data = Dataset.from_dict({"input_ids": input_ids.tolist(), "labels": input_ids.tolist()})
    args = TrainingArguments(tmp_path, per_device_eval_batch_size=2, report_to=[], use_cpu=True)
    predictions = Trainer(model=model, args=args).predict(data).predictions
    with torch.no_grad():
        expected = model.eval()(input_ids).logits
    np.testing.assert_allclose(predictions, expected.numpy(), rtol=1e-5, atol=1e-5)


def test_memory_diagnostics_log_under_bf16_mixed_precision(tmp_path):
    """`--bf16` (Accelerate's autocast around the forward): the diagnostics' queries come out in bfloat16 while the
    keys stay float32; recomputing the exact scores from them crashed the first log ("expected scalar type Float")."""
    from model_support import small_config

    from ultramem import UltraMemForCausalLM
    from ultramem.training.arguments import UltraMemTrainingArguments
    from ultramem.training.trainer import UltraMemTrainer

    torch.manual_seed(0)
    ids = torch.randint(1, 97, (4, 8))
    args = UltraMemTrainingArguments(tmp_path, max_steps=1, logging_steps=1, per_device_train_batch_size=2, bf16=True,
                                     use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True,
                                     diagnostics_batch_size=2)  # fmt: skip
    trainer = UltraMemTrainer(model=UltraMemForCausalLM(small_config()), args=args, diagnostics_input_ids=ids[:2],
                              train_dataset=[{"input_ids": row, "labels": row} for row in ids])  # fmt: skip
    trainer.train()
    logged = next(entry for entry in trainer.state.log_history if "memory/tdqkr_recall" in entry)
    assert 0.0 < logged["memory/tdqkr_recall"] <= 1.0 and logged["memory/memory_output_std"] > 0


def test_config_overrides_take_lists_and_dicts():
    """`--config_overrides` split on every comma: list and dict fields (memory_layers, rope_parameters) could not be
    given."""
    from ultramem.training.arguments import ModelArguments
    from ultramem.training.model_setup import build_config, parse_overrides

    assert parse_overrides('a=1,b=true,c=gelu,d=[[0, 1], [1, 2]],e={"x": 1, "y": [2, 3]},f={\'z\': True},g="a,b"') == {
        "a": 1, "b": True, "c": "gelu", "d": [[0, 1], [1, 2]], "e": {"x": 1, "y": [2, 3]}, "f": {"z": True}, "g": "a,b"
    }  # fmt: skip
    overrides = 'memory_layers=[[0,1]],rope_parameters={"rope_type": "default", "rope_theta": 500.0},memory_topk=8'
    config = build_config(ModelArguments(preset="tiny-ultramem", config_overrides=overrides))
    assert [list(pair) for pair in config.memory_layers] == [[0, 1]] and config.memory_topk == 8
    assert config.rope_parameters["rope_theta"] == 500.0


def test_evaluation_blocks_are_drawn_across_the_whole_validation_set(tmp_path):
    """Evaluation read only the first `--max_eval_samples` blocks (a book's title page and contents): they are now a
    seeded sample of all of them, in file order, the same in every run."""
    from ultramem.tokenization import load_tokenizer
    from ultramem.training.data import tokenize_and_pack

    text = tmp_path / "numbers.txt"
    text.write_text("".join(f"line {n} of the validation text\n" for n in range(3000)))
    _, data, training = parse_args(["--preset", "tiny-dense", "--output_dir", str(tmp_path), "--train_file", str(text),
                                    "--validation_file", str(text), "--block_size", "16", "--max_eval_samples", "0"])  # fmt: skip
    raw, tokenizer = load_raw_datasets(data), load_tokenizer()
    every_block = [
        tuple(ids)
        for ids in tokenize_and_pack(raw, tokenizer, data, training.main_process_first)["validation"]["input_ids"]
    ]
    data.max_eval_samples = 20
    drawn = tokenize_and_pack(raw, tokenizer, data, training.main_process_first)["validation"]["input_ids"]
    positions = [every_block.index(tuple(ids)) for ids in drawn]
    assert len(positions) == 20 and positions == sorted(positions)
    assert positions != list(range(20)) and positions[-1] > len(every_block) // 2  # not the start: all of it
    again = tokenize_and_pack(raw, tokenizer, data, training.main_process_first)["validation"]["input_ids"]
    assert again == drawn
    data.eval_sample_seed = 1
    assert tokenize_and_pack(raw, tokenizer, data, training.main_process_first)["validation"]["input_ids"] != drawn


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case")
def test_bf16_without_an_accelerator_trains_on_the_cpu(tmp_path):
    """The Trainer refuses `--bf16` without an accelerator unless `--use_cpu` is given, which the README's example
    did not say: without an accelerator it now means the CPU."""
    _, _, args = parse_args(["--preset", "tiny-dense", "--output_dir", str(tmp_path), "--bf16", "true"])
    assert args.bf16 and args.use_cpu and args.device.type == "cpu"


def test_private_trainer_overrides_are_listed():
    """Every private Trainer method a trainer of `ultramem.training` overrides is in `trainer_overrides`, listed in
    `PINNED_BY` with tests that exist; everything else uses the Trainer's public methods and callbacks."""
    import inspect
    from pathlib import Path

    from transformers import Trainer

    from ultramem.training import trainer_overrides
    from ultramem.training.trainer import UltraMemTrainer

    trainer_methods = {name for name in vars(Trainer) if callable(getattr(Trainer, name))}
    private = {"create_accelerator_and_postprocess"}  # public-looking, but Trainer's internal setup
    found = set()
    for cls in UltraMemTrainer.__mro__:
        if not cls.__module__.startswith("ultramem."):
            continue
        for name in vars(cls).keys() & trainer_methods:
            if (name.startswith("_") and not name.startswith("__")) or name in private:
                assert cls.__module__ == trainer_overrides.__name__, f"{cls.__name__}.{name} overrides a private method"
                found.add((cls.__name__, name))
    assert found == set(trainer_overrides.PINNED_BY)
    repo = Path(__file__).resolve().parents[2]
    for tests in trainer_overrides.PINNED_BY.values():
        for test in tests:
            path, name = test.split("::")
            assert f"def {name}(" in (repo / path).read_text(), test
    assert inspect.getsourcefile(UltraMemTrainer.log) != inspect.getsourcefile(trainer_overrides)


def test_only_a_failed_write_becomes_a_storage_error():
    """A checkpoint save that fails on the disk is one line (StorageError); any other RuntimeError raised during the
    save (a device or a distributed error) stays what it was instead of being reported as a full disk."""
    try:
        try:
            raise RuntimeError("basic_ios::clear: iostream error")  # torch's zip writer on ENOSPC, then its cleanup
        except RuntimeError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 9344 vs 9236") from None
    except RuntimeError as error:
        assert _failed_to_write(error)
    assert _failed_to_write(OSError(28, "No space left on device"))
    assert not _failed_to_write(RuntimeError("Expected all tensors to be on the same device"))
