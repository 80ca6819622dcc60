"""Hub model cards and ultramem-push. The Hub is unreachable here: the tests stop at `HfApi.create_commit`."""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from huggingface_hub import CommitInfo, HfApi, ModelCard

from ultramem.configuration_ultramem import UltraMemConfig
from ultramem.eval.benchmarks import BENCHMARKS
from ultramem.eval.report import ModelResult, write_results
from ultramem.hub_cards import render_card
from ultramem.hub_cards.push import main as push_main
from ultramem.presets import get_config
from ultramem.sizing import build_model, count_parameters
from ultramem.tokenization import load_tokenizer

REPO = "alice/tiny-ultramem"


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # no stored login
    monkeypatch.delenv("HF_TOKEN", raising=False)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny UltraMem checkpoint as the Trainer leaves it: model, tokenizer, and files that must not be pushed."""
    folder = tmp_path_factory.mktemp("push") / "tiny-ultramem"
    torch.manual_seed(0)
    build_model(get_config("tiny-ultramem")).save_pretrained(folder)
    load_tokenizer().save_pretrained(folder)
    (folder / "optimizer.pt").write_bytes(b"optimizer state")
    (folder / "training_args.bin").write_bytes(b"pickle")
    return folder


@pytest.fixture
def trained(tmp_path: Path, checkpoint: Path) -> Path:
    """The config of `checkpoint` with a trainer_state.json (the card reads nothing else)."""
    folder = tmp_path / "trained"
    folder.mkdir()
    shutil.copy(checkpoint / "config.json", folder)
    state = {
        "global_step": 200,
        "max_steps": 200,
        "train_batch_size": 8,
        "log_history": [
            {"step": 100, "loss": 7.5, "learning_rate": 6e-4},
            {"step": 200, "loss": 5.25, "learning_rate": 1e-5},
            {"step": 200, "eval_loss": 5.5},
        ],
        "stateful_callbacks": {  # as the Trainer saves `ultramem.training`'s ValueLearningRate callback
            "ValueLearningRate": {"args": {"value_lr_multiplier": 4.0, "value_lr_decay": False}, "attributes": {}}
        },
    }
    (folder / "trainer_state.json").write_text(json.dumps(state), encoding="utf-8")
    return folder


def _result(checkpoint: Path) -> ModelResult:
    scores = {b.key: 10.0 + i for i, b in enumerate(BENCHMARKS) if b.key != "drop"}
    return ModelResult("tiny-ultramem", str(checkpoint), 0.02, 0.0075, scores, {"drop": "no local copy"})


def test_card_without_results_has_metadata_size_and_usage_but_no_scores(checkpoint: Path) -> None:
    text = render_card(checkpoint, REPO)
    card = ModelCard(text)
    assert card.data.license == "apache-2.0"
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert {"ultramem", "custom_code"} <= set(card.data.tags)
    assert card.data.eval_results is None and "model-index" not in text
    counts = count_parameters(UltraMemConfig.from_pretrained(checkpoint))
    assert f"({counts['total']:,})" in text and f"({counts['activated']:,})" in text
    assert f"({counts['memory_slots']:,})" in text and "(0, 1), (2, 3)" in text
    assert f'AutoModelForCausalLM.from_pretrained("{REPO}", trust_remote_code=True)' in text
    assert "## Evaluation" not in text and "Optimizer steps" not in text  # no results, no trainer_state.json
    assert "Value-table learning rate" not in text  # a training argument: the config does not say


def test_card_with_results_and_trainer_state(trained: Path) -> None:
    text = render_card(
        trained,
        REPO,
        result=_result(trained),
        settings={"data_dir": "hub", "lm_eval": "0.4.13"},
        datasets=["gutenberg"],
    )
    card = ModelCard(text)
    assert card.data.datasets == ["gutenberg"]
    results = {r.dataset_name: r for r in card.data.eval_results}
    assert set(results) == {b.title for b in BENCHMARKS if b.key != "drop"}  # unscored DROP is left out
    assert results["ARC-C"].metric_value == 10.0 and results["ARC-C"].metric_name == "ARC-C (25-shot)"
    assert results["MMLU"].dataset_type == "cais/mmlu" and results["BBH cot"].metric_type == "exact_match"
    assert (
        "Optimizer steps: 200 of 200" in text
        and "Validation loss of the checkpoint (its own validation split): 5.5000" in text
    )
    assert "Peak logged learning rate: 0.0006" in text and "Batch size per device: 8" in text
    assert "Value-table learning rate: 4x the base rate at the start, constant." in text
    row = next(line for line in text.splitlines() if line.startswith("| tiny-ultramem |"))
    assert row.split("|")[-3].strip() == "–"  # DROP
    assert "data not available: DROP" in text and "lm-eval 0.4.13 on the Hub datasets" in text


class _CommitRecorder:
    """Stands in for the Hub at its boundary: records what `create_commit` would send."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, api: HfApi, repo_id: str, operations: list, **kwargs) -> CommitInfo:
        self.calls.append({"repo_id": repo_id, "operations": list(operations), "token": api.token, **kwargs})
        url = f"https://huggingface.co/{repo_id}/commit/{'0' * 40}"
        return CommitInfo(commit_url=url, commit_message=kwargs["commit_message"], commit_description="", oid="0" * 40)


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> _CommitRecorder:
    record = _CommitRecorder()

    def create_commit(api: HfApi, repo_id: str, operations: list, **kwargs) -> CommitInfo:  # bound like the method
        return record(api, repo_id, operations, **kwargs)

    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    return record


def test_push_sends_one_commit_with_weights_config_code_tokenizer_and_card(
    checkpoint: Path, tmp_path: Path, recorder: _CommitRecorder, capsys: pytest.CaptureFixture[str]
) -> None:
    results_json = tmp_path / "results.json"
    write_results(results_json, [_result(checkpoint)], {"limit": None})
    argv = [
        str(checkpoint),
        "--repo-id",
        REPO,
        "--revision",
        "v1",
        "--results",
        str(results_json),
        "--token",
        "hf_test",
    ]
    assert push_main(argv) == 0
    assert f"https://huggingface.co/{REPO}/commit/" in capsys.readouterr().out

    (call,) = recorder.calls
    assert call["repo_id"] == REPO and call["revision"] == "v1" and call["token"] == "hf_test"
    operations = {op.path_in_repo: op for op in call["operations"]}
    code = {p.name for p in checkpoint.glob("*.py")}
    assert {"modeling_ultramem.py", "configuration_ultramem.py"} <= code
    expected = {
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "README.md",
    }
    assert set(operations) == expected | code  # no optimizer.pt, no training_args.bin
    for name, op in operations.items():
        if name != "README.md":
            local = (checkpoint / name).read_bytes()
            assert op.upload_info.size == len(local)
            assert op.upload_info.sha256.hex() == hashlib.sha256(local).hexdigest()
    config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_ultramem.UltraMemForCausalLM"
    card = operations["README.md"].path_or_fileobj.decode("utf-8")
    assert card == render_card(checkpoint, REPO, result=_result(checkpoint), settings={"limit": None})
    assert "model-index" in card


def test_first_push_creates_the_repo_then_commits(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import httpx2
    from huggingface_hub.errors import RepositoryNotFoundError

    record = _CommitRecorder()
    created: list[dict] = []

    def commit(api: HfApi, repo_id: str, operations: list, **kwargs) -> CommitInfo:
        if not created:
            request = httpx2.Request("POST", f"https://huggingface.co/api/models/{repo_id}/commit/main")
            raise RepositoryNotFoundError("not found", response=httpx2.Response(404, request=request))
        return record(api, repo_id, operations, **kwargs)

    monkeypatch.setattr(HfApi, "create_commit", commit)
    monkeypatch.setattr(HfApi, "create_repo", lambda api, repo_id, **kw: created.append({"repo_id": repo_id, **kw}))
    monkeypatch.setenv("HF_TOKEN", "hf_env")
    assert push_main([str(checkpoint), "--repo-id", REPO, "--private"]) == 0
    assert created == [{"repo_id": REPO, "private": True, "exist_ok": True, "repo_type": "model"}]
    assert len(record.calls) == 1 and record.calls[0]["token"] == "hf_env"


@pytest.mark.parametrize(
    ("repo_id", "token", "message"),
    [
        (REPO, None, "no Hugging Face token"),
        ("alice/bad name!", "hf_test", "--repo-id 'alice/bad name!' is not a valid Hub repo id"),
        ("tiny-ultramem", "hf_test", "--repo-id 'tiny-ultramem': expected USER/NAME"),
    ],
)
def test_push_refuses_before_uploading_anything(
    checkpoint: Path,
    recorder: _CommitRecorder,
    repo_id: str,
    token: str | None,
    message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [str(checkpoint), "--repo-id", repo_id] + (["--token", token] if token else [])
    with pytest.raises(SystemExit) as exit_info:
        push_main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert recorder.calls == []


def test_push_names_a_folder_without_tokenizer_before_asking_for_a_token(
    tmp_path: Path, checkpoint: Path, recorder: _CommitRecorder, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.copytree(checkpoint, tmp_path / "no_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (tmp_path / "no_tokenizer" / name).unlink(missing_ok=True)
    with pytest.raises(SystemExit):
        push_main([str(tmp_path / "no_tokenizer"), "--repo-id", REPO])  # and no token anywhere
    error = capsys.readouterr().err
    assert "tokenizer" in error and "token:" not in error and recorder.calls == []


def test_push_refuses_a_folder_without_safetensors(
    tmp_path: Path, checkpoint: Path, recorder: _CommitRecorder, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.copy(checkpoint / "config.json", tmp_path)
    with pytest.raises(SystemExit):
        push_main([str(tmp_path), "--repo-id", REPO, "--token", "hf_test"])
    assert "no *.safetensors weights" in capsys.readouterr().err and recorder.calls == []


def test_card_names_a_pkm_checkpoint_and_a_limited_run_without_local_paths(checkpoint: Path, tmp_path: Path) -> None:
    """The kind comes from the config's own mode constant; --limit shows in the notes and every model-index name."""
    folder = tmp_path / "tiny-pkm"
    folder.mkdir()
    get_config("tiny-pkm").save_pretrained(folder)
    data_dir = tmp_path / "private" / "eval"
    settings = {"data_dir": str(data_dir), "limit": 10.0, "max_gen_toks": 32, "lm_eval": "0.4.13"}
    text = render_card(folder, REPO, result=_result(folder), settings=settings)
    assert "(PKM memory-layer baseline)" in text and "UltraMem memory layers" not in text
    assert "At most 10 documents per task (--limit)" in text and "local copies of the published files" in text
    assert all(r.metric_name.endswith(", --limit 10)") for r in ModelCard(text).data.eval_results)
    assert str(tmp_path) not in text and "UltraMem memory layers" in render_card(checkpoint, REPO)


@pytest.mark.parametrize("env", [{"HF_HUB_OFFLINE": "1"}, {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}])
def test_push_without_network_is_one_line(checkpoint: Path, env: dict) -> None:
    """In a child process: the Hub endpoint and offline mode are read when huggingface_hub is imported."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    child = {**os.environ, **env, "PYTHONPATH": str(repo)}
    command = [sys.executable, "-m", "ultramem.hub_cards.push", str(checkpoint), "--repo-id", REPO, "--token", "hf_x"]
    result = subprocess.run(command, env=child, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.startswith("ultramem-push: error: cannot reach the Hub at ") and result.stderr.count("\n") == 1


def _usage_code(card: str) -> str:
    return card.split("## Usage", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.parametrize(
    "head, pipeline_tag",
    [
        ("UltraMemForCausalLM", "text-generation"),
        ("UltraMemForSequenceClassification", "text-classification"),
        ("UltraMemForTokenClassification", "token-classification"),
        ("UltraMemForQuestionAnswering", "question-answering"),
    ],
)
def test_card_follows_the_checkpoints_head_and_its_usage_runs(
    head: str, pipeline_tag: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A fine-tuned task head gets its pipeline tag, Auto class and example; the example runs on the folder."""
    import ultramem

    folder = tmp_path / "head"
    torch.manual_seed(0)
    getattr(ultramem, head)(get_config("tiny-ultramem", num_labels=3)).save_pretrained(folder)
    load_tokenizer().save_pretrained(folder)
    text = render_card(folder, REPO)
    assert ModelCard(text).data.pipeline_tag == pipeline_tag
    auto_class = {"text-generation": "AutoModelForCausalLM"}.get(pipeline_tag, head.replace("UltraMem", "AutoModel"))
    assert f'{auto_class}.from_pretrained("{REPO}", trust_remote_code=True)' in text
    exec(_usage_code(text).replace(REPO, str(folder)), {})  # the example, as a user would paste it
    assert capsys.readouterr().out.endswith("\n")  # printed its answer (an untrained QA head may pick an empty span)


# --- which scores a card may show, which checkpoints get a card, previews --------------------------------------


@pytest.fixture(scope="session")
def dense_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("push") / "tiny-dense"
    torch.manual_seed(0)
    build_model(get_config("tiny-dense")).save_pretrained(folder)
    load_tokenizer().save_pretrained(folder)
    return folder


def _scored(folder: Path) -> ModelResult:
    """An entry as ultramem-eval writes it: the folder's path and the fingerprint of its files."""
    from ultramem.eval.checkpoint import fingerprint

    return replace(_result(folder), name=folder.name, fingerprint=fingerprint(folder))


def _push_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()  # what came before (progress bars of saving)
    with pytest.raises(SystemExit) as exit_info:
        push_main(argv)
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("ultramem-push: error: ")
    return line


def test_push_refuses_the_only_entry_when_it_scored_another_checkpoint(
    checkpoint: Path,
    dense_checkpoint: Path,
    tmp_path: Path,
    recorder: _CommitRecorder,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """ultramem-eval of tiny-dense, then ultramem-push of tiny-ultramem with that JSON: refused in one line (the card
    used to show tiny-dense's size, loss and scores under tiny-ultramem's name)."""
    results_json = tmp_path / "results.json"
    write_results(results_json, [_scored(dense_checkpoint)], {"limit": None})
    argv = [str(checkpoint), "--repo-id", REPO, "--results", str(results_json), "--token", "hf_test"]
    line = _push_error(argv, capsys)
    assert f"no entry scored this checkpoint {checkpoint}" in line and "tiny-dense" in line
    assert recorder.calls == []


def test_push_matches_the_entry_by_content_not_by_folder(
    checkpoint: Path, tmp_path: Path, recorder: _CommitRecorder, capsys: pytest.CaptureFixture[str]
) -> None:
    """Scored, then moved: the fingerprint still matches. Scored, then changed in place: refused."""
    scored = tmp_path / "scored" / "tiny-ultramem"
    shutil.copytree(checkpoint, scored)
    results_json = tmp_path / "results.json"
    write_results(results_json, [_scored(scored)], {"limit": None})
    moved = tmp_path / "moved" / "tiny-ultramem"
    shutil.copytree(scored, moved)
    assert push_main([str(moved), "--repo-id", REPO, "--results", str(results_json), "--token", "hf_test"]) == 0
    (call,) = recorder.calls
    card = {op.path_in_repo: op for op in call["operations"]}["README.md"].path_or_fileobj.decode("utf-8")
    assert "## Evaluation" in card and "model-index" in card
    capsys.readouterr()

    config = json.loads((scored / "config.json").read_text(encoding="utf-8"))
    (scored / "config.json").write_text(json.dumps({**config, "aux_loss_alpha": 0.5}), encoding="utf-8")
    line = _push_error([str(scored), "--repo-id", REPO, "--results", str(results_json), "--token", "hf_test"], capsys)
    assert "scored other files (config or weights changed since)" in line and len(recorder.calls) == 1


def test_push_refuses_a_checkpoint_that_is_not_ultramem(
    tmp_path: Path, recorder: _CommitRecorder, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plain Llama would get a card claiming ultramem built it, with remote-code instructions for code it lacks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path / "llama"
    config = LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    load_tokenizer().save_pretrained(folder)
    line = _push_error([str(folder), "--repo-id", REPO, "--token", "hf_test"], capsys)
    assert f"checkpoint {folder}: model_type 'llama' is not an UltraMem checkpoint" in line
    assert recorder.calls == [] and not (folder / "README.md").exists()


def test_cards_tokenizer_line_trusts_the_remote_code(checkpoint: Path) -> None:
    """Without trust_remote_code, AutoTokenizer prompts [y/N] where ultramem is not installed."""
    assert f'AutoTokenizer.from_pretrained("{REPO}", trust_remote_code=True)' in render_card(checkpoint, REPO)


def test_dry_run_prints_the_card_and_touches_nothing(
    checkpoint: Path, tmp_path: Path, recorder: _CommitRecorder, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoint, folder)
    (folder / "README.md").write_text("my notes", encoding="utf-8")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    results_json = tmp_path / "results.json"
    write_results(results_json, [_scored(folder)], {"limit": None})
    assert push_main([str(folder), "--repo-id", REPO, "--results", str(results_json), "--dry-run"]) == 0  # no token
    out, err = capsys.readouterr()
    assert out.rstrip("\n") == render_card(folder, REPO, result=_scored(folder), settings={"limit": None}).rstrip("\n")
    assert err.startswith(f"ultramem-push: dry run, nothing sent: {REPO} would get ") and "model.safetensors" in err
    assert recorder.calls == [] and {p.name: p.read_bytes() for p in folder.iterdir()} == before


CARD_SNIPPET_SCRIPT = """
import sys
if sys.argv[2] == "not-installed":
    sys.modules["ultramem"] = None  # remote code only
exec(open(sys.argv[1]).read(), {})
assert "ultramem" not in sys.modules or sys.modules["ultramem"] is None, "the snippet imported the package"
print("RAN")
"""


@pytest.mark.parametrize("mode", ["not-installed", "installed-not-imported"])
@pytest.mark.parametrize("head", ["UltraMemForCausalLM", "UltraMemForSequenceClassification"])
def test_card_snippet_runs_in_a_fresh_process_through_remote_code(head: str, mode: str, tmp_path: Path) -> None:
    """The card says `ultramem` need not be installed: its usage example runs on the saved folder in a process that
    cannot import the package, and in one that does not import it; no prompt (stdin closed)."""
    import os
    import subprocess
    import sys

    import ultramem

    folder = tmp_path / "head"
    torch.manual_seed(0)
    getattr(ultramem, head)(get_config("tiny-ultramem", num_labels=3)).save_pretrained(folder)
    load_tokenizer().save_pretrained(folder)
    snippet = tmp_path / "snippet.py"
    snippet.write_text(_usage_code(render_card(folder, REPO)).replace(REPO, str(folder)))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", CARD_SNIPPET_SCRIPT, str(snippet), mode], env=env, cwd=tmp_path,
        capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0 and "RAN" in done.stdout, done.stderr[-3000:]


def test_the_cards_value_lr_record_is_the_trainers():
    """The card reads the value-LR settings under the name the trainer saves them (the layers keep the card from
    importing the training package)."""
    from ultramem.hub_cards.card import VALUE_LR_RECORD
    from ultramem.training.schedule import ValueLearningRate

    assert VALUE_LR_RECORD == ValueLearningRate.__name__
    assert set(ValueLearningRate().state()["args"]) == {"value_lr_multiplier", "value_lr_decay"}


def test_card_names_the_successor_variant_and_its_switches():
    """A card of an UltraMemV2 or Memory+ config says which design it is and lists the switches that are on."""
    from ultramem.hub_cards.card import _kind, _memory_section
    from ultramem.presets import get_config

    v2, memory_plus, v1 = (get_config(name) for name in ("tiny-ultramemv2", "tiny-memoryplus", "tiny-ultramem"))
    assert _kind(v2).startswith("UltraMemV2") and _kind(memory_plus).startswith("Memory+")
    assert "| Value gate / pre-value dim | peer / 32 |" in _memory_section(v2)
    assert "| Value pool shared by the memory layers (rows) | 131,072 |" in _memory_section(v2)
    assert "| Site | instead_of_mlp |" in _memory_section(memory_plus)
    assert "Site" not in _memory_section(v1) and _kind(v1) == "UltraMem memory layers"


def test_card_describes_the_placement_of_the_memory_site():
    """V1's skip-layer words ("reads the input of block a, adds after block b") only for `memory_site="block"`: a
    V2 memory sits beside each block's MLP, a Memory+ one replaces it (the card said V1's words beside "Site | mlp")."""
    from ultramem.hub_cards.card import _memory_section

    v2, memory_plus, v1 = (get_config(name) for name in ("tiny-ultramemv2", "tiny-memoryplus", "tiny-ultramem"))
    v1_words = "reads the input of block a, adds after block b"
    assert f"| Placement (a, b), 0-based blocks: {v1_words} | (0, 1), (2, 3) |" in _memory_section(v1)
    blocks = ", ".join(str(a) for a, _ in v2.memory_layers)
    assert f"beside block a's MLP, reading the MLP's input, its output added with the MLP's | {blocks} |" in (
        _memory_section(v2)
    )
    assert "in place of block a's MLP, reading the MLP's input, its output added instead | 1, 3 |" in (
        _memory_section(memory_plus)
    )
    assert v1_words not in _memory_section(v2) and v1_words not in _memory_section(memory_plus)


QUANTIZED_SNIPPET_SCRIPT = """
import sys
if sys.argv[2] == "not-installed":
    sys.modules["ultramem"] = None  # remote code only
assert "ultramem" not in sys.modules or sys.modules["ultramem"] is None
names = {}
exec(open(sys.argv[1]).read(), names)
assert type(names["model"]).__module__.startswith("transformers_modules."), type(names["model"]).__module__
print("RAN", names["model"].config.memory_quantization)
"""


@pytest.fixture(scope="session")
def int4_checkpoint(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ultramem.quantize import convert

    return convert(checkpoint, tmp_path_factory.mktemp("push") / "tiny-int4", "int4")


def test_quantized_checkpoints_card_states_the_table_format_and_how_to_load_it(
    checkpoint: Path, int4_checkpoint: Path
) -> None:
    text = render_card(int4_checkpoint, REPO)
    assert "causal language model (UltraMem memory layers, int4 value tables)" in text
    fmt = "int4, rowwise, a scale and a bias per group of 64 columns"  # tiny's 64-column MCS chunk: int4's default
    assert f"| Value table format (quantized: frozen in training) | {fmt} |" in text
    assert "install it (`pip install ultramem`), no import needed" in text and "need not be installed" not in text
    assert 'memory_offload="disk"' in text
    float_card = render_card(checkpoint, REPO)
    assert "Value table format" not in float_card and "value tables)" not in float_card
    assert "the `ultramem` package need not be installed" in float_card


@pytest.mark.parametrize("mode", ["installed-not-imported", "not-installed"])
def test_quantized_cards_snippet_runs_where_the_package_is_installed(
    int4_checkpoint: Path, mode: str, tmp_path: Path
) -> None:
    """The usage example of a quantized checkpoint's card, in a fresh process: it runs where `ultramem` is installed
    but not imported (the shipped code reads the int4 tables with it); where it is not installed, the error says so in
    the line the card's instruction answers."""
    import os
    import subprocess
    import sys

    snippet = tmp_path / "snippet.py"
    snippet.write_text(_usage_code(render_card(int4_checkpoint, REPO)).replace(REPO, str(int4_checkpoint)))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", QUANTIZED_SNIPPET_SCRIPT, str(snippet), mode], env=env, cwd=tmp_path,
        capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300,
    )  # fmt: skip
    if mode == "installed-not-imported":
        assert done.returncode == 0 and "RAN int4" in done.stdout, done.stderr[-3000:]
    else:
        assert done.returncode != 0
        last = done.stderr.strip().splitlines()[-1]
        assert "memory_quantization='int4' needs the `ultramem` package installed (pip install ultramem)" in last, last
