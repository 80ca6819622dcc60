"""The step accounting of issue 34 (benchmarks/lib/step_account.py, bench_decode.py --account): exact splits of
hand-made traces (overlapping kernels, a copy, a kernel past the call's return, a graph replay), and the
consistency of the split of real CPU traces of tiny decode steps. No timing is asserted."""

import argparse

import bench_decode
import pytest
import torch
from lib import models, step_account


@pytest.fixture(scope="module")
def lib():
    return argparse.Namespace(step_account=step_account, models=models, bench_decode=bench_decode)


def x(name, cat, ts, dur, tid=1, correlation=None):
    event = {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "pid": 1}
    if correlation is not None:
        event["args"] = {"correlation": correlation}
    return event


def launch(name, ts, correlation):
    return x(name, "cuda_runtime", ts, 1, correlation=correlation)


def cuda_trace(step_account):
    """Step 1 at 0..100 us: a memory layer (2..8) launches K1 (10..30); the rest launches K2 (25..40, overlapping K1),
    a copy (50..60) and K3 (90..120, past the call's return). Step 2 at 200..250: one graph replay of K4 (205..215)
    and a copy into its static inputs (201..203)."""
    return [
        {"ph": "M", "name": "process_name", "ts": 0, "pid": 1, "tid": 0},
        x(step_account.STEP_RANGE, "user_annotation", 0, 100),
        x(step_account.MEMORY_PREFIX + "model.memory_layers.0", "user_annotation", 2, 6),
        launch("cudaLaunchKernel", 5, 1),
        launch("cudaLaunchKernel", 12, 2),
        launch("cudaMemcpyAsync", 20, 3),
        launch("cudaLaunchKernel", 30, 4),
        x("K1", "kernel", 10, 20, tid=7, correlation=1),
        x("K2", "kernel", 25, 15, tid=8, correlation=2),
        x("Memcpy DtoD", "gpu_memcpy", 50, 10, tid=7, correlation=3),
        x("K3", "kernel", 90, 30, tid=7, correlation=4),
        x(step_account.STEP_RANGE, "user_annotation", 200, 50),
        launch("cudaMemcpyAsync", 200, 5),
        launch("cudaGraphLaunch", 204, 6),
        x("Memcpy HtoD", "gpu_memcpy", 201, 2, tid=7, correlation=5),
        x("K4", "kernel", 205, 10, tid=7, correlation=6),
    ]


def test_a_hand_made_cuda_trace_splits_exactly(lib):
    first, second = lib.step_account.account_trace(cuda_trace(lib.step_account))
    # window 0..120 us; kernels cover 10..40 and 90..120 (60 us), the copy 10 us; gaps 0..10, 40..50, 60..90
    assert first["step_ms"] == pytest.approx(0.120) and first["host_ms"] == pytest.approx(0.100)
    assert first["kernel_ms"] == pytest.approx(0.060) and first["copy_ms"] == pytest.approx(0.010)
    assert (first["gap_before_ms"], first["gap_between_ms"], first["gap_after_ms"]) == pytest.approx((0.010, 0.040, 0))
    assert first["host_runtime_ms"] == pytest.approx(0.004) and (first["kernels"], first["copies"]) == (3, 1)
    assert first["parts"] == {
        "model.memory_layers.0": {"device_ms": pytest.approx(0.020), "launches": 1, "host_ms": pytest.approx(0.006)},
        "rest": {"device_ms": pytest.approx(0.055), "launches": 3},
    }
    assert first["memory_host_ms"] == pytest.approx(0.006)
    # the replay: its kernel belongs to no layer; the copy outside the graph is named
    assert second["step_ms"] == pytest.approx(0.050) and second["graph_launches"] == 1
    assert (second["kernel_ms"], second["copy_ms"], second["gap_before_ms"]) == pytest.approx((0.010, 0.002, 0.001))
    assert second["gap_between_ms"] == pytest.approx(0.002) and second["gap_after_ms"] == pytest.approx(0.035)
    assert set(second["parts"]) == {"graph replay", "rest"} and list(second["outside_graph"]) == ["Memcpy HtoD"]
    split = lib.step_account.median_split([second, first, second])  # the median step, whole
    assert split["step_ms"] == second["step_ms"] and split["steps_ms"] == pytest.approx([0.050, 0.120, 0.050])
    assert split["memory_device_ms"] == 0
    split = lib.step_account.median_split([first, second, first])
    assert split["memory_device_ms"] == pytest.approx(0.020)


def test_device_work_without_its_launch_goes_to_the_step_it_runs_in(lib):
    sa = lib.step_account
    trace = [x(sa.STEP_RANGE, "user_annotation", 0, 10), x(sa.STEP_RANGE, "user_annotation", 100, 10),
             x("K", "kernel", 50, 20, tid=7), x("K", "kernel", 120, 5, tid=7, correlation=42)]  # fmt: skip
    first, second = sa.account_trace(trace)
    assert first["parts"] == {"unlinked": {"device_ms": pytest.approx(0.020), "launches": 1}}
    assert first["step_ms"] == pytest.approx(0.070) and first["gap_after_ms"] == 0
    assert second["parts"]["unlinked"]["launches"] == 1 and sa.median_split([first])["memory_device_ms"] == 0


def test_on_a_cpu_trace_top_level_operators_are_the_kernels(lib):
    sa = lib.step_account
    trace = [
        x(sa.STEP_RANGE, "user_annotation", 0, 50),
        x(sa.MEMORY_PREFIX + "m", "user_annotation", 20, 20),
        x("aten::linear", "cpu_op", 5, 10),
        x("aten::addmm", "cpu_op", 6, 8),  # inside aten::linear: not counted again
        x("aten::topk", "cpu_op", 25, 10),
        x("aten::add", "cpu_op", 30, 0),  # inside aten::topk
    ]
    (split,) = sa.account_trace(trace)
    assert (split["step_ms"], split["kernel_ms"], split["gap_ms"]) == pytest.approx((0.050, 0.020, 0.030))
    assert (split["gap_before_ms"], split["gap_between_ms"], split["gap_after_ms"]) == pytest.approx(
        (0.005, 0.010, 0.015)
    )
    assert split["parts"]["m"]["device_ms"] == pytest.approx(0.010) and split["parts"]["rest"]["launches"] == 1
    assert split["kernels"] == 2 and split["copies"] == 0 and split["graph_launches"] == 0


def test_a_trace_without_steps_is_an_error(lib):
    with pytest.raises(ValueError, match="account step"):
        lib.step_account.median_split(lib.step_account.account_trace([x("aten::add", "cpu_op", 0, 1)]))


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-ultramem"])
def test_a_real_cpu_decode_step_adds_up(lib, preset):
    """An eager tiny decode step profiled on CPU: the parts sum to the step, the memory layers are attributed."""
    args = argparse.Namespace(context=8, warmup=1, iters=1, mode="eager", account=3, device=torch.device("cpu"))
    model = lib.models.build(preset, "cpu", torch.float32, **lib.models.decode_overrides(preset, args)).eval()
    with torch.no_grad():
        step = lib.models.decode_step(model, 2, args)
        split = lib.models.account_decode(model, step, args, 3)["account"]
    assert len(split["steps_ms"]) == 3 and split["step_ms"] > 0 and split["kernels"] > 0
    assert split["kernel_ms"] + split["copy_ms"] + split["gap_ms"] == pytest.approx(split["step_ms"])
    gaps = split["gap_before_ms"] + split["gap_between_ms"] + split["gap_after_ms"]
    assert gaps == pytest.approx(split["gap_ms"]) and min(split["gap_before_ms"], split["gap_after_ms"]) >= 0
    # CPU operators of one thread do not overlap: the parts' device time is the kernel time
    assert sum(p["device_ms"] for p in split["parts"].values()) == pytest.approx(split["kernel_ms"])
    memory = sorted(label for label in split["parts"] if label != "rest")
    if preset == "tiny-ultramem":
        assert memory == [name for name, _ in model.named_memory_layers()] and len(memory) == 2
        assert 0 < split["memory_device_ms"] < split["memory_host_ms"] < split["host_ms"]
    else:
        assert memory == [] and split["memory_device_ms"] == split["memory_host_ms"] == 0


def test_bench_decode_account_adds_the_split_and_ultramem_minus_dense(lib, tmp_path, capsys):
    argv = ["--device", "cpu", "--warmup", "1", "--iters", "1", "--sizes", "tiny", "--batch-sizes", "1",
            "--context", "8", "--moe-impl", "eager", "--account", "2", "--analytic-sizes", "tiny", "--no-plot",
            "--results-dir", str(tmp_path), "--name", "decode_account"]  # fmt: skip
    payload = lib.bench_decode.main(argv)
    assert all(len(row["account"]["steps_ms"]) == 2 for row in payload["rows"])
    by_kind = {row["kind"]: row for row in payload["account"]}
    assert list(by_kind) == ["dense", "ultramem", "moe", "U - D"]
    assert by_kind["U - D"]["gap_ms"] == pytest.approx(by_kind["ultramem"]["gap_ms"] - by_kind["dense"]["gap_ms"])
    assert "Where a step's time goes" in capsys.readouterr().out
