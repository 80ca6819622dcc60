"""CPU smoke tests of the speed benchmarks (benchmarks/bench_{decode,scaling,train,vs_ultra_mem,offload}.py).

Each script runs end to end at tiny sizes and writes its JSON; no timing is asserted. The decode benchmarks'
cache path (StaticCache, prefilled and then extended) is checked against a full forward, and the closed-form
SVD the model uses on accelerators against LAPACK, since neither can be timed here without a GPU.
"""

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import small_config
from transformers import StaticCache

from ultramem import UltraMemForCausalLM, modeling_ultramem
from ultramem.modeling_ultramem import core_svd, svd_2x2

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
TIMING = ["--device", "cpu", "--warmup", "1", "--iters", "1"]


@pytest.fixture(scope="module")
def bench():
    """Import a benchmark script as a module (they import their sibling `_common`)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module
    finally:
        sys.path.remove(str(BENCHMARKS))


def read(tmp_path: Path, name: str) -> dict:
    payload = json.loads((tmp_path / f"{name}.json").read_text())
    assert payload["environment"]["device"].startswith("CPU")
    assert "python" in payload["environment"]["command"]
    return payload


def test_bench_decode_writes_rows_ratios_and_plot(bench, tmp_path, capsys):
    args = [*TIMING, "--sizes", "tiny", "--batch-sizes", "1,2", "--context", "8", "--moe-impl", "eager"]
    bench("bench_decode").main([*args, "--results-dir", str(tmp_path), "--name", "decode"])
    payload = read(tmp_path, "decode")
    rows = payload["rows"]
    assert {(r["kind"], r["batch"]) for r in rows} == {(k, b) for k in ("dense", "ultramem", "moe") for b in (1, 2)}
    assert all(r["status"] == "ok" and r["ms"] > 0 for r in rows)
    # the analytic model: MoE reads more expert bytes as the batch grows, dense reads no sparse bytes
    moe = {r["batch"]: r for r in rows if r["kind"] == "moe"}
    assert moe[2]["sparse_gb"] > moe[1]["sparse_gb"]
    assert all(r["sparse_gb"] == 0 for r in rows if r["kind"] == "dense")
    assert all(r["ultramem/dense"] > 0 and r["moe/ultramem"] > 0 for r in payload["ratios"])
    assert (tmp_path / "decode.png").stat().st_size > 0
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith("tiny")  # the table is printed last


def test_bench_scaling_grows_slots_and_experts(bench, tmp_path):
    args = [*TIMING, "--slots", "16384,65536", "--batch", "2", "--context", "8", "--moe-impl", "eager", "--no-plot"]
    payload = bench("bench_scaling").main([*args, "--results-dir", str(tmp_path), "--name", "scaling"])
    assert read(tmp_path, "scaling")["settings"]["range"] == 4
    small, large = payload["points"]
    for point in payload["points"]:  # physical slots = layers * (keys per axis / sqrt(E))^2, rounded
        assert abs(point["physical_slots"] / point["slots"] - 1) < 0.02
    assert large["experts"] > small["experts"] >= 2
    assert large["ultramem"]["total_params_b"] > small["ultramem"]["total_params_b"]
    assert payload["ultramem_latency_spread"] >= 0


def test_bench_train_times_every_phase(bench, tmp_path):
    args = [*TIMING, "--batch", "1", "--seq-len", "16", "--moe-impl", "eager"]
    bench("bench_train").main([*args, "--results-dir", str(tmp_path), "--name", "train"])
    rows = read(tmp_path, "train")["rows"]
    assert [r["kind"] for r in rows] == ["dense", "ultramem", "moe"]
    for row in rows:
        assert row["status"] == "ok"
        assert 0 < row["forward_ms"] and 0 < row["forward_backward_ms"] and 0 < row["ms"] and 0 < row["optimizer_ms"]
    assert rows[0]["step_vs_dense"] == 1.0


def test_bench_vs_ultra_mem_reports_ratio(bench, tmp_path):
    pytest.importorskip("ultra_mem", reason="the comparison needs `pip install ultra-mem`")
    bench("bench_vs_ultra_mem").main([*TIMING, "--shapes", "smoke", "--results-dir", str(tmp_path), "--name", "vs"])
    ours, theirs = read(tmp_path, "vs")["rows"]
    assert ours["impl"].startswith("ultramem") and theirs["impl"].startswith("ultra-mem")
    assert theirs["forward_vs_ours"] > 0 and theirs["forward_backward_vs_ours"] > 0


@pytest.mark.parametrize("batch", [1, 3, 64])
def test_analytic_access_is_the_papers_formula(bench, batch):
    """Sparse bytes: min(2B, N_moe) experts per MoE layer; min(B H m, N) value rows of Dv per memory layer."""
    common = bench("_common")
    moe = common.build("tiny-moe", torch.device("meta"), torch.bfloat16)
    c = moe.config
    expert = 3 * c.hidden_size * c.intermediate_size
    access = common.decode_memory_access(moe, batch, context=10, bytes_per_value=2)
    assert access.sparse_weights == 2 * c.num_hidden_layers * min(2 * batch, c.num_local_experts) * expert
    assert access.kv_cache == 2 * 2 * batch * 10 * c.num_hidden_layers * c.hidden_size

    ultramem = common.build("tiny-ultramem", torch.device("meta"), torch.bfloat16)
    c = ultramem.config
    rows = min(batch * c.memory_heads * c.memory_topk, c.memory_num_values)
    access = common.decode_memory_access(ultramem, batch, context=10, bytes_per_value=2)
    assert access.sparse_weights == 2 * len(c.memory_layers) * rows * c.memory_value_dim
    dense = common.decode_memory_access(common.build("tiny-dense", torch.device("meta"), torch.bfloat16), batch, 10, 2)
    assert dense.sparse_weights == 0 and dense.kv_cache == access.kv_cache


def test_bad_arguments_name_the_flag(bench):
    with pytest.raises(SystemExit, match="--context must be >= 1"):
        bench("bench_decode").parse_args(["--device", "cpu", "--context", "0"])
    with pytest.raises(SystemExit):  # argparse: unknown size, allowed ones listed on stderr
        bench("bench_decode").parse_args(["--device", "cpu", "--sizes", "7b"])


def test_static_cache_extended_decode_matches_full_forward():
    """The decode benchmarks' cache path: StaticCache prefill, then one token at a time, with a random query conv."""
    config = small_config()
    torch.manual_seed(0)
    model = UltraMemForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "conv" in name:  # the identity init would hide a stale conv state
                param.normal_()
        input_ids = torch.randint(1, config.vocab_size, (2, 9))
        full = model(input_ids).logits
        cache = StaticCache(config=config, max_cache_len=16)
        steps = [model(input_ids[:, :4], past_key_values=cache).logits]
        steps += [model(input_ids[:, t : t + 1], past_key_values=cache).logits for t in range(4, 9)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_closed_form_core_svd_matches_lapack():
    torch.manual_seed(0)
    cores = torch.randn(4096, 2, 2, dtype=torch.float64)
    values, u, t = svd_2x2(cores)
    ref_values, ref_u, ref_t = core_svd(cores)  # LAPACK on CPU
    sign = (u * ref_u).sum(-1, keepdim=True).sign()
    torch.testing.assert_close(values, ref_values, rtol=0, atol=1e-12)
    torch.testing.assert_close(u * sign, ref_u, rtol=0, atol=1e-10)
    torch.testing.assert_close(t * sign, ref_t, rtol=0, atol=1e-10)


def test_model_is_unchanged_with_the_closed_form_svd(monkeypatch):
    """Logits, aux loss and its gradient are the same when the model takes the accelerator (closed-form) path."""
    config = small_config(memory_layers=[[0, 2], [1, 3]])
    torch.manual_seed(0)
    model = UltraMemForCausalLM(config)
    input_ids = torch.randint(1, config.vocab_size, (2, 7))

    def run():
        model.zero_grad()
        out = model(input_ids, labels=input_ids)
        out.loss.backward()
        cores = model.model.memory_layers[0].retrieval.cores.grad.clone()
        return out.logits.detach(), out.aux_loss.detach(), cores

    lapack = run()
    monkeypatch.setattr(modeling_ultramem, "core_svd", svd_2x2)
    closed_form = run()
    for reference, value in zip(lapack, closed_form, strict=True):
        torch.testing.assert_close(value, reference, rtol=1e-5, atol=1e-6)


def test_bench_offload_builds_loads_offloaded_and_cleans_up(bench, tmp_path):
    args = ["--device", "cpu", "--runs", "tiny-dense,tiny-disk", "--batch-sizes", "1", "--new-tokens", "2", "--no-plot"]
    checkpoints = tmp_path / "checkpoints"
    payload = bench("bench_offload").main(
        [*args, "--checkpoints", str(checkpoints), "--build", "--cleanup", "--results-dir", str(tmp_path), "--name", "o"]
    )
    rows = {r["run"]: r for r in read(tmp_path, "o")["rows"]}
    assert rows["tiny-disk"]["offload"] == "disk" and rows["tiny-disk"]["rows_read_per_step"] > 0
    assert all(r["ms"] > 0 and r["peak_rss_gb"] > 0 for r in rows.values()) and payload["summary"]
    assert not any(checkpoints.iterdir())  # built by the run, deleted after it
