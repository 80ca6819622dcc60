"""The GPU campaign's tooling (benchmarks/gpu/): the plan of its calls, the driver's bookkeeping, the carried kit, the
targets' README, and the campaign end to end at smoke size (run by .ci/gpu_kit_check.sh with the GPU image's versions)."""

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
from gpu import campaign, kit, targets

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.skipif(
    not os.environ.get("ULTRAMEM_GPU_KIT_CHECK"),
    reason="runs in .ci/gpu_kit_check.sh, with the GPU image's package versions and the kit on the path (5 minutes)",
)
def test_gpu_campaign_smoke_runs_by_call_resumes_and_stops_within_its_budget(tmp_path):
    """`gpu/campaign.py --smoke`: the GPU campaign's driver on CPU (kernels in Triton's interpreter). A call runs its
    steps, writing every result and the targets' README; steps that ran are not run again, a budget too small for
    the next step stops cleanly, bad step names are refused."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)

    def campaign(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, str(BENCHMARKS / "gpu" / "campaign.py"), "--smoke", "--results-root", str(tmp_path)]
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


def test_the_first_two_calls_are_planned_inside_their_device_limits():
    """Issue 22: call 1 (540 s, the kit's install and compilation included) checks correctness first, then kernel
    bandwidth, then decoding at 680M; call 2 (240 s) the 151M training step and the 16x slot scaling."""
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


def test_a_campaign_step_cut_at_its_limit_takes_its_workers_with_it(tmp_path):
    """A step stopped by its time limit is killed with the processes it started (its log gives the worker's pid)."""
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


def test_gpu_campaign_steps_of_one_script_write_distinct_results():
    """Two steps of one script under its default --name write the same JSON, the later replacing the earlier; resumable
    steps (bench_quality) add their runs to the results they find instead, so they may share them."""
    for steps in (campaign.gpu_steps(), campaign.smoke_steps()):
        outputs = [(step.script, step.args[step.args.index("--name") + 1] if "--name" in step.args else None)
                   for step in steps if not step.resumable]  # fmt: skip
        assert len(outputs) == len(set(outputs)), outputs


def test_gpu_kit_carries_what_the_image_cannot_satisfy():
    """The kit's decision per requirement: the image's recorded version against the specifier, packages present at
    an unrecorded version taken as satisfying, absent ones carried; markers evaluated for the target Python.
    (`.ci/gpu_kit_check.sh` builds and installs the real kit and runs the campaign's smoke run with it.)"""
    from packaging.requirements import Requirement

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


def test_a_failed_step_runs_again_and_one_cut_at_its_own_limit_only_under_redo():
    """A failure is fixed before the next slot, so the driver reruns it without being told; a step that used its whole
    limit would be cut again, so it waits for --redo (the first H200 slot lost a rerun of check_gpu to this)."""
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


def test_campaign_readme_keeps_its_reading_when_a_step_rewrites_it(tmp_path):
    """The targets table is rewritten after every step; the written reading under `## Reading` stays."""
    state = {"device": "cpu-smoke", "environment": {"torch": torch.__version__}, "steps": {}}
    path = targets.write_readme(tmp_path, state)
    path.write_text(path.read_text() + "\n## Reading\n\nWhy the kernel missed its target.\n")
    state["steps"]["check_gpu"] = dict(call=1, returncode=0, seconds=1.0, limit_s=200, command="python gpu/check.py")
    text = targets.write_readme(tmp_path, state).read_text()
    assert "| check_gpu | 1 | 0 |" in text and text.endswith("\n## Reading\n\nWhy the kernel missed its target.\n")
    assert text.count("\n## Reading\n") == 1
