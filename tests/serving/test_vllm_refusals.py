"""What ultramem.vllm refuses is refused in the main process, before any engine process starts, within seconds, and
is the first error a user reads: in `LLM(...)` (the exception raised to the caller) and from the OpenAI server's
command line (the first error line of its output).

Runs in the vLLM environment (.ci/vllm_tests.sh); skipped where vLLM is not installed.
"""

import json
import os
import re
import subprocess
import sys
import time

import pytest

# A submodule, not "vllm": without vLLM installed, "vllm" is found as this test folder
pytest.importorskip(
    "vllm.entrypoints.llm", reason="vLLM is not installed: .ci/vllm_tests.sh runs these in its own venv"
)

from serving_support import ENGINE_ENV, build_checkpoint  # noqa: E402

REFUSED_WITHIN_S = 10.0  # from the call (vLLM already imported) to the exception; an engine start takes 30-100 s here
# A line that reports an error: a Python exception line, or a log record at level ERROR
ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception|ByVllm)\b.*:|\bERROR\b")

# Run in a child process: vLLM imported and the model's interface info cached first (vLLM inspects a plugin's model
# class once per version of its code, in a subprocess, before any config hook can run), then `LLM(...)` timed.
OFFLINE_CHILD = """
import json, multiprocessing, sys, time
import vllm
from vllm.model_executor.models import ModelRegistry
import ultramem.vllm
from ultramem.vllm.support import UnsupportedByVllm

ultramem.vllm.register()
ModelRegistry.models["UltraMemForCausalLM"].inspect_model_cls()
path, engine = sys.argv[1], json.loads(sys.argv[2])
start = time.monotonic()
try:
    vllm.LLM(model=path, dtype="float32", **engine)
    error = None
except UnsupportedByVllm as refusal:
    error = str(refusal)
print(json.dumps(dict(seconds=time.monotonic() - start, error=error, children=len(multiprocessing.active_children()))))
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm") / "tucker-k5"
    build_checkpoint(path)
    return path


@pytest.mark.parametrize(
    "engine, message",
    [
        (dict(tensor_parallel_size=3), "tensor_parallel_size=3 does not divide UltraMemConfig.memory_num_values"),
        (dict(hf_overrides={"memory_offload": "disk"}), "UltraMemConfig.memory_offload='disk'"),
    ],
    ids=["tensor_parallel", "offloaded_tables"],
)
def test_offline_refusal_is_raised_before_the_engine_starts(checkpoint, engine, message):
    done = subprocess.run(
        [sys.executable, "-c", OFFLINE_CHILD, str(checkpoint), json.dumps(engine)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **ENGINE_ENV},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["error"] is not None and message in result["error"], result
    assert "\n" not in result["error"]
    assert result["children"] == 0, "an engine process was started before the refusal"
    assert result["seconds"] < REFUSED_WITHIN_S, result


def test_server_refusal_is_its_first_error_line(checkpoint):
    """`python -m vllm.entrypoints.openai.api_server` with a refused setting exits with the refusal as the first error
    line of its output, within seconds of parsing its arguments, and no engine core ever logs."""
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint)]
    command += ["--dtype", "float32", "--port", "0", "--hf-overrides", json.dumps({"memory_offload": "cpu"})]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **ENGINE_ENV}
    )
    lines: list[tuple[float, str]] = []
    try:
        for line in process.stdout:
            lines.append((time.monotonic(), line.rstrip("\n")))
        process.wait(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    output = "\n".join(line for _, line in lines)
    errors = [(when, line) for when, line in lines if ERROR_LINE.search(line)]
    assert process.returncode != 0 and errors, output[-3000:]
    first_when, first = errors[0]
    assert first.startswith("ultramem.vllm.support.UnsupportedByVllm: UltraMemConfig.memory_offload='cpu'"), first
    assert "EngineCore" not in output, output[-3000:]
    parsed = next(when for when, line in lines if "non-default args" in line)  # vLLM's first line after its imports
    assert first_when - parsed < REFUSED_WITHIN_S, (first_when - parsed, output[-3000:])
