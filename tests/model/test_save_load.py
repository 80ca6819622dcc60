"""Save, then load in a fresh process through the Auto classes: with `ultramem` importable, and without it."""

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from model_support import small_config
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer

from ultramem import UltraMemConfigError, UltraMemForCausalLM

LOAD_SCRIPT = textwrap.dedent(
    """
    import sys
    if sys.argv[2] == "remote":
        sys.modules["ultramem"] = None  # the package must not be importable: only the folder's code runs
    else:
        import ultramem  # registers the Auto classes
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification
    folder = sys.argv[1]
    kwargs = {"trust_remote_code": True} if sys.argv[2] == "remote" else {}
    config = AutoConfig.from_pretrained(folder, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(folder, **kwargs).eval()
    base = AutoModel.from_pretrained(folder, **kwargs)
    classifier = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=3, **kwargs).eval()
    inputs = torch.load(folder + "/inputs.pt")
    with torch.no_grad():
        logits = model(**inputs).logits
        hidden = [m.model(**inputs).last_hidden_state for m in (model, classifier)]
    shuffles = [layer.value_expansion.virtual_to_physical for layer in model.model.memory_layers]
    classes = [type(config).__name__, type(model).__name__, type(base).__name__, type(classifier).__name__]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # read by the Trainer
    torch.save({"logits": logits, "shuffles": shuffles, "classes": classes, "module": type(model).__module__,
               "hidden": hidden, "causal_lm_table": MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get("ultramem")},
               folder + "/result-" + sys.argv[2] + ".pt")
    """
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, torch.Tensor, list[torch.Tensor]]:
    folder = tmp_path_factory.mktemp("checkpoint")
    torch.manual_seed(11)
    model = UltraMemForCausalLM(small_config()).eval()
    inputs = {
        "input_ids": torch.tensor([[0, 0, 5, 9, 3, 44], [8, 1, 7, 2, 6, 90]]),
        "attention_mask": torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]),
    }
    with torch.no_grad():
        logits = model(**inputs).logits
    model.save_pretrained(folder)
    torch.save(inputs, folder / "inputs.pt")
    shuffles = [layer.value_expansion.virtual_to_physical.clone() for layer in model.model.memory_layers]
    return folder, logits, shuffles


def test_folder_has_safetensors_code_and_auto_map(saved):
    folder, _, _ = saved
    files = set(os.listdir(folder))
    assert {
        "model.safetensors",
        "config.json",
        "modeling_ultramem.py",
        "configuration_ultramem.py",
        "memory_ops.py",
    } <= files
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "ultramem"
    assert config["auto_map"] == {
        "AutoConfig": "configuration_ultramem.UltraMemConfig",
        "AutoModel": "modeling_ultramem.UltraMemModel",
        "AutoModelForCausalLM": "modeling_ultramem.UltraMemForCausalLM",
        "AutoModelForSequenceClassification": "modeling_ultramem.UltraMemForSequenceClassification",
        "AutoModelForTokenClassification": "modeling_ultramem.UltraMemForTokenClassification",
        "AutoModelForQuestionAnswering": "modeling_ultramem.UltraMemForQuestionAnswering",
    }
    with safe_open(folder / "model.safetensors", "pt") as tensors:
        assert "model.memory_layers.0.value_expansion.virtual_to_physical" in tensors.keys()


@pytest.mark.parametrize("mode", ["registered", "remote"])
def test_fresh_process_loads_identical_model(saved, mode, tmp_path):
    folder, logits, shuffles = saved
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    subprocess.run([sys.executable, "-c", LOAD_SCRIPT, str(folder), mode], check=True, env=env, cwd=tmp_path)
    result = torch.load(folder / f"result-{mode}.pt")
    assert torch.equal(result["logits"], logits)
    for before, after in zip(shuffles, result["shuffles"]):
        assert torch.equal(before, after)
    assert result["classes"] == [
        "UltraMemConfig",
        "UltraMemForCausalLM",
        "UltraMemModel",
        "UltraMemForSequenceClassification",
    ]
    torch.testing.assert_close(result["hidden"][1], result["hidden"][0], rtol=0, atol=0)  # the LM's backbone, loaded
    assert result["causal_lm_table"] == "UltraMemForCausalLM"
    if mode == "remote":
        assert result["module"].startswith("transformers_modules.")
    else:
        assert result["module"] == "ultramem.modeling_ultramem"


def test_saved_model_code_names_the_transformers_it_needs(saved, monkeypatch):
    """The folder's copy of the model code, imported under a Transformers older than it supports, says which."""
    folder = saved[0]
    real_version = importlib.metadata.version
    older = {"transformers": "5.16.0"}
    monkeypatch.setattr(importlib.metadata, "version", lambda name: older.get(name) or real_version(name))
    spec = importlib.util.spec_from_file_location("ultramem.saved_modeling_copy", folder / "modeling_ultramem.py")
    with pytest.raises(ImportError, match=r"transformers>=5\.17 is required .* found transformers==5\.16\.0"):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


@pytest.mark.parametrize(
    "keywords, invalid",
    [
        (dict(memory_topk=0), "memory_topk=0 is invalid: must be a positive integer"),
        (dict(memory_layers=[[0, 9]]), r"memory_layers\[0\]=\[0, 9\] is invalid: block indices must be in \[0, 4\)"),
        (dict(aux_loss_alpha=-1.0), "aux_loss_alpha=-1.0 is invalid: must be >= 0"),
    ],
)
def test_from_pretrained_config_keywords_are_checked_like_saved_fields(saved, keywords, invalid):
    """Transformers sets `from_pretrained` keywords on the config after building it; they used to skip the checks
    (memory_topk=0 crashed in the retrieval, memory_layers=[[0, 9]] silently dropped a memory layer's output)."""
    folder, _, _ = saved
    for load in (UltraMemForCausalLM.from_pretrained, AutoConfig.from_pretrained):
        with pytest.raises(UltraMemConfigError, match=invalid):
            load(folder, **keywords)


def test_placement_given_at_load_or_assigned_later_derives_the_cache_layout(saved):
    """The generation cache's layout is derived from `memory_layers`: a placement given as a keyword, or assigned to
    a config before building a model, must move the query-conv states with it (cached decoding equals uncached)."""
    folder, _, _ = saved
    placement = [[1, 2], [2, 3], [3, 3]]
    expected = small_config(memory_layers=placement).layer_types
    assigned = small_config()
    assigned.memory_layers = placement
    torch.manual_seed(0)
    for model in (UltraMemForCausalLM.from_pretrained(folder, memory_layers=placement), UltraMemForCausalLM(assigned)):
        model.eval()
        assert model.config.layer_types == expected
        prompt = torch.tensor([[5, 9, 3, 44]])
        cached, uncached = (
            model.generate(prompt, max_new_tokens=5, do_sample=False, use_cache=use_cache, pad_token_id=0)
            for use_cache in (True, False)
        )
        assert torch.equal(cached, uncached)
    with pytest.raises(UltraMemConfigError, match="memory_topk=0 is invalid"):
        assigned.memory_topk = 0  # a field alone: checked when set
    assigned.memory_topk = 13  # against the others (memory_num_keys=12): checked when a model is built
    with pytest.raises(UltraMemConfigError, match="memory_topk=13 is invalid: must be <= memory_num_keys=12"):
        UltraMemForCausalLM(assigned)


def test_shuffle_is_stored_not_rederived(saved):
    """A checkpoint's bijection wins over what the seed would give today (robust to RNG changes)."""
    folder, _, shuffles = saved
    from safetensors.torch import load_file, save_file

    state = load_file(folder / "model.safetensors")
    key = "model.memory_layers.0.value_expansion.virtual_to_physical"
    state[key] = state[key].flip(0).contiguous()
    altered = folder.parent / "altered"
    altered.mkdir(exist_ok=True)
    for name in os.listdir(folder):
        if name != "model.safetensors":
            (altered / name).write_bytes((folder / name).read_bytes())
    save_file(state, altered / "model.safetensors", metadata={"format": "pt"})
    model = UltraMemForCausalLM.from_pretrained(altered)
    assert torch.equal(model.model.memory_layers[0].value_expansion.virtual_to_physical, shuffles[0].flip(0))


def test_readme_snippet_saves_a_folder_that_pipeline_and_autotokenizer_load(tmp_path, monkeypatch):
    """README's "Use it from Transformers" snippet, run as written, in an empty folder."""
    import re

    from transformers import pipeline

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Use it from Transformers", 1)[1]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(compile(snippet, "README.md", "exec"), {})
    generator = pipeline("text-generation", model="my-ultramem", trust_remote_code=True)
    assert generator("The whale", max_new_tokens=2, do_sample=False)[0]["generated_text"].startswith("The whale")


def test_tools_name_the_fix_for_a_folder_without_tokenizer(tmp_path, capsys):
    pytest.importorskip("lm_eval")
    from ultramem.eval.cli import main as eval_main
    from ultramem.tokenization import add_to_checkpoint

    folder = tmp_path / "no-tokenizer"
    UltraMemForCausalLM(small_config(vocab_size=50304)).save_pretrained(folder)
    with pytest.raises(SystemExit):
        eval_main(["--model", str(folder)])
    assert (
        f"no tokenizer (tokenizer.json); add the shipped GPT-NeoX tokenizer with `python -m ultramem.tokenization {folder}`"
        in capsys.readouterr().err
    )
    add_to_checkpoint(folder)
    assert AutoTokenizer.from_pretrained(folder)("The whale").input_ids


MISSING_TOKENIZER_SCRIPT = textwrap.dedent(
    """
    import sys
    if sys.argv[2] == "remote":
        sys.modules["ultramem"] = None  # only the folder's code runs
    else:
        import ultramem
    from transformers import AutoTokenizer, pipeline
    folder = sys.argv[1]
    for load in (lambda: AutoTokenizer.from_pretrained(folder, trust_remote_code=True),
                 lambda: pipeline("text-generation", model=folder, trust_remote_code=True)):
        try:
            load()
            print("loaded")
        except OSError as error:
            print(error)
    """
)


@pytest.mark.parametrize("mode", ["registered", "remote"])
def test_autotokenizer_and_pipeline_name_the_fix_for_a_folder_without_tokenizer(mode, tmp_path):
    """Without tokenizer files AutoTokenizer used to fail converting a slow tokenizer (sentencepiece/tiktoken)."""
    from ultramem.tokenization import add_to_checkpoint

    folder = tmp_path / "no-tokenizer"
    UltraMemForCausalLM(small_config(vocab_size=50304)).save_pretrained(folder)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    command = [sys.executable, "-c", MISSING_TOKENIZER_SCRIPT, str(folder), mode]

    def printed() -> list[str]:
        done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, check=True)
        return done.stdout.splitlines()

    fix = f"{folder}: no tokenizer (tokenizer.json); add the shipped GPT-NeoX tokenizer with "
    fix += f"`python -m ultramem.tokenization {folder}`"
    assert printed() == [fix, fix]
    add_to_checkpoint(folder)
    assert printed() == ["loaded", "loaded"]


def test_lm_eval_cli_names_the_fix_for_a_folder_without_tokenizer(tmp_path):
    pytest.importorskip("lm_eval")
    from ultramem.eval import tasks_path

    folder = tmp_path / "no-tokenizer"
    UltraMemForCausalLM(small_config(vocab_size=50304)).save_pretrained(folder)
    command = [
        sys.executable, "-m", "lm_eval", "--model", "hf",
        "--model_args", f"pretrained={folder},trust_remote_code=True", "--include_path", tasks_path(),
        "--tasks", "ultramem_boolq_offline", "--metadata", json.dumps({"data_dir": str(tmp_path)}), "--limit", "1",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env["HF_MODULES_CACHE"] = str(tmp_path / "modules")
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .endswith(
            f"MissingTokenizerError: {folder}: no tokenizer (tokenizer.json); add the shipped GPT-NeoX tokenizer with "
            f"`python -m ultramem.tokenization {folder}`"
        )
    ), done.stderr[-3000:]


def test_autotokenizer_still_loads_a_bare_tokenizer_json(tmp_path):
    """The fallback refuses only a folder with no tokenizer at all: tokenizer.json alone loads as before."""
    from ultramem.tokenization import load_tokenizer, tokenizer_file

    UltraMemForCausalLM(small_config()).save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes(Path(tokenizer_file()).read_bytes())
    text = "Squire Trelawney, Dr. Livesey"
    assert AutoTokenizer.from_pretrained(tmp_path)(text).input_ids == load_tokenizer()(text).input_ids
