"""CPU smoke tests of the speed benchmarks (benchmarks/bench_{decode,scaling,train,vs_ultra_mem,kernels,offload}.py).

Each script runs end to end at tiny sizes and writes its JSON; no timing is asserted. The model paths they time
without a GPU here (StaticCache decoding, the closed-form SVD) are checked in test_modeling.py.
"""

import importlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
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
    from ultramem.sizing import decode_memory_access

    models = bench("lib.models")
    moe = models.build("tiny-moe", torch.device("meta"), torch.bfloat16)
    c = moe.config
    expert = 3 * c.hidden_size * c.intermediate_size
    access = decode_memory_access(moe, batch, context=10, bytes_per_value=2)
    assert access.sparse_weights == 2 * c.num_hidden_layers * min(2 * batch, c.num_local_experts) * expert
    assert access.kv_cache == 2 * 2 * batch * 10 * c.num_hidden_layers * c.hidden_size

    ultramem = models.build("tiny-ultramem", torch.device("meta"), torch.bfloat16)
    c = ultramem.config
    rows = min(batch * c.memory_heads * c.memory_topk, c.memory_num_values)
    access = decode_memory_access(ultramem, batch, context=10, bytes_per_value=2)
    assert access.sparse_weights == 2 * len(c.memory_layers) * rows * c.memory_value_dim
    dense = decode_memory_access(models.build("tiny-dense", torch.device("meta"), torch.bfloat16), batch, 10, 2)
    assert dense.sparse_weights == 0 and dense.kv_cache == access.kv_cache


def test_bad_arguments_name_the_flag(bench):
    with pytest.raises(SystemExit, match="--context must be >= 1"):
        bench("bench_decode").parse_args(["--device", "cpu", "--context", "0"])
    with pytest.raises(SystemExit):  # argparse: unknown size, allowed ones listed on stderr
        bench("bench_decode").parse_args(["--device", "cpu", "--sizes", "7b"])


def test_benchmark_script_writes_results(tmp_path):
    """CPU smoke run of benchmarks/bench_kernels.py at toy sizes: JSON, PNG and a table, no timings checked."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "bench_kernels.py"),
            "--device",
            "cpu",
            "--smoke",
            "--out-dir",
            str(tmp_path),
        ],
        cwd=BENCHMARKS.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads((tmp_path / "bench_kernels_cpu.json").read_text())
    assert report["environment"]["device_type"] == "cpu" and report["results"] and report["complete"]
    assert {"torch", "embedding_bag"} <= {row["impl"] for row in report["results"]}
    assert all(row["forward_ms"] > 0 for row in report["results"] if row["status"] == "ok")
    assert (tmp_path / "bench_kernels_cpu.png").stat().st_size > 0
    assert "forward_ms" in result.stdout.strip().splitlines()[-len(report["results"]) - 2]  # header, rule, rows


def test_bench_kernels_times_with_the_shared_timer(bench, monkeypatch):
    """One timing routine for every benchmark: bench_kernels' median goes through `lib.timing.time_calls`."""
    timing, calls = bench("lib.timing"), []

    def fake(fn, device, warmup, iters, before_each=None, after_each=None):
        calls.append((warmup, iters, before_each))
        return [3.0, 1.0, 2.0], [0.0, 0.0, 0.0]

    monkeypatch.setattr(timing, "time_calls", fake)
    assert bench("bench_kernels").timing.median_ms(lambda: None, torch.device("cpu"), 3) == 2.0
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


@pytest.mark.skipif(
    not os.environ.get("ULTRAMEM_GPU_KIT_CHECK"),
    reason="runs in .ci/gpu_kit_check.sh, with the GPU image's package versions and the kit on the path (5 minutes)",
)
def test_gpu_campaign_smoke_runs_by_call_resumes_and_stops_within_its_budget(tmp_path):
    """`gpu_campaign.py --smoke`: the GPU campaign's driver on CPU (kernels in Triton's interpreter). A call runs its
    steps, writing every result and the targets' README; steps that ran are not run again, a budget too small for
    the next step stops cleanly, bad step names are refused."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)

    def campaign(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, str(BENCHMARKS / "gpu_campaign.py"), "--smoke", "--results-root", str(tmp_path)]
        return subprocess.run([*command, *args], cwd=BENCHMARKS.parent, env=env, capture_output=True, text=True,
                              timeout=1800)  # fmt: skip

    first = campaign("--call", "1")
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    results = tmp_path / "cpu-smoke"
    state = json.loads((results / "campaign.json").read_text())
    assert state["device"] == "cpu-smoke" and state["environment"]["torch"] == torch.__version__
    assert list(state["steps"]) == [
        "check_gpu", "bench_kernels", "bench_quantized_kernel", "bench_lookup_dot", "decode_tiny"]  # fmt: skip
    assert all(
        step["returncode"] == 0 and not step["cut_by_budget"] and step["call"] == 1 for step in state["steps"].values()
    )
    assert state["steps"]["check_gpu"]["env"] == {"TRITON_INTERPRET": "1"}
    checks = json.loads((results / "check_gpu_cpu.json").read_text())
    assert checks["environment"]["device_type"] == "cpu" and len(checks["rows"]) >= 10
    assert all(row["passed"] for row in checks["rows"])
    assert {row["test"].split("[")[0] for row in checks["rows"]} >= {
        "test_lookup_reduce_matches_the_reference", "test_model_forward_backward_triton_vs_torch",
        "test_cached_greedy_generation_triton_vs_torch"}  # fmt: skip
    assert (results / "decode_tiny.json").exists() and (results / "logs" / "decode_tiny.log").stat().st_size > 0
    readme = (results / "README.md").read_text()
    assert f"| {len(checks['rows'])}/{len(checks['rows'])} comparisons within tolerance | met |" in readme
    assert "| Train step UltraMem / dense <= 1.3 (151M) | not measured yet | - |" in readme

    rest = campaign("--budget-s", "1500")  # calls 2, 3, 8 (the mission), 9, 10, 12, 13 (split, generate, fused) at once
    assert rest.returncode == 0, rest.stdout[-4000:] + rest.stderr[-4000:]
    assert (
        "8 step(s) to run: train_tiny, scaling_tiny, quality_tiny, mission, decode_account_tiny, generate_tiny, "
        "decode_fused_selection_tiny, train_fused_selection_tiny"
        in rest.stdout
        and "gpu_campaign: complete" in rest.stdout
    )
    check_mission(results)
    account = json.loads((results / "decode_account_tiny.json").read_text())["account"]
    assert {row["kind"] for row in account} >= {"dense", "ultramem"}, account
    assert json.loads((results / "generate_tiny.json").read_text())["rows"]
    for name in ("decode_fused_selection_tiny", "train_fused_selection_tiny"):
        assert json.loads((results / f"{name}.json").read_text())["settings"]["fused_selection"]
    after = json.loads((results / "campaign.json").read_text())
    assert after["steps"]["decode_tiny"] == state["steps"]["decode_tiny"]  # not run again
    assert (results / "quality_tiny.json").exists() and (results / "train_tiny.json").exists()
    readme = (results / "README.md").read_text()
    for target in ("Train step UltraMem / dense", "Decode latency within 10%", "Decode UltraMem / dense"):
        assert "not measured yet" not in next(line for line in readme.splitlines() if target in line)

    stopped = campaign("--redo", "decode_tiny", "--budget-s", "1")
    assert stopped.returncode == 0 and "stopping before decode_tiny" in stopped.stdout, stopped.stdout[-2000:]
    assert json.loads((results / "campaign.json").read_text())["steps"] == after["steps"]

    refused = campaign("--redo", "bench_everything")
    assert refused.returncode == 2 and "--redo bench_everything: allowed step names are check_gpu" in refused.stderr


def check_mission(results: Path) -> None:
    """mission.py --smoke's record (issue 35): every stage passed; ZeRO-2 over 2 processes as the saved
    TrainingArguments say; finite losses; lm_eval's scores for 3 benchmarks; the card written from them."""
    mission = json.loads((results / "mission.json").read_text())
    assert [(name, stage["returncode"]) for name, stage in mission["stages"].items()] == [
        ("train", 0), ("eval", 0), ("memory", 0), ("card", 0)]  # fmt: skip
    train = mission["train"]
    assert (train["zero_stage"], train["world_size"], train["steps"]) == (2, 2, 4)
    losses = [train["loss_first"], train["loss_last"], *train["eval_losses"]]
    assert len(losses) == 4 and all(math.isfinite(x) and 5 < x < 20 for x in losses), losses
    assert train["tokens_per_second"] > 0
    for health in (train["memory_health_first"], train["memory_health_last"]):  # per layer, as the Trainer logged
        assert all(0 < health[f"memory/layer_{i}/slot_usage"] <= 1 for i in (0, 1)), health
    assert mission["stages"]["train"]["command"][2:4] == ["torch.distributed.run", "--nproc_per_node"]
    assert mission["stages"]["eval"]["command"][2:5] == ["lm_eval", "--model", "hf"]
    scores = mission["eval"]["scores"]
    assert sorted(scores) == ["arc_challenge", "boolq", "winogrande"] and all(0 <= v <= 100 for v in scores.values())
    assert mission["memory"]["memory_implementation"] == "embedding_bag"  # the CPU default, as loaded by lm_eval
    card = Path(mission["card_path"]).read_text()
    assert all(f"{value:.2f}" in card for value in scores.values()) and "ARC-C" in card, card[-2000:]


def test_the_first_two_calls_are_planned_inside_their_device_limits(bench):
    """Issue 22: call 1 (540 s, the kit's install and compilation included) checks correctness first, then kernel
    bandwidth, then decoding at 680M; call 2 (240 s) the 151M training step and the 16x slot scaling."""
    campaign = bench("gpu_campaign")
    steps = campaign.gpu_steps()
    by_call = {call: [s for s in steps if s.call == call] for call in (1, 2)}
    assert [s.name for s in by_call[1]] == ["check_gpu", "bench_kernels", "decode_680m"]
    assert [s.name for s in by_call[2]] == ["train_151m", "scaling_680m"]
    for call, limit in ((1, 540), (2, 240)):
        assert (
            campaign.CALL_BUDGETS[call] < limit and sum(s.seconds for s in by_call[call]) <= campaign.CALL_BUDGETS[call]
        )
    decode = by_call[1][2].args
    assert decode[decode.index("--batch-sizes") + 1] == "1,16,64" and decode[decode.index("--mode") + 1] == "eager"
    slots = [int(n) for n in by_call[2][1].args[by_call[2][1].args.index("--slots") + 1].split(",")]
    assert slots[-1] == 16 * slots[0]


def test_a_campaign_step_cut_at_its_limit_takes_its_workers_with_it(bench, tmp_path):
    """A step stopped by its time limit is killed with the processes it started (its log gives the worker's pid)."""
    campaign = bench("gpu_campaign")
    script = tmp_path / "spawns_a_worker.py"
    script.write_text("import subprocess, sys, time\n"
                      "worker = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
                      "print(worker.pid, flush=True)\n"
                      "time.sleep(120)\n")  # fmt: skip
    (tmp_path / "logs").mkdir()
    record = campaign.run_step(campaign.Step("spawns", 1, 5, str(script)), tmp_path, 5)
    assert record["returncode"] == campaign.TIMED_OUT and record["seconds"] < 60
    worker = int((tmp_path / "logs" / "spawns.log").read_text().split()[0])
    deadline = time.monotonic() + 10  # SIGKILL is delivered at once, but a loaded machine may take a moment to end it
    try:
        while psutil.Process(worker).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.1)
        assert psutil.Process(worker).status() == psutil.STATUS_ZOMBIE  # killed, not yet reaped by init
    except psutil.NoSuchProcess:
        pass


def test_gpu_campaign_steps_of_one_script_write_distinct_results(bench):
    """Two steps of one script under its default --name write the same JSON, the later replacing the earlier; resumable
    steps (bench_quality) add their runs to the results they find instead, so they may share them."""
    campaign = bench("gpu_campaign")
    for steps in (campaign.gpu_steps(), campaign.smoke_steps()):
        outputs = [(step.script, step.args[step.args.index("--name") + 1] if "--name" in step.args else None)
                   for step in steps if not step.resumable]  # fmt: skip
        assert len(outputs) == len(set(outputs)), outputs


def test_gpu_kit_carries_what_the_image_cannot_satisfy(bench):
    """The kit's decision per requirement: the image's recorded version against the specifier, packages present at
    an unrecorded version taken as satisfying, absent ones carried; markers evaluated for the target Python.
    (`.ci/gpu_kit_check.sh` builds and installs the real kit and runs the campaign's smoke run with it.)"""
    from packaging.requirements import Requirement

    kit = bench("gpu_kit")
    assert kit.image_satisfies(Requirement("transformers>=5.24,<5.25")) is False  # the image has 5.17.0
    assert kit.image_satisfies(Requirement("transformers>=5.17")) is True
    assert kit.image_satisfies(Requirement("tokenizers>=0.23.1,<0.24")) is True
    assert kit.image_satisfies(Requirement("regex>=2025.10.22")) is None  # present, version not recorded
    assert kit.image_satisfies(Requirement("datasets>=3.0")) is False  # absent
    names = {r.name for r in kit.campaign_requirements()}
    assert {"torch", "transformers", "pytest", "deepspeed", "lm-eval"} <= names
    assert kit.SDIST_ONLY == {"deepspeed"} and "scikit-learn" in kit.NOT_IMPORTED  # the mission's kit (issue 35)
    marker = Requirement('tomli>=2; python_version < "3.11"').marker
    assert not marker.evaluate(kit.marker_environment("3.12")) and marker.evaluate(kit.marker_environment("3.10"))
    line = kit.install_command(kit.KIT, call=2)
    assert "--no-index --no-deps --target" in line and ".whl/*.whl" in line and line.endswith("--call 2")


def test_a_failed_step_runs_again_and_one_cut_at_its_own_limit_only_under_redo(bench):
    """A failure is fixed before the next slot, so the driver reruns it without being told; a step that used its whole
    limit would be cut again, so it waits for --redo (the first H200 slot lost a rerun of check_gpu to this)."""
    campaign = bench("gpu_campaign")
    steps = campaign.gpu_steps()
    record = dict(call=1, seconds=1.0, limit_s=200, cut_by_budget=False, command="")
    state = {"steps": {step.name: dict(record, returncode=0) for step in steps}}
    state["steps"]["check_gpu"]["returncode"] = 1
    state["steps"]["bench_kernels"]["returncode"] = campaign.TIMED_OUT
    state["steps"]["decode_680m"].update(returncode=campaign.TIMED_OUT, cut_by_budget=True)

    def names(redo: set[str]) -> list[str]:
        return [step.name for step in campaign.pending(steps, state, redo)]

    assert names(set()) == ["check_gpu", "decode_680m"]
    assert names({"bench_kernels"}) == ["check_gpu", "bench_kernels", "decode_680m"]


def test_campaign_readme_keeps_its_reading_when_a_step_rewrites_it(bench, tmp_path):
    """The targets table is rewritten after every step; the written reading under `## Reading` stays."""
    targets = bench("lib.targets")
    state = {"device": "cpu-smoke", "environment": {"torch": torch.__version__}, "steps": {}}
    path = targets.write_readme(tmp_path, state)
    path.write_text(path.read_text() + "\n## Reading\n\nWhy the kernel missed its target.\n")
    state["steps"]["check_gpu"] = dict(call=1, returncode=0, seconds=1.0, limit_s=200, command="python check_gpu.py")
    text = targets.write_readme(tmp_path, state).read_text()
    assert "| check_gpu | 1 | 0 |" in text and text.endswith("\n## Reading\n\nWhy the kernel missed its target.\n")
    assert text.count("\n## Reading\n") == 1


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
