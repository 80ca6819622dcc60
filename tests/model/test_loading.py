"""Loading as users do: checkpoints written by ultramem 0.1, task heads through remote code alone, loading info,
the private kernel choice, and value stores that follow the model's mode."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from model_support import small_config
from transformers import AutoModelForCausalLM
from transformers.testing_utils import CaptureLogger

from ultramem import UltraMemForCausalLM
from ultramem.memory_implementations import default_memory_implementation
from ultramem.offload.stores import logger as stores_logger

V0_1 = Path(__file__).parent / "fixtures" / "checkpoint_v0_1"


def fresh_env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"), "OMP_NUM_THREADS": "1"}


@pytest.fixture
def v0_1(tmp_path) -> Path:
    """A copy of the checkpoint that ultramem 0.1 saved (with `memory_kernel: "triton"` in its config.json); its
    remote-code copies are left out (fixtures/checkpoint_v0_1/README.md), so it loads through the installed package."""
    folder = tmp_path / "v0_1"
    shutil.copytree(V0_1, folder, ignore=shutil.ignore_patterns("README.md"))
    return folder


def test_a_0_1_checkpoint_loads_with_identical_logits_and_generation(v0_1):
    expected = torch.load(v0_1 / "expected_v0_1.pt")
    model = AutoModelForCausalLM.from_pretrained(v0_1, memory_implementation="torch").eval()
    assert type(model) is UltraMemForCausalLM
    with torch.no_grad():
        logits = model(input_ids=expected["input_ids"]).logits
        ids = expected["input_ids"]
        tokens = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    torch.testing.assert_close(logits, expected["logits"], rtol=1e-6, atol=1e-6)
    assert torch.equal(tokens, expected["tokens"])


def test_the_kernel_a_checkpoint_was_trained_with_is_read_and_ignored(v0_1, tmp_path):
    """0.1 saved `memory_kernel="triton"`: this machine picks its own default, and a re-save writes no choice."""
    model = AutoModelForCausalLM.from_pretrained(v0_1)
    assert getattr(model.config, "_memory_implementation", None) is None
    model.save_pretrained(tmp_path / "resaved")
    saved = (tmp_path / "resaved" / "config.json").read_text()
    assert "memory_kernel" not in saved and "memory_implementation" not in saved


def test_where_triton_can_launch_it_is_the_default_without_a_saved_field():
    """A CUDA device with Triton registered and launchable (the interpreter stands in for the GPU here)."""
    pytest.importorskip("triton")
    assert default_memory_implementation(torch.device("cpu")) == "embedding_bag"
    assert default_memory_implementation(torch.device("cuda")) == "triton"


def test_an_unknown_implementation_is_one_line_naming_the_choices(v0_1):
    with pytest.raises(ValueError, match="memory_implementation='cuda' is not registered"):
        AutoModelForCausalLM.from_pretrained(v0_1, memory_implementation="cuda")
    model = UltraMemForCausalLM(small_config())
    with pytest.raises(
        ValueError,
        match=r"memory_implementation='cuda' is not registered; choose one of \['cpp', 'embedding_bag', 'torch', 'triton'\]",
    ):
        model.set_memory_implementation("cuda")


def test_output_loading_info_returns_the_model_and_the_info(v0_1):
    model, info = AutoModelForCausalLM.from_pretrained(v0_1, output_loading_info=True)
    assert isinstance(model, UltraMemForCausalLM)
    assert info["missing_keys"] == set() or not info["missing_keys"]
    model, info = AutoModelForCausalLM.from_pretrained(v0_1, output_loading_info=True, memory_offload="cpu")
    assert {type(layer.values).__name__ for layer in model.model.memory_layers} == {"HostValueStore"}


RESAVED_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["ultramem"] = None  # only the folder's code runs
    import torch
    from transformers import AutoModelForCausalLM
    folder = sys.argv[1]
    expected = torch.load(folder + "/expected_v0_1.pt")
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, memory_implementation="torch").eval()
    assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
    ids = expected["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        tokens = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    torch.testing.assert_close(logits, expected["logits"], rtol=1e-6, atol=1e-6)
    assert torch.equal(tokens, expected["tokens"])
    print("SAME")
    """
)


def test_a_0_1_checkpoint_resaved_runs_the_same_through_remote_code_alone(v0_1, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(v0_1)
    resaved = tmp_path / "resaved"
    model.save_pretrained(resaved)
    shutil.copy(v0_1 / "expected_v0_1.pt", resaved)
    done = subprocess.run(
        [sys.executable, "-c", RESAVED_SCRIPT, str(resaved)],
        env=fresh_env(tmp_path),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=300,
    )
    assert done.returncode == 0 and "SAME" in done.stdout, done.stderr[-3000:]


HEADS_SCRIPT = textwrap.dedent(
    """
    import sys
    if sys.argv[2] == "not-installed":
        sys.modules["ultramem"] = None
    import torch
    from transformers import (AutoModelForQuestionAnswering, AutoModelForSequenceClassification,
                              AutoModelForTokenClassification)
    folder = sys.argv[1]
    ids = torch.tensor([[5, 9, 3, 44]])
    for auto in (AutoModelForSequenceClassification, AutoModelForTokenClassification, AutoModelForQuestionAnswering):
        head = auto.from_pretrained(folder, trust_remote_code=True, num_labels=3).eval()  # no prompt: stdin is closed
        assert "ultramem" not in sys.modules or sys.modules["ultramem"] is None, "the package was imported"
        with torch.no_grad():
            head(input_ids=ids)
        print(type(head).__name__, type(head).__module__.split(".")[0])
    head = AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=True, num_labels=3)
    head.save_pretrained(folder + "/finetuned")
    again = AutoModelForSequenceClassification.from_pretrained(folder + "/finetuned", trust_remote_code=True)
    assert torch.equal(again.score.weight, head.score.weight)
    print("FINETUNED", type(again).__name__)
    """
)


@pytest.mark.parametrize("mode", ["not-installed", "installed-not-imported"])
def test_task_heads_load_through_the_checkpoint_code(mode, tmp_path):
    folder = tmp_path / "checkpoint"
    UltraMemForCausalLM(small_config()).save_pretrained(folder)
    done = subprocess.run(
        [sys.executable, "-c", HEADS_SCRIPT, str(folder), mode],
        env=fresh_env(tmp_path),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    for head in ("SequenceClassification", "TokenClassification", "QuestionAnswering"):
        assert f"UltraMemFor{head} transformers_modules" in lines
    assert "FINETUNED UltraMemForSequenceClassification" in lines


@pytest.mark.parametrize("store", ["cpu", "local"])
def test_a_store_set_on_an_eval_model_is_in_eval_mode(store):
    """A loss computed in eval mode (gradients on) must not warn that training leaves the tables alone."""
    model = UltraMemForCausalLM(small_config()).eval()
    model.set_value_store(store)
    assert all(not layer.values.training for layer in model.model.memory_layers)
    ids = torch.randint(1, 97, (1, 6))
    with CaptureLogger(stores_logger) as captured:
        model(input_ids=ids, labels=ids).loss.backward()
    assert "read-only" not in captured.out
