"""Shared test setup: offline Hub, few threads, a compiled-graph cache per CPU dispatch level, and the `config` fixture
(the small config with every feature on; the helpers the tests share are in model_support.py)."""

import getpass
import os
import tempfile

import torch

if not torch.cuda.is_available():  # Triton kernels run in its interpreter; set before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Inductor's compiled-graph cache is not keyed on the CPU vector width (torch 2.13): a graph generated for AVX-512 and
# reloaded under ATEN_CPU_CAPABILITY=avx2 stores 8 of every 16 lanes (garbage indices), the reverse overruns its
# buffers. Each dispatch level the suite runs under gets a cache folder of its own (inherited by launched processes).
if capability := os.environ.get("ATEN_CPU_CAPABILITY"):
    default_cache = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache
    if os.path.basename(cache) != f"capability-{capability}":
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, f"capability-{capability}")

import pytest  # noqa: E402
from model_support import small_config  # noqa: E402

from ultramem import UltraMemConfig  # noqa: E402

# Two threads, shared between pytest-xdist's workers (`-n auto`: one per core) rather than oversubscribing the cores
torch.set_num_threads(max(1, min(2, torch.get_num_threads()) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


@pytest.fixture
def config() -> UltraMemConfig:
    return small_config()


# CI's time budget (issue 44): the tests that take over half a minute under the suite's load (two workers on the
# 2-core CI machine), by node-id prefix, with the seconds each test may take there (setup, call and teardown); they
# are marked `slow`, so `-m "not slow"` leaves them out of a quick local run (CI runs everything). A test over its
# budget, or an unlisted one over the default, is named at the end of the run: list it here or make it cheaper.
DEFAULT_BUDGET_S = 30
SLOW_TEST_BUDGETS_S = {
    "tests/test_readme_commands.py::TestBlocksOfDocsEvaluationMd": 130,  # lm_eval / ultramem-eval on ten benchmarks
    "tests/test_readme_commands.py::TestBlocksOfDocsTrainingMd": 70,
    "tests/test_readme_commands.py::TestBlocksOfDocsServingMd": 90,  # vLLM's environment: a server, an engine
    "tests/test_readme_commands.py::TestBlocksOf": 60,  # a page's first block on a worker runs the main job's 2 steps
    "tests/benchmarks/test_decode_kernels.py::test_the_triton_memory_layer": 130,  # four models through Inductor
    "tests/benchmarks/test_bench_generate.py::test_bench_generate_times": 60,
    "tests/benchmarks/test_gpu_campaign.py": 500,  # the whole GPU campaign at smoke size (.ci/gpu_kit_check.sh)
    "tests/eval/test_eval.py::test_lm_eval_cli": 75,
    "tests/eval/test_eval.py::test_ultramem_eval_reports_missing_benchmarks": 45,
    "tests/eval/test_eval.py::test_results_are_written_after_each_checkpoint": 50,
    "tests/quantized/test_quantized_remote_code.py::test_plain_lm_eval_cli": 45,
    "tests/quantized/test_bench_quantized.py::test_lm_eval_scores_every_variant": 45,
    "tests/kernels/test_kernels.py::test_model_trains_through_the_kernels": 45,  # Triton's interpreter, a training
    "tests/training/test_retrieval_health.py": 70,  # the main job's recipe, 20 steps per preset
    "tests/training/test_training_distributed.py": 90,  # DeepSpeed and FSDP2 launchers, 2 processes
    "tests/parallel/test_memory_parallel_resume.py": 70,
    "tests/training/test_training_resume.py": 60,  # the training CLI launched, killed, resumed
    "tests/model/test_variants.py::test_save_and_load_in_a_fresh_process": 50,
    "tests/serving/test_vllm_offline.py::test_compiled_mode": 200,  # Inductor's compile of a model
    "tests/serving/test_vllm_offline.py::test_tensor_parallel": 80,  # two worker processes
    "tests/serving/test_vllm_offline.py": 60,  # an engine each
    "tests/serving/test_vllm_server.py": 60,
}


def time_budget_s(nodeid: str) -> int:
    return next((s for prefix, s in SLOW_TEST_BUDGETS_S.items() if nodeid.startswith(prefix)), DEFAULT_BUDGET_S)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if time_budget_s(item.nodeid) > DEFAULT_BUDGET_S:
            item.add_marker(pytest.mark.slow)


def pytest_terminal_summary(terminalreporter) -> None:
    seconds: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                seconds[report.nodeid] = seconds.get(report.nodeid, 0.0) + report.duration
    over = [(s, nodeid) for nodeid, s in seconds.items() if s > time_budget_s(nodeid)]
    if over:
        terminalreporter.section("over CI's time budget (tests/conftest.py: SLOW_TEST_BUDGETS_S)")
        for s, nodeid in sorted(over, reverse=True):
            terminalreporter.write_line(f"{s:7.1f} s > {time_budget_s(nodeid)} s  {nodeid}")
