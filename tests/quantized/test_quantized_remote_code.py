"""Quantized checkpoints through remote code: `AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)` in a
process that has `ultramem` installed but not imported (how lm-eval's `--model hf` and a model card's snippet load
it) runs the checkpoint's copy of the model code, which must load uint8 tables as what they are. It raised a size
mismatch (`[N, 144] vs model: [N, 128]`): the installed loader deferred the tables in its own context, not the
copy's. Converted int8 and int4 checkpoints and a quantized random one give the logits the package's classes give;
the plain lm_eval CLI scores one."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from model_support import small_config

from ultramem import UltraMemForCausalLM
from ultramem.eval import tasks_path
from ultramem.offload.random_checkpoint import write_random_checkpoint
from ultramem.presets import get_config
from ultramem.quantize import convert
from ultramem.sizing import build_model
from ultramem.tokenization import load_tokenizer

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
EVAL_FIXTURES = Path(__file__).parents[1] / "eval" / "fixtures" / "eval"
KINDS = ("converted-int8", "converted-int4", "random-int4")

PROMPT = torch.tensor([[5, 9, 3, 44, 7, 1], [8, 1, 7, 2, 90, 6]])

# A fresh interpreter per checkpoint: the first remote-code load imports the package (its loader), after which
# Transformers prefers the registered local classes
REMOTE_CODE_SCRIPT = """
import sys
import torch
from transformers import AutoModelForCausalLM

assert "ultramem" not in sys.modules
folder, expected = sys.argv[1], torch.load(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
assert type(model).__module__.startswith("transformers_modules."), type(model).__module__  # the checkpoint's copy
assert model.config.memory_quantization == expected["format"], model.config.memory_quantization
with torch.no_grad():
    torch.testing.assert_close(model(expected["prompt"]).logits, expected["logits"], rtol=0, atol=0)
print("SAME")
"""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A small float checkpoint converted to int8 and int4, and a random checkpoint written with int4 tables."""
    root = tmp_path_factory.mktemp("remote")
    config = small_config(memory_value_dim=16, memory_num_keys=16)
    torch.manual_seed(3)
    model = UltraMemForCausalLM(config).eval()
    with torch.no_grad():  # tables off their init scale, so that they matter to the logits
        for _, layer in model.named_memory_layers():
            layer.values.weight.normal_(0, 1.0)
    model.save_pretrained(root / "float")
    write_random_checkpoint(config, root / "random-int4", torch.bfloat16, memory_quantization="int4", group_size=4)
    return {
        "converted-int8": convert(root / "float", root / "converted-int8", "int8"),
        "converted-int4": convert(root / "float", root / "converted-int4", "int4", 4),
        "random-int4": root / "random-int4",
    }


@pytest.mark.parametrize("kind", KINDS)
def test_quantized_checkpoint_loads_through_remote_code_with_the_packages_logits(checkpoints, kind, tmp_path):
    folder = checkpoints[kind]
    model = UltraMemForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()  # the package's classes
    assert model.config.memory_quantization == kind.rpartition("-")[2]
    with torch.no_grad():
        expected = {"prompt": PROMPT, "logits": model(PROMPT).logits, "format": model.config.memory_quantization}
    torch.save(expected, tmp_path / "expected.pt")
    done = subprocess.run(
        [sys.executable, "-c", REMOTE_CODE_SCRIPT, str(folder), str(tmp_path / "expected.pt")],
        env={**os.environ, **OFFLINE_ENV},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.stdout.strip().endswith("SAME"), done.stdout[-2000:] + done.stderr[-4000:]


def test_the_converter_writes_the_installed_model_code(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """A float checkpoint whose code copy predates the quantized format still converts into one that loads: the
    converter writes the package's code, as save_pretrained would."""
    import ultramem

    stale = tmp_path / "stale"
    stale.mkdir()
    for path in (checkpoints["converted-int8"].parent / "float").iterdir():
        text = "# an older release's copy\n" if path.suffix == ".py" else None
        (stale / path.name).write_bytes(text.encode() if text else path.read_bytes())
    out = convert(stale, tmp_path / "q", "int8")
    package = Path(ultramem.__file__).parent
    for name in ("modeling_ultramem.py", "configuration_ultramem.py", "value_stores.py"):
        assert (out / name).read_text() == (package / name).read_text(), name


@pytest.fixture(scope="module")
def tiny_int8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-ultramem (the tokenizer's vocabulary) with its tokenizer, converted to int8."""
    root = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    build_model(get_config("tiny-ultramem")).save_pretrained(root / "float")
    load_tokenizer().save_pretrained(root / "float")
    return convert(root / "float", root / "int8", "int8")


def test_plain_lm_eval_cli_scores_a_converted_checkpoint(tiny_int8: Path, tmp_path: Path) -> None:
    """`lm_eval --model hf --model_args pretrained=DST,trust_remote_code=True` as a user types it (lm-eval loads the
    model before its tasks import anything of ultramem)."""
    command = [
        sys.executable, "-m", "lm_eval", "--model", "hf",
        "--model_args", f"pretrained={tiny_int8},trust_remote_code=True",
        "--include_path", tasks_path(), "--tasks", "ultramem_boolq_offline",
        "--metadata", json.dumps({"data_dir": str(EVAL_FIXTURES)}), "--limit", "2", "--device", "cpu",
        "--output_path", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(command, env={**os.environ, **OFFLINE_ENV}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    (results_file,) = tmp_path.rglob("results_*.json")
    output = json.loads(results_file.read_text(encoding="utf-8"))
    assert 0.0 <= output["results"]["boolq"]["acc,none"] <= 1.0
    assert output["n-samples"]["boolq"]["effective"] == 2
