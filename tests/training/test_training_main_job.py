"""README command 1, shortened: both models train on the embedded corpus, and every promised output appears."""

from __future__ import annotations

import re

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from ultramem.training.main_job import MODELS, PROMPT, main, parse_args


def test_main_job_prints_the_comparison_writes_the_plot_and_a_loadable_checkpoint(tmp_path, capsys):
    main(["--output_dir", str(tmp_path), "--max_steps", "2", "--batch_size", "2", "--block_size", "32",
          "--eval_blocks", "2"])  # fmt: skip
    printed = capsys.readouterr().out
    for preset in MODELS:
        row = re.search(rf"^{preset}\s+\S+M\s+\S+M\s+(\d+\.\d+)\s+(\d+\.\d+)\s+\d+$", printed, re.MULTILINE)
        assert row, printed[-2000:]
        assert 0 < float(row.group(1)) < 12 and float(row.group(2)) > 1
    assert (tmp_path / "loss_curve.png").stat().st_size > 10_000
    assert f"sample from {MODELS[0]}: '{PROMPT}" in printed

    checkpoint = tmp_path / MODELS[0]
    model = AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True)
    assert model.config.model_type == "ultramem" and model.get_value_table_names()
    assert AutoTokenizer.from_pretrained(checkpoint).eos_token == "<|endoftext|>"


def test_main_job_models_are_checked_before_any_training(capsys):
    """`--models` takes presets; an unknown name is one error line naming the field and the allowed presets."""
    assert parse_args([]).models == list(MODELS)
    with pytest.raises(SystemExit):
        parse_args(["--models", "tiny-ultramem", "tiny-ultramem-typo"])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--models: unknown preset(s) tiny-ultramem-typo; allowed:" in error and "tiny-memoryplus" in error


def test_main_job_logging_steps_are_checked_before_any_training(capsys):
    assert parse_args(["--logging_steps", "5"]).logging_steps == 5
    with pytest.raises(SystemExit):
        parse_args(["--logging_steps", "0"])
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .endswith("--logging_steps: 0 is not allowed; give a whole number >= 1")
    )
