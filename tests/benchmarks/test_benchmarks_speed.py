"""CPU smoke tests of the speed benchmarks (benchmarks/bench_{decode,scaling,train,vs_ultra_mem,kernels,offload}.py).

Each script runs end to end at tiny sizes and writes its JSON; no timing is asserted. The model paths they time
without a GPU here (StaticCache decoding, the closed-form SVD) are checked in test_modeling.py.
"""

import importlib
import json
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
TIMING = ["--device", "cpu", "--warmup", "1", "--iters", "1"]


@pytest.fixture(scope="module")
def bench():
    """Import a benchmark script as a module (benchmarks/ is on the path: this folder's conftest)."""
    return importlib.import_module


def read(tmp_path: Path, name: str) -> dict:
    payload = json.loads((tmp_path / f"{name}.json").read_text())
    assert payload["environment"]["device"].startswith("CPU") and payload["environment"]["torch"] == torch.__version__
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


def test_bench_decode_interleave_times_the_peers_in_turn(bench, tmp_path, monkeypatch):
    """`--interleave`: the same rows as one model at a time, from steps timed one of each model per round."""
    timing, calls = bench("lib.timing"), []
    time_calls = timing.time_calls

    def recording(fn, device, warmup, iters, **hooks):
        calls.append((fn, warmup, iters))
        return time_calls(fn, device, warmup, iters, **hooks)

    monkeypatch.setattr(timing, "time_calls", recording)
    args = [
        "--device",
        "cpu",
        "--warmup",
        "1",
        "--iters",
        "3",
        "--sizes",
        "tiny",
        "--batch-sizes",
        "1",
        "--context",
        "8",
    ]
    payload = bench("bench_decode").main(
        [
            *args,
            "--moe-impl",
            "eager",
            "--interleave",
            "--no-plot",
            "--results-dir",
            str(tmp_path),
            "--name",
            "decode_interleaved",
        ]
    )
    assert read(tmp_path, "decode_interleaved")["settings"]["interleave"] is True
    assert [(r["kind"], r["batch"], r["status"]) for r in payload["rows"]] == [
        ("dense", 1, "ok"),
        ("ultramem", 1, "ok"),
        ("moe", 1, "ok"),
    ]
    steps = [fn for fn, warmup, iters in calls if (warmup, iters) == (0, 1)]
    assert len(steps) == 9 and len(set(steps)) == 3
    assert steps[3:6] == steps[:3] and steps[6:] == steps[:3]  # one step of each model per round, same order
    assert payload["ratios"][0]["ultramem/dense"] > 0


def test_bench_scaling_grows_slots_and_experts(bench, tmp_path):
    args = [*TIMING, "--slots", "16384,65536", "--batch", "2", "--context", "8", "--moe-impl", "eager", "--no-plot"]
    payload = bench("bench_scaling").main([*args, "--results-dir", str(tmp_path), "--name", "scaling"])
    assert read(tmp_path, "scaling")["settings"]["range"] == 4 and read(tmp_path, "scaling")["complete"]
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
        assert row["aten_ops"] > 0  # one profiled step (on CUDA also its kernels and their time table)
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
    models = bench("lib.models")
    moe = models.build("tiny-moe", torch.device("meta"), torch.bfloat16)
    c = moe.config
    expert = 3 * c.hidden_size * c.intermediate_size
    access = models.decode_memory_access(moe, batch, context=10, bytes_per_value=2)
    assert access.sparse_weights == 2 * c.num_hidden_layers * min(2 * batch, c.num_local_experts) * expert
    assert access.kv_cache == 2 * 2 * batch * 10 * c.num_hidden_layers * c.hidden_size

    ultramem = models.build("tiny-ultramem", torch.device("meta"), torch.bfloat16)
    c = ultramem.config
    rows = min(batch * c.memory_heads * c.memory_topk, c.memory_num_values)
    access = models.decode_memory_access(ultramem, batch, context=10, bytes_per_value=2)
    assert access.sparse_weights == 2 * len(c.memory_layers) * rows * c.memory_value_dim
    dense = models.decode_memory_access(models.build("tiny-dense", torch.device("meta"), torch.bfloat16), batch, 10, 2)
    assert dense.sparse_weights == 0 and dense.kv_cache == access.kv_cache

    both = models.build("tiny-ultramem-engram", torch.device("meta"), torch.bfloat16)  # an n-gram memory reads
    c = both.config  # one row per hash head and order for each token, not H m slots
    rows = min(batch * c.memory_heads * c.memory_topk, c.memory_num_values)
    ngram_rows = batch * (c.ngram_order - 1) * c.ngram_heads
    access = models.decode_memory_access(both, batch, context=10, bytes_per_value=2)
    assert access.sparse_weights == 2 * (
        len(c.memory_layers) * rows * c.memory_value_dim + ngram_rows * c.ngram_head_dim
    )


def test_bad_arguments_name_the_flag(bench):
    with pytest.raises(SystemExit, match="--context must be >= 1"):
        bench("bench_decode").parse_args(["--device", "cpu", "--context", "0"])
    with pytest.raises(SystemExit):  # argparse: unknown size, allowed ones listed on stderr
        bench("bench_decode").parse_args(["--device", "cpu", "--sizes", "7b"])


def test_bench_kernels_runs_its_ops_and_writes_results(bench, tmp_path, capsys):
    """bench_kernels.py at smoke size, the ops of its registry that run without Triton: JSON, PNG and a table per
    op, no timings checked (quantized_lookup_reduce needs Triton: tests/quantized)."""
    ops = ["lookup_reduce", "tucker_candidate_topk", "tucker_topk", "lookup_dot"]
    bench("bench_kernels").main(["--device", "cpu", "--smoke", "--ops", ",".join(ops), "--results-dir", str(tmp_path)])
    report = read(tmp_path, "bench_kernels_cpu")
    assert report["complete"] and [row["op"] for row in report["results"]] == sorted(
        (row["op"] for row in report["results"]), key=ops.index
    )
    assert {(row["op"], row["impl"]) for row in report["results"]} >= {
        (op, impl) for op in ("lookup_reduce", "lookup_dot") for impl in ("torch", "embedding_bag")
    }
    assert all(row["forward_ms"] > 0 for row in report["results"] if row["status"] == "ok")
    assert (tmp_path / "bench_kernels_cpu.png").stat().st_size > 0
    assert capsys.readouterr().out.rstrip().splitlines()[-1].lstrip().startswith("lookup_dot")  # its table last


def test_bench_kernels_times_with_the_shared_timer(bench, monkeypatch):
    """One timing routine for every benchmark: a kernel's time goes through `lib.timing.time_calls`."""
    timing, kernels, calls = bench("lib.timing"), bench("bench_kernels"), []

    def fake(fn, device, warmup, iters, before_each=None, after_each=None):
        calls.append((warmup, iters, before_each))
        return [3.0, 1.0, 2.0], [0.0, 0.0, 0.0]

    monkeypatch.setattr(timing, "time_calls", fake)
    args = kernels.parse_args(["--device", "cpu", "--iters", "3"])
    case = kernels.Case(kernels.memory_shape("151m", 64), torch.float32, args, copy_gbps=1.0)
    assert case.ms(lambda: None) == 2.0
    assert calls == [(1, 3, None)]


def test_bench_offload_builds_loads_offloaded_and_cleans_up(bench, tmp_path):
    runs = "tiny-dense,tiny-disk,tiny-cpu-int4,tiny-disk-int8"
    args = ["--device", "cpu", "--runs", runs, "--batch-sizes", "1", "--new-tokens", "2", "--no-plot"]
    checkpoints = tmp_path / "checkpoints"
    payload = bench("bench_offload").main(
        [
            *args,
            "--checkpoints",
            str(checkpoints),
            "--build",
            "--cleanup",
            "--results-dir",
            str(tmp_path),
            "--name",
            "o",
        ]
    )
    rows = {r["run"]: r for r in read(tmp_path, "o")["rows"]}
    assert rows["tiny-disk"]["offload"] == "disk" and rows["tiny-disk"]["rows_read_per_step"] > 0
    assert (rows["tiny-cpu-int4"]["offload"], rows["tiny-cpu-int4"]["tables"]) == ("cpu", "int4")
    assert rows["tiny-disk-int8"]["tables"] == "int8" and rows["tiny-disk-int8"]["rows_read_per_step"] > 0
    assert all(r["ms"] > 0 and r["peak_rss_gb"] > 0 for r in rows.values()) and payload["summary"]
    assert not any(checkpoints.iterdir())  # built by the run, deleted after it


def test_kernel_table_ranks_profiled_operators_by_their_total_time(bench):
    """The per-kernel table the decode rows carry on CUDA, built here from the same profiler's CPU events."""
    timing = bench("lib.timing")
    from torch.profiler import ProfilerActivity, profile

    big, small = torch.randn(256, 256), torch.randn(4, 4)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            big @ big
        for _ in range(5):
            small + small
    events = [e for e in prof.events() if e.name in ("aten::mm", "aten::add")]
    table = timing.kernel_table(events, top=1)
    assert [row["name"] for row in table["kernel_table"]] == ["aten::mm"] and table["kernel_table"][0]["calls"] == 3
    every = timing.kernel_table(events)["kernel_table"]
    assert {row["name"]: row["calls"] for row in every} == {"aten::mm": 3, "aten::add": 5}
    assert table["kernel_us"] == pytest.approx(sum(row["total_us"] for row in every), abs=0.2)


def test_decode_steps_run_as_generate_runs_them(bench):
    """`as_generate_runs`: inside it UltraMem's memory layers run the decode steps `generate` builds (the same
    logits as the modules' forward), a dense model runs as it is, and the layers are as before after it."""
    models = bench("lib.models")
    torch.manual_seed(0)
    ultramem, dense = (models.build(preset, "cpu", torch.float32).eval() for preset in ("tiny-ultramem", "tiny-dense"))
    prompt, token = torch.randint(3, 1000, (1, 6)), torch.randint(3, 1000, (1, 1))

    def next_logits() -> torch.Tensor:
        cache = ultramem(prompt, use_cache=True).past_key_values
        return ultramem(token, cache=cache).logits

    with torch.no_grad():
        expected = next_logits()
        with models.as_generate_runs(ultramem, dense):
            logits = next_logits()
            assert all(layer._decode is not None for layer in ultramem.model.memory_layers)
        assert all(layer._decode is None and not layer.fixed_weights for layer in ultramem.model.memory_layers)
    torch.testing.assert_close(logits, expected)
