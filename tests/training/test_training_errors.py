"""Bad input gives one clear error line naming the culprit, before any model is built or training starts."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from launch_support import REPO, base_args, child_env, python_module, write_config, write_corpus

from ultramem import presets, sizing
from ultramem.training.cli import main


def run_and_get_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("ultramem-train: error:")]
    assert len(errors) == 1, errors
    return errors[0]


@pytest.fixture
def files(tmp_path):
    return write_config(tmp_path), write_corpus(tmp_path, characters=5_000)


def test_empty_data_file(tmp_path, files, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    error = run_and_get_error(base_args(files[0], empty, tmp_path / "out"), capsys)
    assert "--train_file" in error and "empty.txt" in error and "is empty" in error
    assert not (tmp_path / "out").exists()


def test_missing_data_file(tmp_path, files, capsys):
    error = run_and_get_error(base_args(files[0], tmp_path / "nope.jsonl", tmp_path / "out"), capsys)
    assert "--train_file" in error and "no such file" in error


def test_unreadable_data_file(tmp_path, files, capsys):
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n{"text": unquoted}\n')
    error = run_and_get_error(base_args(files[0], broken, tmp_path / "out"), capsys)
    assert "--train_file" in error and "broken.jsonl" in error and "could not be read as json" in error
    assert not (tmp_path / "out").exists()


def test_text_column_that_does_not_exist(tmp_path, files, capsys):
    data = tmp_path / "books.jsonl"
    data.write_text(json.dumps({"body": "Some text."}) + "\n")
    error = run_and_get_error(base_args(files[0], data, tmp_path / "out"), capsys)
    assert "--text_column 'text'" in error and "columns: body" in error


def test_block_size_larger_than_the_model_maximum(tmp_path, files, capsys):
    argv = ["--preset", "tiny-ultramem", "--block_size", "100000", "--output_dir", str(tmp_path / "out")]
    error = run_and_get_error(argv, capsys)
    limit = presets.get_config("tiny-ultramem").max_position_embeddings
    assert "--block_size 100000" in error and f"allowed range is 1..{limit}" in error
    assert not (tmp_path / "out").exists()


def test_config_file_that_contradicts_the_preset(tmp_path, capsys):
    config = tmp_path / "config.json"
    hidden = presets.get_config("tiny-ultramem").hidden_size
    config.write_text(json.dumps({"model_type": "ultramem", "hidden_size": 2 * hidden}))
    argv = ["--preset", "tiny-ultramem", "--config_file", str(config), "--output_dir", str(tmp_path / "out")]
    error = run_and_get_error(argv, capsys)
    assert (
        f"hidden_size={2 * hidden}" in error and f"contradicts --preset tiny-ultramem (hidden_size={hidden})" in error
    )


def test_unknown_override_field(tmp_path, capsys):
    argv = ["--preset", "tiny-ultramem", "--config_overrides", "hiden_size=8", "--output_dir", str(tmp_path / "o")]
    assert "hiden_size is not a field of UltraMemConfig" in run_and_get_error(argv, capsys)


def test_deepspeed_batch_size_that_contradicts_the_trainer(tmp_path, files):
    """In a child process: `--deepspeed` sets process-wide Accelerate/DeepSpeed state."""
    pytest.importorskip("deepspeed")  # an optional dependency (ultramem[deepspeed])
    ds_config = tmp_path / "ds.json"
    ds_config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2}}))
    argv = base_args(*files, tmp_path / "out", deepspeed=ds_config, per_device_train_batch_size=2)
    result = subprocess.run(
        python_module("ultramem.training", *argv), cwd=REPO, env=child_env(DS_ACCELERATOR="cpu"),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("ultramem-train: error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert "ds train_micro_batch_size_per_gpu=8 vs hf per_device_train_batch_size=2" in errors[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--learning_rate", "-1"], "--learning_rate -1.0: must be >= 0"),
        (["--per_device_train_batch_size", "0"], "--per_device_train_batch_size 0: must be at least 1"),
        (["--per_device_eval_batch_size", "-2"], "--per_device_eval_batch_size -2: must be at least 1"),
        (["--max_eval_samples", "-1"], "--max_eval_samples -1: must be >= 0 (0: all validation blocks)"),
        (["--config_overrides", "hidden_size=abc"], "--config_overrides: TypeError: Field 'hidden_size' expected int"),
    ],
)
def test_bad_values_are_one_line_before_tokenizing(tmp_path, flags, message, capsys, monkeypatch):
    import ultramem.training.pipeline as pipeline

    monkeypatch.setattr(pipeline, "load_raw_datasets", lambda args: pytest.fail("the data was read before the check"))
    error = run_and_get_error(["--preset", "tiny-ultramem", "--output_dir", str(tmp_path / "out"), *flags], capsys)
    assert message in error


def test_malformed_jsonl_names_the_line(tmp_path, files, capsys):
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n\n{"text": "cut off"\n{"text": "fine"}\n')
    error = run_and_get_error(base_args(files[0], broken, tmp_path / "out"), capsys)
    assert "--train_file" in error and "line 3 is not valid JSON (Expecting ',' delimiter at column 19)" in error


def test_text_shorter_than_one_block_says_how_many_tokens_it_has(tmp_path, files, capsys):
    short = tmp_path / "short.txt"
    short.write_text("Hello world.\n")
    error = run_and_get_error(base_args(files[0], short, tmp_path / "out"), capsys)
    assert "--block_size 32: the train text has only 4 tokens, less than one block; allowed range" in error


def test_a_presets_own_saved_config_is_no_contradiction(tmp_path):
    """save_pretrained adds architectures, dtype, auto_map: metadata, not a different model."""
    from ultramem.training.arguments import ModelArguments
    from ultramem.training.model_setup import build_config

    sizing.build_model(presets.get_config("tiny-dense")).save_pretrained(tmp_path / "saved")
    args = ModelArguments(preset="tiny-dense", config_file=str(tmp_path / "saved" / "config.json"))
    assert build_config(args).to_dict() == presets.get_config("tiny-dense").to_dict()


def test_deepspeed_without_a_launcher_is_one_line(tmp_path, files):
    """In a child process: one process without a launcher would fall back to MPI discovery (mpi4py) in train()."""
    pytest.importorskip("deepspeed")  # an optional dependency (ultramem[deepspeed])
    argv = base_args(*files, tmp_path / "out", deepspeed="zero2")
    result = subprocess.run(
        python_module("ultramem.training", *argv), cwd=REPO, env=child_env(DS_ACCELERATOR="cpu"),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    errors = [line for line in result.stderr.splitlines() if line.startswith("ultramem-train: error:")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
    assert "zero2.json: needs a launcher, even for one process: `deepspeed --num_gpus N" in errors[0]
    assert not (tmp_path / "out").exists()


@pytest.fixture
def checkpoint(tmp_path):
    from launch_support import TINY_ULTRAMEM
    from transformers import AutoConfig

    from ultramem import UltraMemForCausalLM

    UltraMemForCausalLM(AutoConfig.for_model(**TINY_ULTRAMEM)).save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _no_data_read(monkeypatch):
    import ultramem.training.pipeline as pipeline

    monkeypatch.setattr(pipeline, "load_raw_datasets", lambda args: pytest.fail("the data was read before the check"))


@pytest.mark.parametrize(
    "override, message",
    [("memory_topk=-1", "memory_topk=-1 is invalid"),
     ("memory_topk=17", "memory_topk=17 is invalid: must be <= memory_num_keys=16")],  # how two fields fit together
)  # fmt: skip
def test_an_invalid_override_of_a_checkpoint_is_one_line_before_tokenizing(
    tmp_path, checkpoint, override, message, capsys, monkeypatch
):
    """The checkpoint branch used to update the config without checking it: tokenizing, then a 30-line traceback."""
    _no_data_read(monkeypatch)
    argv = ["--model_name_or_path", str(checkpoint), "--config_overrides", override,
            "--output_dir", str(tmp_path / "out")]  # fmt: skip
    assert message in run_and_get_error(argv, capsys)
    assert not (tmp_path / "out").exists()


def test_resume_without_a_checkpoint_is_one_line_before_tokenizing(tmp_path, capsys, monkeypatch):
    """`--resume_from_checkpoint true` with none in --output_dir tokenized and built the model, then failed in train()."""
    _no_data_read(monkeypatch)
    (tmp_path / "out").mkdir()
    for value, message in [
        ("true", f"--resume_from_checkpoint true: --output_dir {tmp_path / 'out'} holds no checkpoint-N folder"),
        (str(tmp_path / "nope"), f"--resume_from_checkpoint {tmp_path / 'nope'}: no such checkpoint folder"),
    ]:
        argv = ["--preset", "tiny-ultramem", "--output_dir", str(tmp_path / "out"), "--resume_from_checkpoint", value]
        assert message in run_and_get_error(argv, capsys)


def test_deepspeed_not_installed_is_one_line(tmp_path, capsys, monkeypatch):
    import sys

    for name in ("ACCELERATE_USE_DEEPSPEED", "DS_ACCELERATOR"):
        monkeypatch.setenv(name, os.environ.get(name, ""))  # restored after the test
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` raises ImportError
    monkeypatch.setitem(sys.modules, "deepspeed.ops", None)
    argv = ["--preset", "tiny-ultramem", "--output_dir", str(tmp_path / "out"), "--deepspeed", "zero2"]
    assert "--deepspeed needs DeepSpeed: pip install 'ultramem[deepspeed]'" in run_and_get_error(argv, capsys)
