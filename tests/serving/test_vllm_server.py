"""vLLM's OpenAI-compatible server serving UltraMem: started on 127.0.0.1 by the test, queried over HTTP with
concurrent and streaming completions, then held under a small load (benchmarks/serve_load.py's), stopped by its PID;
the token ids equal Transformers' greedy ones.

Prefix caching is off here (the offline test has it on), so this engine covers the other cache mode.
"""

import json
import os
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

# A submodule, not "vllm": without vLLM installed, "vllm" is found as this test folder (a namespace package on the
# path pytest gives tests/conftest.py)
pytest.importorskip(
    "vllm.entrypoints.llm", reason="vLLM is not installed: .ci/vllm_tests.sh runs these in its own venv"
)

from serving_support import ENGINE_ENV, V2, build_checkpoint, prompts, reference_ids  # noqa: E402

# The server and its load come from benchmarks/serve_load.py (the script of docs/serving.md#under-load)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import serve_load  # noqa: E402

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(base URL, model path, the Transformers model, the server's PID) of UltraMemV2; the server is stopped
    afterwards. (docs/serving.md's server block, run by the vLLM job, serves the main job's UltraMem.)"""
    path = tmp_path_factory.mktemp("vllm") / "checkpoint"
    model = build_checkpoint(path, **V2)
    flags = ["--dtype", "float32", "--max-model-len", "512", "--enforce-eager"]
    flags += ["--max-num-seqs", "4", "--no-enable-prefix-caching", "--seed", "0"]
    with serve_load.start_server(path, flags, path.parent / "server.log", {**os.environ, **ENGINE_ENV}) as (url, pid):
        yield url, path, model, pid


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


def test_completions_match_transformers_then_hold_under_load(server):
    """First alone: 8 concurrent and 4 streamed completions equal Transformers' greedy ids. Then
    benchmarks/serve_load.py's load, small: 16 clients, 80 requests through 4 sequence slots, sent twice (whole and
    streamed, prompts up to the 512-token limit, stop strings, 5 streams hung up after their first tokens, one of each
    of the 10 malformed requests): no error, a 4xx for each malformed request, the engine idle afterwards (the hung-up
    streams aborted and their KV blocks freed), still answering, the server's RSS over the repeated pass within 64 MiB,
    and the greedy sample equal to Transformers'. One test, not two: pytest-xdist's `--dist load`
    (.ci/vllm_tests.sh) may send a module's tests to both workers, and each would start a server (30-50 s)."""
    url, path, model, pid = server
    batch = prompts([1, 3, 17, 40, 75, 110, 160, 200], seed=5)
    expected = reference_ids(model, batch, MAX_TOKENS)
    with ThreadPoolExecutor(len(batch)) as pool:  # 8 requests in flight, 4 sequence slots: continuous batching
        got = list(pool.map(lambda prompt: _completion(url, str(path), prompt), batch))
        streamed = list(pool.map(lambda prompt: _streamed_completion(url, str(path), prompt), batch[:4]))
    for ids, want, prompt in zip(got, expected, batch, strict=True):
        assert ids == want, f"prompt of {len(prompt)} tokens: server {ids} != Transformers {want}"
    for (ids, chunks), want in zip(streamed, expected, strict=False):
        assert ids == want and chunks > 1, (ids, chunks, want)

    load = serve_load.Load(clients=16, requests=80, warmup=1, max_tokens=8, sample=4, malformed_every=8,
                           time_limit=150, request_timeout=60)  # fmt: skip
    figures, _ = serve_load.measure(url, pid, path, load)
    assert figures["errors"] == []
    assert figures["refused_4xx"] == figures["malformed"] == len(serve_load.malformed_requests("m", 512, 1))
    assert figures["served"] == 80 - figures["malformed"] and figures["hang_ups"] >= 3, figures
    assert figures["idle_after"] == dict(num_requests_running=0, num_requests_waiting=0, kv_cache_usage_perc=0)
    assert figures["still_serving"]
    assert figures["rss_growth_mib"] < 64, figures["rss_mib"]
    assert figures["greedy_compared"] == 4 and figures["greedy_differ"] == []
