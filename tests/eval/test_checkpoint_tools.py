"""The checkpoint tools around evaluation: `python -m ultramem.tokenization` (the fix every missing-tokenizer error
names) and `python -m ultramem.offload.random_checkpoint` (benchmark checkpoints that must load like saved ones)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ultramem.presets import get_config
from ultramem.sizing import build_model
from ultramem.tokenization import main as tokenization_main

PROG = "python -m ultramem.tokenization"


@pytest.fixture(scope="module")
def untokenized(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny-ultramem folder written by `model.save_pretrained` alone (no tokenizer)."""
    folder = tmp_path_factory.mktemp("tok") / "tiny-ultramem"
    torch.manual_seed(0)
    build_model(get_config("tiny-ultramem")).save_pretrained(folder)
    return folder


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        tokenization_main(argv)
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"{PROG}: error: ")
    return line


def test_tokenization_cli_has_help_and_usage() -> None:
    """As the module the error messages name: --help answers, no argument is a usage error (it did nothing, exit 0)."""
    command = [sys.executable, "-m", "ultramem.tokenization"]
    shown = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0 and shown.stdout.startswith(f"usage: {PROG} [-h] FOLDER [FOLDER ...]")
    bare = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert bare.returncode == 2 and "the following arguments are required: FOLDER" in bare.stderr
    assert "Traceback" not in shown.stderr + bare.stderr


def test_tokenization_cli_names_a_wrong_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _refused([str(tmp_path / "absent")], capsys)  # it was a Hub "Repo id" traceback
    assert f"{tmp_path / 'absent'}: not a folder" in line
    assert f"{tmp_path}: no config.json" in _refused([str(tmp_path)], capsys)


def test_tokenization_cli_refuses_folders_the_shipped_tokenizer_does_not_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Llama with 1,000 tokens got the 50k-token tokenizer silently, and evaluation died in an IndexError."""
    from transformers import LlamaConfig

    llama = tmp_path / "llama"
    LlamaConfig(vocab_size=1000, hidden_size=32, num_attention_heads=4).save_pretrained(llama)
    line = _refused([str(llama)], capsys)
    assert "model_type 'llama' is not an UltraMem checkpoint" in line
    small_vocab = tmp_path / "ultramem-1k"
    get_config("tiny-ultramem", vocab_size=1000).save_pretrained(small_vocab)
    line = _refused([str(small_vocab)], capsys)
    assert "vocab_size 1,000 does not match the shipped GPT-NeoX tokenizer (50,277 tokens" in line
    assert not any((folder / "tokenizer.json").exists() for folder in (llama, small_vocab))


def test_tokenization_cli_adds_the_tokenizer_once(untokenized: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoTokenizer

    assert tokenization_main([str(untokenized)]) == 0
    assert capsys.readouterr().out == f"tokenizer saved into {untokenized}\n"
    tokenizer = AutoTokenizer.from_pretrained(untokenized)
    assert len(tokenizer) == 50277 and tokenizer.model_max_length == get_config("tiny-ultramem").max_position_embeddings
    assert tokenization_main([str(untokenized)]) == 0
    assert "already has a tokenizer" in capsys.readouterr().out


def test_random_checkpoint_loads_like_a_saved_one(tmp_path: Path) -> None:
    """Its auto_map names the model classes and its code files are beside it, as save_pretrained writes them: it
    loads in a fresh process that never imports ultramem, in memory and with memory_offload (it needed
    `import ultramem` first, with no hint)."""
    from ultramem.offload.random_checkpoint import main as random_checkpoint_main

    folder = tmp_path / "random"
    random_checkpoint_main(["--preset", "tiny-ultramem", "--dtype", "bfloat16", "--output", str(folder)])
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_ultramem.UltraMemForCausalLM"
    assert config["architectures"] == ["UltraMemForCausalLM"] and "memory_offload" not in config
    assert (folder / "modeling_ultramem.py").is_file() and (folder / "generation_config.json").is_file()
    script = f"""
import sys
from transformers import AutoModelForCausalLM, AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained({str(folder)!r}, trust_remote_code=True)
inputs = tokenizer("The whale", return_tensors="pt")
for offload in (None, "disk"):
    model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True, memory_offload=offload)
    print(type(model).__module__.split(".")[0], model.generate(**inputs, max_new_tokens=2, do_sample=False).shape[1])
print("ultramem imported:", "ultramem" in sys.modules and "ultramem.modeling_ultramem" in sys.modules)
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[:2] == ["transformers_modules 4", "transformers_modules 4"], done.stdout
