"""benchmarks/bench_quantized.py measures what it says: zero KL for the float model, a small positive one for int8,
a larger one for int4, table bytes of the format; lm-eval scores each variant with its format in `--model_args`."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from model_support import NGRAM, small_config

from ultramem import UltraMemForCausalLM
from ultramem.tokenization import load_tokenizer

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_quantized.py"
FIXTURES = Path(__file__).resolve().parents[1] / "eval" / "fixtures" / "eval"
sys.path.insert(0, str(SCRIPT.parent))  # the script imports its library, benchmarks/lib, as `lib`
spec = importlib.util.spec_from_file_location("bench_quantized", SCRIPT)
bench_quantized = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = bench_quantized  # dataclasses look their module up there
spec.loader.exec_module(bench_quantized)


def test_measure_orders_the_formats_by_their_error(tmp_path):
    torch.manual_seed(0)
    config = small_config(memory_value_dim=16, memory_num_keys=16, **{**NGRAM, "ngram_head_dim": 16})
    model = UltraMemForCausalLM(config).eval()
    with torch.no_grad():
        for name in model.get_value_table_names():  # the product-key and the n-gram tables
            model.get_parameter(name).normal_(0, 1.0)
    model.save_pretrained(tmp_path)
    blocks = torch.randint(1, 97, (4, 16), generator=torch.Generator().manual_seed(0))
    variants = [("fp32", None, None), ("int8", "int8", None), ("int4-g8", "int4", 8), ("int4-g4", "int4", 4)]
    rows = {row["variant"]: row for row in bench_quantized.measure(tmp_path, blocks, variants, batch_size=2)}
    assert rows["fp32"]["kl_per_token"] == 0 and rows["fp32"]["table_rms_error"] == 0
    assert 0 < rows["int8"]["kl_per_token"] < rows["int4-g4"]["kl_per_token"] < rows["int4-g8"]["kl_per_token"]
    assert 0 < rows["int8"]["table_rms_error"] < 0.01 < rows["int4-g4"]["table_rms_error"]
    num_values = sum(model.get_parameter(name).shape[0] for name in model.get_value_table_names())
    assert num_values > model.config.memory_num_values * 3  # three memory layers and the n-gram tables
    assert rows["fp32"]["table_bytes"] == num_values * 16 * 4
    assert rows["int8"]["table_bytes"] == num_values * 2 * (8 + 8)
    assert rows["int4-g4"]["table_bytes"] == num_values * 4 * (2 + 4)
    assert "| int4-g4 | 4 |" in bench_quantized.markdown(list(rows.values()), 60, "x")


def test_lm_eval_scores_every_variant_with_its_format(tmp_path):
    """The real lm_eval command line, one process per variant, on two BoolQ documents of the test fixtures: the int4
    variant's log-likelihoods differ from fp32's, so the format reached `from_pretrained` through `--model_args`."""
    tokenizer = load_tokenizer()
    torch.manual_seed(0)
    config = small_config(
        vocab_size=len(tokenizer), memory_value_dim=16, memory_num_keys=16, max_position_embeddings=512
    )
    model = UltraMemForCausalLM(config).eval()
    with torch.no_grad():
        for _, layer in model.named_memory_layers():
            layer.values.weight.normal_(0, 1.0)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    run = bench_quantized.TaskRun("boolq", FIXTURES, limit=2, batch_size=2)
    variants = [("fp32", None, None), ("int4-g4", "int4", 4)]
    rows = {row["variant"]: row for row in bench_quantized.score_tasks(tmp_path, variants, run)}
    assert rows["fp32"]["documents"] == rows["int4-g4"]["documents"] == {"boolq": 2}
    assert rows["fp32"]["agreement"] == {"boolq": 1.0} and rows["fp32"]["loglikelihood_change"] == {"boolq": 0.0}
    assert rows["int4-g4"]["loglikelihood_change"]["boolq"] > 0
    assert all(row["scores"]["boolq"] in (0.0, 50.0, 100.0) for row in rows.values())
    assert "| int4-g4 | " in bench_quantized.task_markdown(list(rows.values()), 2)


def _fake_lm_eval(command, **_):
    """Writes what lm_eval writes for one BoolQ document, the same for every variant."""
    out = Path(command[command.index("--output_path") + 1]) / "model"
    out.mkdir(parents=True)
    results = {"results": {"boolq": {"acc,none": 1.0}}, "group_subtasks": {"ultramem_boolq_offline": ["boolq"]}}
    (out / "results_2026-01-01T00-00-00.json").write_text(json.dumps(results))
    sample = {"doc_id": 0, "filtered_resps": [[-2.0, "False"], [-1.0, "True"]], "acc": 1.0}
    (out / "samples_boolq_2026-01-01T00-00-00.jsonl").write_text(json.dumps(sample) + "\n")
    return subprocess.CompletedProcess(command, 0, "", "")


def test_a_format_that_never_reaches_the_model_stops_the_benchmark(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_quantized.subprocess, "run", _fake_lm_eval)
    run = bench_quantized.TaskRun("boolq", FIXTURES, limit=1)
    with pytest.raises(SystemExit, match="int8 scored exactly as fp32 on boolq: the format never reached the model"):
        bench_quantized.score_tasks(tmp_path, [("fp32", None, None), ("int8", "int8", None)], run)
