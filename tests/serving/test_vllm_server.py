"""vLLM's OpenAI-compatible server serving UltraMem: started on 127.0.0.1 by the test, queried over HTTP with
concurrent and streaming completions, stopped by its PID; the token ids equal Transformers' greedy ones.

Prefix caching is off here (the offline test has it on), so this engine covers the other cache mode.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

# A submodule, not "vllm": without vLLM installed, "vllm" is found as this test folder (a namespace package on the
# path pytest gives tests/conftest.py)
pytest.importorskip(
    "vllm.entrypoints.llm", reason="vLLM is not installed: .ci/vllm_tests.sh runs these in its own venv"
)

from serving_support import ENGINE_ENV, V2, build_checkpoint, prompts, reference_ids  # noqa: E402

MAX_TOKENS = 16
STARTUP_S = 300


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(base URL, model path, the Transformers model) of UltraMemV2; the server process is stopped by its PID
    afterwards. (docs/serving.md's server block, run by the vLLM job, serves the main job's UltraMem.)"""
    path = tmp_path_factory.mktemp("vllm") / "checkpoint"
    model = build_checkpoint(path, **V2)
    port = _free_port()
    log = (path.parent / "server.log").open("w")
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path), "--host", "127.0.0.1"]
    command += ["--port", str(port), "--dtype", "float32", "--max-model-len", "512", "--enforce-eager"]
    command += ["--max-num-seqs", "4", "--no-enable-prefix-caching", "--seed", "0"]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **ENGINE_ENV})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while not _healthy(url):
            if process.poll() is not None or time.monotonic() > deadline:
                tail = (path.parent / "server.log").read_text()[-3000:]
                pytest.fail(f"the server did not become healthy (exit code {process.poll()}):\n{tail}")
            time.sleep(2)
        yield url, path, model
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def _post(url: str, body: dict):
    request = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    return urllib.request.urlopen(request, timeout=120)


def _completion(url: str, model: str, prompt: list[int]) -> list[int]:
    body = dict(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with _post(url, {**body, "return_token_ids": True}) as response:
        return json.loads(response.read())["choices"][0]["token_ids"]


def _streamed_completion(url: str, model: str, prompt: list[int]) -> tuple[list[int], int]:
    """The token ids of a streamed completion and the number of chunks that carried them."""
    body = dict(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stream=True)
    ids, chunks = [], 0
    with _post(url, {**body, "return_token_ids": True}) as response:
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            token_ids = json.loads(line[len("data: ") :])["choices"][0].get("token_ids") or []
            ids += token_ids
            chunks += bool(token_ids)
    return ids, chunks


def test_concurrent_and_streaming_completions_match_transformers(server):
    url, path, model = server
    batch = prompts([1, 3, 17, 40, 75, 110, 160, 200], seed=5)
    expected = reference_ids(model, batch, MAX_TOKENS)
    with ThreadPoolExecutor(len(batch)) as pool:  # 8 requests in flight, 4 sequence slots: continuous batching
        got = list(pool.map(lambda prompt: _completion(url, str(path), prompt), batch))
        streamed = list(pool.map(lambda prompt: _streamed_completion(url, str(path), prompt), batch[:4]))
    for ids, want, prompt in zip(got, expected, batch, strict=True):
        assert ids == want, f"prompt of {len(prompt)} tokens: server {ids} != Transformers {want}"
    for (ids, chunks), want in zip(streamed, expected, strict=False):
        assert ids == want and chunks > 1, (ids, chunks, want)
