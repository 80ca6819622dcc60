"""lm-eval scoring of UltraMem checkpoints: the task group, the local-data readers, the lm_eval CLI, ultramem-eval."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ultramem.eval import tasks_path
from ultramem.eval.benchmarks import BENCHMARKS, group_entries, select
from ultramem.eval.cli import main as eval_main
from ultramem.eval.local_data import LocalDataMissing, read_local
from ultramem.eval.offline_group import METADATA_HINT
from ultramem.presets import get_config
from ultramem.sizing import build_model
from ultramem.tokenization import load_tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "eval"
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in OFFLINE_ENV.items():
        monkeypatch.setenv(key, value)


def _save_checkpoint(folder: Path, preset: str, **overrides) -> Path:
    torch.manual_seed(0)
    build_model(get_config(preset, **overrides)).save_pretrained(folder)
    load_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-ultramem", "tiny-ultramem")


@pytest.fixture(scope="session")
def short_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-ultramem with the 512 positions the tiny presets had: BBH CoT's 1024-token budget does not fit."""
    return _save_checkpoint(tmp_path_factory.mktemp("ckpt") / "short", "tiny-ultramem", max_position_embeddings=512)


# --- the task group ------------------------------------------------------------------------------------------


def test_group_lists_the_ten_benchmarks_with_the_papers_shots() -> None:
    assert (Path(tasks_path()) / "ultramem_paper.yaml").is_file()
    assert (Path(tasks_path()) / "ultramem_paper_offline.yaml").is_file()
    entries = group_entries()
    assert set(entries) == {b.task for b in BENCHMARKS}
    shots = {name: entry["num_fewshot"] for name, entry in entries.items()}
    # stated by the paper: BBH CoT 3-shot, WinoGrande and TriviaQA 5-shot; the rest LLaMA-3's conventions
    assert shots == {
        "mmlu": 5, "triviaqa": 5, "gpqa_diamond_zeroshot": 0, "arc_challenge": 25, "bbh_cot_fewshot": 3,
        "boolq": 0, "hellaswag": 0, "winogrande": 5, "drop": 3, "agieval_en": 0,
    }  # fmt: skip


def test_task_selection_names_the_allowed_values() -> None:
    assert [b.key for b in select("ultramem_paper")] == [b.key for b in BENCHMARKS]
    assert [b.key for b in select("bbh_cot_fewshot,drop,bbh")] == ["bbh", "drop"]
    with pytest.raises(ValueError, match=r"unknown task 'hellaswag_typo'; allowed: ultramem_paper, arc_challenge"):
        select("hellaswag_typo")


# --- local copies in their published formats ------------------------------------------------------------------


def test_readers_give_the_hub_columns_that_lm_eval_configs_use() -> None:
    mmlu = read_local(FIXTURES, "cais/mmlu", "anatomy")
    assert set(mmlu) == {"test", "dev"} and len(mmlu["dev"]) == 5
    assert mmlu["test"][0]["answer"] == 0 and len(mmlu["test"][0]["choices"]) == 4  # the CSV's answer letter is A

    arc = read_local(FIXTURES, "allenai/ai2_arc", "ARC-Challenge")
    first = arc["test"][0]
    assert first["question"].startswith("An astronomer observes")
    assert first["choices"]["label"][first["choices"]["label"].index(first["answerKey"])] == "C"
    assert len(arc["train"]) == 26  # the Dev file stands in for the AI2 train split

    boolq = read_local(FIXTURES, "aps/super_glue", "boolq")["validation"]
    assert set(boolq["label"]) <= {0, 1} and len(boolq) == 10

    wino = read_local(FIXTURES, "allenai/winogrande", "winogrande_xl")["validation"][0]
    assert wino["answer"] == "2" and "_" in wino["sentence"]

    trivia = read_local(FIXTURES, "mandarjoshi/trivia_qa", "rc.nocontext")["validation"][0]
    assert trivia["question"] == "Brunswick, Lancastrian and Pearl Pickler are types of which vegetable"
    assert "Onion" in trivia["answer"]["aliases"]

    bbh = read_local(FIXTURES, "SaylorTwift/bbh", "navigate")["test"]
    assert set(bbh.column_names) == {"input", "target"}

    agieval = read_local(FIXTURES, "hails/agieval-lsat-ar", None)["test"][0]
    assert agieval["query"].endswith("A: Among A through E, the answer is") and len(agieval["choices"]) == 5
    math = read_local(FIXTURES, "hails/agieval-math", None)["test"][0]
    assert math["query"].endswith("A: The answer is") and math["answer"]


def test_lm_evals_own_document_processing_accepts_the_local_rows() -> None:
    from lm_eval.tasks.drop import utils as drop_utils
    from lm_eval.tasks.gpqa.zeroshot import utils as gpqa_utils
    from lm_eval.tasks.hellaswag import utils as hellaswag_utils

    hellaswag = hellaswag_utils.process_docs(read_local(FIXTURES, "Rowan/hellaswag", None)["validation"])
    assert len(hellaswag) == 10
    assert hellaswag[0]["query"] == "Roof shingle removal: A man is sitting on a roof. he"
    assert hellaswag[0]["gold"] == 3 and len(hellaswag[0]["choices"]) == 4

    gpqa = gpqa_utils.process_docs(read_local(FIXTURES, "Idavidrein/gpqa", "gpqa_diamond")["train"])
    assert gpqa[0]["answer"] in {"(A)", "(B)", "(C)", "(D)"}
    assert "1.5 atm" in [gpqa[0][f"choice{i}"] for i in range(1, 5)]

    drop = drop_utils.process_docs(read_local(FIXTURES, "EleutherAI/drop", None)["validation"])
    by_id = {doc["id"]: doc for doc in drop}
    # DROP's F1 path: number, span, date and multi-span answers of the made-up fixture score as DROP defines
    assert drop_utils.process_results(by_id["madeup-drop-q1"], ["2300"]) == {"em": 1.0, "f1": 1.0}
    assert drop_utils.process_results(by_id["madeup-drop-q2"], ["the engineer Ada Thornton"])["em"] == 1.0
    assert drop_utils.process_results(by_id["madeup-drop-q3"], ["14 May 1827"])["f1"] == 1.0
    partial = drop_utils.process_results(by_id["madeup-drop-q4"], ["Brookhaven"])
    assert 0.0 < partial["f1"] < 1.0
    assert drop_utils.process_results(by_id["madeup-drop-q1"], ["1200"])["f1"] == 0.0


def test_a_missing_benchmark_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(LocalDataMissing, match=r"drop[/\\]drop_dataset_dev\.json"):
        read_local(tmp_path, "EleutherAI/drop", None)
    with pytest.raises(LocalDataMissing, match="not a directory"):
        read_local(tmp_path / "absent", "cais/mmlu", "anatomy")


def test_no_real_gpqa_item_is_in_the_fixtures() -> None:
    text = (FIXTURES / "gpqa" / "gpqa_diamond.csv").read_text(encoding="utf-8")
    questions = read_local(FIXTURES, "Idavidrein/gpqa", "gpqa_diamond")["train"]["Question"]
    assert all(q.startswith("A made-up test item, not from GPQA") for q in questions) and "madeup-gpqa" in text


# --- the plain lm_eval command line on a saved checkpoint -----------------------------------------------------


def _samples(folder: Path, task: str) -> list[dict]:
    (path,) = folder.rglob(f"samples_{task}_*.jsonl")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_lm_eval_cli_scores_the_offline_group_on_the_benchmarks_present(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """With some benchmarks' files left out, the group scores the others and names the missing ones in one line (it
    used to abort). MMLU and AGIEval (84 of the group's tasks) are left out too, which keeps this run short; all ten
    are scored by evaluation.md's command, run as written in tests/test_readme_commands.py."""
    data = tmp_path / "eval"
    shutil.copytree(FIXTURES, data)
    left_out = ("hellaswag", "mmlu", "agieval")
    for folder in left_out:
        shutil.rmtree(data / folder)
    command = [
        sys.executable, "-m", "lm_eval",
        "--model", "hf",
        "--model_args", f"pretrained={tiny_checkpoint},trust_remote_code=True,dtype=float32",
        "--include_path", tasks_path(),
        "--tasks", "ultramem_paper_offline",
        "--metadata", json.dumps({"data_dir": str(data)}),
        "--limit", "1",
        "--gen_kwargs", "max_gen_toks=16",
        "--device", "cpu",
        "--output_path", str(tmp_path),
        "--log_samples",
    ]  # fmt: skip
    # ~30 s on an idle 2-core machine; the limit only stops a hung run
    done = subprocess.run(command, env={**os.environ, **OFFLINE_ENV}, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    (line,) = [line for line in done.stderr.splitlines() if "not scored" in line]
    assert line.startswith("ultramem_paper_offline: not scored, local files missing: "), line
    assert f"hellaswag (missing local benchmark file {data}/hellaswag/hellaswag_val_full.txt.bz2)" in line
    assert "mmlu (missing local benchmark file" in line and "agieval_en (missing local benchmark file" in line
    assert METADATA_HINT not in done.stderr  # lm-eval logged it once per member task (101 lines)
    (results_file,) = tmp_path.rglob("results_*.json")
    output = json.loads(results_file.read_text(encoding="utf-8"))
    scores = {**output["results"], **output["groups"]}
    for bench in BENCHMARKS:
        if bench.key in left_out:
            assert bench.task not in scores, bench
        else:
            assert 0.0 <= scores[bench.task][bench.metric] <= 1.0, bench
    assert output["n-shot"]["arc_challenge"] == 25 and output["n-shot"]["winogrande"] == 5
    assert output["n-shot"]["drop"] == 3

    # log-likelihood multiple choice: one score per choice, acc is the argmax
    for sample in _samples(tmp_path, "arc_challenge"):
        loglikelihoods = [float(r[0]) for r in sample["filtered_resps"]]
        assert len(loglikelihoods) == len(sample["doc"]["choices"]["text"])
        assert sample["acc"] == float(loglikelihoods.index(max(loglikelihoods)) == sample["target"])
    # generate_until: the answer stops before any of TriviaQA's stop sequences
    for sample in _samples(tmp_path, "triviaqa"):
        until = sample["arguments"]["gen_args_0"]["arg_1"]["until"]
        assert {"\n", ".", ","} <= set(until)
        assert not any(stop in sample["resps"][0][0] for stop in until)
    # BBH: the score is on the answer extracted after "the answer is", "[invalid]" when there is none
    for sample in _samples(tmp_path, "bbh_cot_fewshot_navigate"):
        found = re.findall(r"(?<=the answer is )(.*)(?=.)", sample["resps"][0][0])
        assert sample["filtered_resps"][0] == (found[0] if found else "[invalid]")
        assert sample["exact_match"] == float(sample["filtered_resps"][0] == sample["target"])
    # DROP: F1 of each generated answer against the made-up item's gold answers
    from lm_eval.tasks.drop.utils import process_results

    for sample in _samples(tmp_path, "drop"):
        assert sample["f1"] == process_results(sample["doc"], [sample["filtered_resps"][0]])["f1"]


def test_lm_eval_cli_refuses_a_generation_budget_the_context_cannot_hold(
    short_checkpoint: Path, tmp_path: Path
) -> None:
    """`lm_eval ... --tasks ultramem_paper_offline` on a 512-position model: one line naming the task and the
    --gen_kwargs that fits, before any request runs (lm-eval asserted at BBH's first generation, after the other
    benchmarks ran for minutes, and every result was lost)."""
    data = tmp_path / "eval"
    for key in ("arc", "bbh"):
        shutil.copytree(FIXTURES / key, data / key)
    command = [
        sys.executable, "-m", "lm_eval", "--model", "hf",
        "--model_args", f"pretrained={short_checkpoint},trust_remote_code=True,dtype=float32",
        "--include_path", tasks_path(), "--tasks", "ultramem_paper_offline",
        "--metadata", json.dumps({"data_dir": str(data)}), "--limit", "1", "--device", "cpu",
        "--output_path", str(tmp_path / "out"),
    ]  # fmt: skip
    done = subprocess.run(command, env={**os.environ, **OFFLINE_ENV}, capture_output=True, text=True, timeout=900)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        r"lm_eval: error: bbh_cot_fewshot_\w+ may generate 1024 tokens and the model's context is 512 "
        r"\(max_position_embeddings\): lm-eval would stop there after the other tasks ran; pass "
        r"--gen_kwargs max_gen_toks=N with N < 512 .*",
        last,
    ), last
    assert "arc_challenge" not in done.stdout and not (tmp_path / "out").exists()  # nothing was scored


def test_lm_eval_cli_names_a_missing_data_folder_in_one_line(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """A `data_dir` that is not there ends the plain `lm_eval` run with one line naming it and the option (it was
    lm-eval's 60-line traceback through its task building), and nothing is scored."""
    command = [
        sys.executable, "-m", "lm_eval", "--model", "hf",
        "--model_args", f"pretrained={tiny_checkpoint},trust_remote_code=True,dtype=float32",
        "--include_path", tasks_path(), "--tasks", "ultramem_boolq_offline",
        "--metadata", json.dumps({"data_dir": str(tmp_path / "eval")}), "--limit", "1", "--device", "cpu",
        "--output_path", str(tmp_path / "out"),
    ]  # fmt: skip
    done = subprocess.run(command, env={**os.environ, **OFFLINE_ENV}, capture_output=True, text=True, timeout=900)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"lm_eval: error: data_dir {tmp_path / 'eval'} is not a directory (--metadata"), last
    assert not (tmp_path / "out").exists()


# --- ultramem-eval ----------------------------------------------------------------------------------------------


def test_ultramem_eval_reports_missing_benchmarks_and_compares_checkpoints(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "eval"
    shutil.copytree(FIXTURES, data)
    shutil.rmtree(data / "drop")
    dense = _save_checkpoint(tmp_path / "tiny-dense", "tiny-dense")
    out = tmp_path / "out"
    argv = ["--model", str(tiny_checkpoint), str(dense), "--tasks", "arc_challenge,boolq,drop",
            "--data-dir", str(data), "--limit", "3", "--output", str(out)]  # fmt: skip
    assert eval_main(argv) == 0
    assert "benchmark drop not scored: missing local benchmark file" in capsys.readouterr().err

    payload = json.loads((out / "results.json").read_text(encoding="utf-8"))
    models = {m["name"]: m for m in payload["models"]}
    assert set(models) == {"tiny-ultramem", "tiny-dense"}
    for model in models.values():
        assert set(model["scores"]) == {"arc_challenge", "boolq"}
        assert "drop_dataset_dev.json" in model["missing"]["drop"]
        assert model["lm_eval"]["n-samples"]["boolq"]["effective"] == 3
    assert models["tiny-ultramem"]["params_b"] > models["tiny-dense"]["params_b"]  # memory tables count

    table = (out / "results.md").read_text(encoding="utf-8")
    header, rule, *rows = table.splitlines()
    assert header.split("|")[1:-1][3:] == [" Val. loss "] + [f" {b.title} " for b in BENCHMARKS] + [" Avg "]
    row = dict(zip(header.split("|"), rows[0].split("|"), strict=True))
    assert row[" Model "].strip() == "tiny-ultramem" and row[" DROP "].strip() == "–"
    assert row[" Val. loss "].strip() == "–"  # the untrained checkpoint has no eval_results.json
    scores = models["tiny-ultramem"]["scores"]
    assert float(row[" Avg "]) == pytest.approx(round(sum(scores.values()) / 2, 2), abs=0.01)
    assert "data not available: DROP" in table and "At most 3 documents per task" in table
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tasks", "mmlu,nonesuch"], "unknown task 'nonesuch'; allowed: ultramem_paper"),
        (["--limit", "0"], "--limit 0: give a whole count of documents (>= 1) or a fraction in (0, 1)"),
        (["--limit", "1.5"], "--limit 1.5: give a whole count of documents (>= 1) or a fraction in (0, 1)"),
        (["--data-dir", "/nonexistent/eval"], "--data-dir /nonexistent/eval: not a folder"),
        (["--device", "gpu0"], "--device gpu0: not a torch device"),
    ],
)
def test_ultramem_eval_rejects_bad_input(
    tiny_checkpoint: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        eval_main(["--model", str(tiny_checkpoint), *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def _refused_before_any_benchmark(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one error line of an ultramem-eval run that must stop before it loads any benchmark data."""
    with pytest.raises(SystemExit) as exit_info:
        eval_main([*argv, "--tasks", "arc_challenge", "--data-dir", str(FIXTURES), "--limit", "1"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "loading benchmark data" not in err and "Traceback" not in err  # nothing ran
    (line,) = err.splitlines()
    assert line.startswith("ultramem-eval: error: ")
    return line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_ultramem_eval_refuses_cuda_without_cuda(tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _refused_before_any_benchmark(["--model", str(tiny_checkpoint), "--device", "cuda"], capsys)
    assert "--device cuda: no cuda device on this machine" in line and "use --device cpu" in line


def test_ultramem_eval_refuses_an_output_that_is_a_file(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    taken = tmp_path / "results"
    taken.write_text("not a folder")
    line = _refused_before_any_benchmark(["--model", str(tiny_checkpoint), "--output", str(taken)], capsys)
    assert f"--output {taken}: is a file, not a folder" in line
    assert taken.read_text() == "not a folder"


def test_ultramem_eval_checks_every_checkpoint_config_before_scoring(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A field out of range in the second checkpoint's config.json: one line naming folder and field, nothing ran."""
    bad = tmp_path / "bad-config"
    shutil.copytree(tiny_checkpoint, bad)
    config = json.loads((bad / "config.json").read_text(encoding="utf-8"))
    (bad / "config.json").write_text(json.dumps({**config, "memory_topk": -1}), encoding="utf-8")
    out = tmp_path / "out"
    line = _refused_before_any_benchmark(["--model", str(tiny_checkpoint), str(bad), "--output", str(out)], capsys)
    assert f"--model {bad}: config.json: " in line and "memory_topk" in line and "-1" in line
    assert not out.exists()


def test_ultramem_eval_names_a_truncated_safetensors_file_before_scoring(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An interrupted copy: the second checkpoint's weights lose their last bytes. The file is named up front (it
    used to be a SafetensorError traceback after the first checkpoint's scores were computed, and lost)."""
    cut = tmp_path / "truncated"
    shutil.copytree(tiny_checkpoint, cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    line = _refused_before_any_benchmark(["--model", str(tiny_checkpoint), str(cut)], capsys)
    assert f"--model {cut}: model.safetensors is not a complete safetensors file" in line
    assert "file not fully covered" in line and "truncated" in line


def test_a_short_context_is_refused_before_anything_runs(
    short_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """BBH CoT's 1024-token answers do not fit 512 positions: refused before anything runs, naming the fix."""
    with pytest.raises(SystemExit) as exit_info:
        eval_main(["--model", str(short_checkpoint), "--tasks", "bbh", "--data-dir", str(FIXTURES)])
    assert exit_info.value.code == 2
    assert "may generate 1024; pass --max-gen-toks N with 1 <= N < 512" in capsys.readouterr().err


def test_tiny_presets_fit_every_benchmarks_generation_budget() -> None:
    """The README's main job trains tiny presets: their context leaves room for every generation task of the group,
    as lm-eval's HF model requires (max_gen_toks < max_length), so the all-ten commands run on its checkpoint."""
    from lm_eval.models.utils import normalize_gen_kwargs
    from lm_eval.tasks import TaskManager

    from ultramem.presets import PRESETS

    tasks = TaskManager(include_path=tasks_path(), metadata={"data_dir": str(FIXTURES)}).load(
        ["ultramem_paper_offline"]
    )["tasks"]
    budgets = {
        name: normalize_gen_kwargs(dict(task.config.generation_kwargs or {}), 256)["max_gen_toks"]
        for name, task in tasks.items()
        if task.OUTPUT_TYPE == "generate_until"
    }
    assert max(budgets.values()) == 1024 and any(name.startswith("bbh_cot_fewshot") for name in budgets)
    for preset in (p for p in PRESETS if p.startswith(("tiny-", "small-"))):
        assert get_config(preset).max_position_embeddings > max(budgets.values()), preset


def test_results_are_written_after_each_checkpoint(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """Interrupted while scoring the second checkpoint, the run keeps the first one's results (JSON, table and
    chart, as for one checkpoint), with the settings that say how it ran (they used to be written at the end)."""
    dense = _save_checkpoint(tmp_path / "tiny-dense", "tiny-dense")
    out = tmp_path / "out"
    command = [sys.executable, "-m", "ultramem.eval.cli", "--model", str(tiny_checkpoint), str(dense),
               "--tasks", "arc_challenge", "--data-dir", str(FIXTURES), "--limit", "2", "--output", str(out),
               "--batch-size", "2"]  # fmt: skip
    run = subprocess.Popen(command, env={**os.environ, **OFFLINE_ENV}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    results = out / "results.json"
    try:
        deadline = time.monotonic() + 600
        while not results.exists() and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        still_running = run.poll() is None
        # read at once: the second (small) checkpoint may finish before the interrupt lands
        first = results.read_text(encoding="utf-8") if results.exists() else "{}"
        run.send_signal(signal.SIGINT)
        run.communicate(timeout=120)
    finally:
        run.kill()
    assert still_running, "results.json appeared only when the run had ended"
    assert json.loads(results.read_text(encoding="utf-8"))["models"]  # still readable after the interrupt
    payload = json.loads(first)  # written atomically (rename), so what appeared first is whole
    (model,) = payload["models"]
    assert model["name"] == "tiny-ultramem" and set(model["scores"]) == {"arc_challenge"}
    assert model["fingerprint"].startswith("sha256:")
    settings = payload["settings"]
    assert {k: settings[k] for k in ("dtype", "memory_offload", "batch_size", "device", "limit")} == {
        "dtype": "float32", "memory_offload": None, "batch_size": 2, "device": "cpu", "limit": 2,
    }  # fmt: skip
    assert "| tiny-ultramem |" in (out / "results.md").read_text(encoding="utf-8")
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # one checkpoint gets its chart too


def test_ultramem_eval_needs_a_checkpoint_folder_with_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(SystemExit) as exit_info:
        eval_main(["--model", str(tmp_path), "--data-dir", str(FIXTURES)])
    assert exit_info.value.code == 2
    assert f"--model {tmp_path}: no config.json" in capsys.readouterr().err


def test_shipped_one_benchmark_tasks_are_current(tmp_path: Path) -> None:
    """ultramem_<key>[_offline].yaml are generated from ultramem_paper.yaml (rerun write_task_yamls after a change)."""
    from ultramem.eval.benchmarks import write_task_yamls

    for path in write_task_yamls(tmp_path):
        assert (Path(tasks_path()) / path.name).read_text(encoding="utf-8") == path.read_text(encoding="utf-8"), path
