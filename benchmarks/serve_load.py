"""The OpenAI-compatible vLLM server under load, serving an UltraMem checkpoint on the loopback address.

`--clients` concurrent clients (each its own HTTP connection) share `--requests` completions: whole and streamed ones,
prompts of 1 token up to the served length limit (`max_model_len` less the tokens to generate; every tenth one at the
limit), greedy and sampled, some with stop strings; some clients hang up after the first tokens of a stream, and every
`--malformed-every`-th request is malformed (a prompt over the limit, bad parameters, bad JSON), which must get a 4xx.
Figures: requests served, errors (anything else: a 5xx, a dropped connection, a stream without its end, a stop string
in the text, a request not sent within `--time-limit`), p50 / p99 of the time to first token and of the time per
further token of the streams, and of the whole completions' latency; the RSS of the server's processes (the API
server, its engine core and worker) at the start, after `--warmup` unmeasured passes of the same requests and after
the measured pass, each once the server is idle again (and sampled during the pass); the server idle (no request
running or waiting, no KV block in use) and still answering afterwards; and the first `--sample` greedy completions'
token ids against Transformers' `generate` on the same checkpoint.

Every loop is bounded: requests by count and by `--time-limit`, each request by `--request-timeout`, the server's start
by `STARTUP_S`, waiting for it to be idle by `IDLE_S`.

Run it in the vLLM environment (docs/serving.md builds .venv-vllm), on the main job's checkpoint (README command 1);
it starts the server (its log in the temporary folder) and stops it at the end:

    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=2 .venv-vllm/bin/python benchmarks/serve_load.py \\
        --checkpoint runs/main_job/tiny-ultramem --clients 32 --requests 400

or against a server already running on that checkpoint: `--url http://127.0.0.1:8000` (its memory is reported
when `--pid` gives its process). Writes benchmarks/results/serve_load.json and .png; the tables are printed last.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from lib import cli, report

STARTUP_S = 300  # the server's start: importing vLLM, loading the model, profiling (30-60 s on a small CPU)
IDLE_S = 30  # after the load: aborted streams are freed within a scheduler step or two
RSS_EVERY_S = 2.0
STOP = ["\n", " the"]
SERVER_FLAGS = ["--dtype", "float32", "--enforce-eager", "--seed", "0"]


@dataclass
class Request:
    """One request of the plan: `kind` is complete, stream, hang_up (a stream closed by the client after
    `hang_up_after` tokens) or malformed (`problem` says what is wrong; `body` is then bytes as sent)."""

    kind: str
    body: dict[str, Any] | bytes
    sample: bool = False  # greedy, whole, no stop: compared with Transformers
    hang_up_after: int = 0
    problem: str = ""


@dataclass
class Outcome:
    """What the client saw; `error` is None when the request was answered as it should be."""

    kind: str
    prompt_len: int
    error: str | None = None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    ttft_s: float | None = None
    per_token_s: float | None = None
    latency_s: float | None = None


def plan(
    model: str, count: int, limit: int, max_tokens: int, vocab: int, sample: int, malformed_every: int, seed: int = 0
) -> list[Request]:
    """`count` requests in the order they are sent; the first `sample` whole completions are greedy samples, and
    every `malformed_every`-th request is the next of `malformed_requests`."""
    rng = random.Random(seed)
    longest = limit - max_tokens
    malformed = malformed_requests(model, limit, vocab)
    requests, samples = [], 0
    for i in range(count):
        if i % malformed_every == malformed_every - 1:
            requests.append(malformed[(i // malformed_every) % len(malformed)])
            continue
        length = longest if i % 10 == 0 else min(longest, round(math.exp(rng.uniform(0, math.log(longest)))))
        body: dict[str, Any] = dict(model=model, prompt=[rng.randrange(10, 50000) for _ in range(length)])
        kind = rng.choices(("complete", "stream", "hang_up"), weights=(45, 45, 10))[0]
        if kind == "complete" and samples < sample:
            samples += 1
            body.update(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            requests.append(Request(kind, body, sample=True))
            continue
        # no per-request `seed`: vLLM 0.32's CPU engine dies on a seeded prompt longer than a prefill chunk
        # (docs/serving.md#under-load)
        body.update(max_tokens=rng.randint(1, max_tokens), temperature=rng.choice((0.0, 0.7, 1.0)))
        if rng.random() < 0.25:
            body["stop"] = STOP
        requests.append(Request(kind, body, hang_up_after=rng.randint(1, 3) if kind == "hang_up" else 0))
    return requests


def malformed_requests(model: str, limit: int, vocab: int) -> list[Request]:
    """Requests the server must refuse with a 4xx, each naming its problem."""
    good = dict(model=model, prompt=[11, 12, 13], max_tokens=4)
    changes = {
        "prompt over the length limit": dict(prompt=[11] * (limit + 1)),
        "negative temperature": dict(temperature=-1.0),
        "max_tokens 0": dict(max_tokens=0),
        "top_p above 1": dict(top_p=1.5),
        "token id outside the vocabulary": dict(prompt=[11, vocab + 5]),
        "unknown model": dict(model="no-such-model"),
        "a string for max_tokens": dict(max_tokens="many"),
        "empty prompt": dict(prompt=[]),
        "more logprobs than the server allows": dict(logprobs=1000),
    }
    requests = [
        Request("malformed", json.dumps({**good, **change}).encode(), problem=p) for p, change in changes.items()
    ]
    return requests + [
        Request("malformed", b'{"model": "' + model.encode() + b'", "prompt": [11, 1', problem="bad JSON")
    ]


async def send(session: aiohttp.ClientSession, url: str, request: Request) -> Outcome:
    """Send one request and check its answer; a failure of the connection is the outcome's error, not raised."""
    body = request.body
    prompt_len = len(body["prompt"]) if isinstance(body, dict) else 0
    outcome = Outcome(request.kind, prompt_len)
    data = body if isinstance(body, bytes) else json.dumps({**body, "return_token_ids": True,
                                                             "stream": request.kind != "complete"}).encode()  # fmt: skip
    start = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/completions", data=data, headers={"Content-Type": "application/json"}) as r:
            if request.kind == "malformed":
                await r.read()
                if not 400 <= r.status < 500:
                    outcome.error = f"{request.problem}: HTTP {r.status}, not a 4xx"
            elif r.status != 200:
                outcome.error = f"HTTP {r.status}: {(await r.text())[:300]}"
            elif request.kind == "complete":
                choice = (await r.json())["choices"][0]
                outcome.token_ids, outcome.finish_reason = choice["token_ids"], choice["finish_reason"]
                outcome.error = _stop_string_error(request, choice)
            else:
                await _read_stream(r, request, outcome, start)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as error:
        outcome.error = f"{type(error).__name__}: {error}"
    outcome.latency_s = time.perf_counter() - start
    return outcome


async def _read_stream(response: aiohttp.ClientResponse, request: Request, outcome: Outcome, start: float) -> None:
    """Read server-sent events until [DONE] (or close the connection after `hang_up_after` tokens)."""
    text, first, last, after_first = "", None, None, 0
    async for line in response.content:
        line = line.decode().strip()
        if line == "data: [DONE]":
            break
        if not line.startswith("data: "):
            continue
        event = json.loads(line[len("data: ") :])
        if "choices" not in event:  # an error after the 200: {"error": {"message": ..., "code": ...}}
            outcome.error = f"error in the stream: {json.dumps(event)[:300]}"
            return
        choice = event["choices"][0]
        ids = choice.get("token_ids") or []
        text += choice.get("text") or ""
        outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason
        if ids:
            last = time.perf_counter()
            if first is None:
                first, outcome.ttft_s = last, last - start
            else:
                after_first += len(ids)
            outcome.token_ids += ids
        if request.kind == "hang_up" and len(outcome.token_ids) >= request.hang_up_after:
            response.close()  # the connection goes: the server must abort the request
            break
    else:
        outcome.error = "the stream ended without [DONE]"
    if after_first:
        outcome.per_token_s = (last - first) / after_first
    outcome.error = outcome.error or _stop_string_error(request, dict(text=text, finish_reason=outcome.finish_reason))


def _stop_string_error(request: Request, choice: dict[str, Any]) -> str | None:
    stop = request.body.get("stop") or []
    found = [s for s in stop if s in (choice.get("text") or "")]
    return f"stop string {found[0]!r} in the text" if found else None


async def drive(
    url: str, requests: list[Request], clients: int, time_limit: float, timeout: float, pid: int | None
) -> tuple[list[Outcome], list[tuple[int, float]]]:
    """`clients` clients, each with its own connection, take the requests in order until none is left or
    `time_limit` seconds have passed (a request not sent by then is an error); meanwhile the server's RSS (MiB, all
    its processes) is sampled every RSS_EVERY_S seconds: (requests answered, MiB), to see whether it levels off."""
    pending = iter(enumerate(requests))
    outcomes: list[Outcome | None] = [None] * len(requests)
    deadline = time.monotonic() + time_limit
    trace: list[tuple[int, float]] = []

    async def sample_rss() -> None:
        while pid is not None:
            trace.append((sum(o is not None for o in outcomes), sum(server_rss_mib(pid).values())))
            await asyncio.sleep(RSS_EVERY_S)

    async def client() -> None:
        limits = aiohttp.TCPConnector(limit=1, force_close=False)
        async with aiohttp.ClientSession(connector=limits, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            for i, request in pending:
                if time.monotonic() > deadline:
                    outcomes[i] = Outcome(request.kind, 0, error=f"not sent within --time-limit {time_limit:g} s")
                    continue
                outcomes[i] = await send(session, url, request)

    sampler = asyncio.create_task(sample_rss())
    await asyncio.gather(*(client() for _ in range(clients)))
    sampler.cancel()
    return outcomes, trace  # type: ignore[return-value]


def run_load(
    url: str, requests: list[Request], clients: int, time_limit: float, timeout: float, pid: int | None = None
) -> tuple[list[Outcome], list[tuple[int, float]]]:
    """`drive` from synchronous code (the script, the test)."""
    return asyncio.run(drive(url, requests, clients, time_limit, timeout, pid))


def get_json(url: str, path: str) -> Any:
    with urllib.request.urlopen(f"{url}{path}", timeout=10) as response:
        return json.loads(response.read())


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def engine_gauges(url: str) -> dict[str, float]:
    """The engine's requests running and waiting and the fraction of KV-cache blocks in use (/metrics)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    gauges = {name.removeprefix("vllm:"): 0.0 for name in names}
    for line in lines:
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            gauges[name.removeprefix("vllm:")] += float(line.rsplit(" ", 1)[1])
    return gauges


def wait_idle(url: str) -> dict[str, float]:
    """The gauges once no request runs or waits (or after IDLE_S seconds, as they are then)."""
    deadline = time.monotonic() + IDLE_S
    while True:
        gauges = engine_gauges(url)
        idle = gauges["num_requests_running"] == gauges["num_requests_waiting"] == gauges["kv_cache_usage_perc"] == 0
        if idle or time.monotonic() > deadline:
            return gauges
        time.sleep(0.5)


def server_rss_mib(pid: int) -> dict[str, float]:
    """RSS in MiB of the server process and each process under it (vLLM's engine core), by 'name pid'."""
    root = psutil.Process(pid)
    return {f"{p.name()} {p.pid}": p.memory_info().rss / 2**20 for p in (root, *root.children(recursive=True))}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def start_server(checkpoint: Path, flags: list[str], log: Path, env: dict[str, str]) -> Iterator[tuple[str, int]]:
    """vLLM's OpenAI-compatible server on `checkpoint` at 127.0.0.1 (as docs/serving.md starts it), with `flags`:
    (its URL, its PID) once it answers /health; stopped (SIGTERM, then SIGKILL after 60 s) on exit. A server that
    exits or is not healthy within STARTUP_S raises with the end of its log."""
    port = free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint)]
    command += ["--host", "127.0.0.1", "--port", str(port), *flags]
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + STARTUP_S
            while not healthy(url):
                if process.poll() is not None or time.monotonic() > deadline:
                    tail = log.read_text()[-3000:]
                    raise RuntimeError(f"the server did not become healthy (exit code {process.poll()}):\n{tail}")
                time.sleep(2)
            yield url, process.pid
        finally:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def percentiles(values: list[float | None]) -> dict[str, float | None]:
    """p50 and p99 in ms (nearest rank), None without values."""
    ordered = sorted(1e3 * v for v in values if v is not None)
    if not ordered:
        return {"p50_ms": None, "p99_ms": None, "n": 0}
    rank = lambda q: ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]  # noqa: E731
    return {"p50_ms": rank(0.50), "p99_ms": rank(0.99), "n": len(ordered)}


def summarize(requests: list[Request], outcomes: list[Outcome], wall_s: float) -> dict[str, Any]:
    """Counts and latency percentiles of a load run."""
    served = [o for o in outcomes if o.error is None and o.kind != "malformed"]
    streams = [o for o in outcomes if o.error is None and o.kind in ("stream", "hang_up")]
    tokens = sum(len(o.token_ids) for o in served)
    return {
        "requests": len(requests),
        "served": len(served),
        "refused_4xx": sum(o.error is None and o.kind == "malformed" for o in outcomes),
        "malformed": sum(r.kind == "malformed" for r in requests),
        "hang_ups": sum(r.kind == "hang_up" for r in requests),
        "streamed": sum(r.kind in ("stream", "hang_up") for r in requests),
        "with_stop_strings": sum(isinstance(r.body, dict) and "stop" in r.body for r in requests),
        "finished_by_stop_string": sum(o.finish_reason == "stop" for o in served),
        "errors": [f"request {i} ({o.kind}): {o.error}" for i, o in enumerate(outcomes) if o.error is not None],
        "generated_tokens": tokens,
        "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s,
        "time_to_first_token": percentiles([o.ttft_s for o in streams]),
        "time_per_token": percentiles([o.per_token_s for o in streams]),
        "whole_completion_latency": percentiles([o.latency_s for o in served if o.kind == "complete"]),
    }


def greedy_mismatches(checkpoint: Path, requests: list[Request], outcomes: list[Outcome]) -> tuple[int, list[str]]:
    """(samples compared, the ones whose server ids differ from Transformers' greedy `generate`, float32)."""
    import torch

    from ultramem import UltraMemForCausalLM

    model = UltraMemForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    pairs = [(r.body, o) for r, o in zip(requests, outcomes, strict=True) if r.sample and o.error is None]
    differ = []
    with torch.no_grad():
        for body, outcome in pairs:
            n = body["max_tokens"]
            ids = model.generate(torch.tensor([body["prompt"]]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
            expected = ids[0, len(body["prompt"]) :].tolist()
            if outcome.token_ids != expected:
                differ.append(f"prompt of {len(body['prompt'])}: server {outcome.token_ids} != {expected}")
    return len(pairs), differ


def still_serving(url: str, model: str) -> bool:
    """A completion answered after the load."""
    body = json.dumps(dict(model=model, prompt=[11, 12, 13], max_tokens=2, temperature=0.0)).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.status == 200 and len(json.loads(response.read())["choices"]) == 1


@dataclass
class Load:
    """How hard a run pushes: `requests`, each generating up to `max_tokens`, sent `warmup` times unmeasured before
    the measured pass (the first pass fills caches kept per batch shape, e.g. oneDNN's kernels for each number of
    tokens in a step: the memory's growth over a repeat is what a leak would show); the first `sample` whole
    completions are greedy and checked."""

    clients: int = 32
    requests: int = 400
    warmup: int = 1
    max_tokens: int = 32
    sample: int = 16
    malformed_every: int = 12
    time_limit: float = 900.0
    request_timeout: float = 300.0


def measure(url: str, pid: int | None, checkpoint: Path, load: Load) -> tuple[dict[str, Any], list[Outcome]]:
    """Warm-up, RSS, the load, the server idle again, RSS, a last completion, the greedy sample: the figures."""
    model_info = get_json(url, "/v1/models")["data"][0]
    model, limit = model_info["id"], model_info["max_model_len"]
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    start_rss = server_rss_mib(pid) if pid else None
    requests = plan(model, load.requests, limit, load.max_tokens, vocab, load.sample, load.malformed_every)
    trace: list[tuple[int, float]] = []  # (requests answered in all passes, MiB)
    for done in range(load.warmup):
        _, sampled = run_load(url, requests, load.clients, load.time_limit, load.request_timeout, pid)
        trace += [(done * len(requests) + n, mib) for n, mib in sampled]
        wait_idle(url)
    before = server_rss_mib(pid) if pid else None
    start = time.perf_counter()
    outcomes, sampled = run_load(url, requests, load.clients, load.time_limit, load.request_timeout, pid)
    trace += [(load.warmup * len(requests) + n, mib) for n, mib in sampled]
    figures = summarize(requests, outcomes, time.perf_counter() - start)
    figures["idle_after"] = wait_idle(url)
    after = server_rss_mib(pid) if pid else None
    figures["still_serving"] = still_serving(url, model)
    compared, differ = greedy_mismatches(checkpoint, requests, outcomes)
    figures.update(greedy_compared=compared, greedy_differ=differ, max_model_len=limit, load=asdict(load))
    figures.update(rss_mib=dict(at_start=start_rss, before=before, after=after), rss_trace_mib=trace)
    if before and after:
        figures["rss_warmup_growth_mib"] = sum(before.values()) - sum(start_rss.values())
        figures["rss_growth_mib"] = sum(after.values()) - sum(before.values())
    return figures, outcomes


def parse_args():
    parser = cli.make_parser(__doc__, "serve_load", device=False, timed=False)
    add = parser.add_argument
    add("--checkpoint", type=Path, default=Path("runs/main_job/tiny-ultramem"), help="the folder served")
    add("--url", default=None, help="a running server on --checkpoint (default: start one)")
    add("--pid", type=int, default=None, help="with --url: the server's process, for its memory")
    add("--clients", type=int, default=Load.clients, help="concurrent clients")
    add("--requests", type=int, default=Load.requests, help="requests measured")
    add("--warmup", type=int, default=Load.warmup, help="unmeasured passes of the same requests before")
    add("--max-tokens", type=int, default=Load.max_tokens, help="most tokens generated per request")
    add("--sample", type=int, default=Load.sample, help="greedy completions compared with Transformers")
    add("--max-model-len", type=int, default=None, help="the started server's length limit (default: the model's)")
    add("--max-num-seqs", type=int, default=32, help="the started server's sequence slots")
    add("--malformed-every", type=int, default=Load.malformed_every, help="one malformed request in this many")
    add("--time-limit", type=float, default=Load.time_limit, help="seconds after which no request is sent")
    add("--request-timeout", type=float, default=Load.request_timeout, help="seconds one request may take")
    args = cli.resolve(parser.parse_args(), "serve_load")
    cli.at_least(args, clients=1, requests=1, warmup=0, max_tokens=1, sample=0, malformed_every=1)
    if not (args.checkpoint / "config.json").exists():
        raise SystemExit(f"--checkpoint: {args.checkpoint} has no config.json (README command 1 writes the default)")
    return args


def main() -> None:
    args = parse_args()
    load = Load(**{key: getattr(args, key) for key in Load.__dataclass_fields__})
    if args.url:
        figures, outcomes = measure(args.url.rstrip("/"), args.pid, args.checkpoint, load)
        figures["server"] = f"running at {args.url}"
    else:
        flags = [*SERVER_FLAGS, "--max-num-seqs", str(args.max_num_seqs)]
        flags += ["--max-model-len", str(args.max_model_len)] if args.max_model_len else []
        log = Path(tempfile.gettempdir()) / f"{args.name}-server.log"
        env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_KVCACHE_SPACE": "2", **os.environ}
        with start_server(args.checkpoint, flags, log, env) as (url, pid):
            figures, outcomes = measure(url, pid, args.checkpoint, load)
        figures["server"] = " ".join(["python -m vllm.entrypoints.openai.api_server", str(args.checkpoint), *flags])
        print(f"the server's log: {log}")
    if not args.no_plot:
        report.plot(
            args.results_dir / f"{args.name}.png", _panels(outcomes, figures["rss_trace_mib"]), "vLLM server under load"
        )
    report.finish(args, {"figures": figures}, _tables(figures))


def _tables(figures: dict[str, Any]) -> str:
    counts = ("requests", "served", "malformed", "refused_4xx", "streamed", "hang_ups", "with_stop_strings",
              "finished_by_stop_string", "generated_tokens", "greedy_compared", "rss_warmup_growth_mib", "rss_growth_mib")  # fmt: skip
    rows = [dict(figure=key, value=figures.get(key)) for key in counts]
    rows += [dict(figure="errors", value=len(figures["errors"])), dict(figure="greedy_differ",
             value=len(figures["greedy_differ"]))]  # fmt: skip
    latencies = [dict(figure=key, **figures[key]) for key in ("time_to_first_token", "time_per_token",
                 "whole_completion_latency")]  # fmt: skip
    return (
        report.format_table(rows, ("figure", "value"))
        + "\n\n"
        + report.format_table(latencies, ("figure", "n", "p50_ms", "p99_ms"))
    )


def _panels(outcomes: list[Outcome], trace: list[tuple[int, float]]) -> list[report.Panel]:
    """The distributions of the latencies (fraction of requests within x ms), time to first token against the
    prompt's length, and the server's RSS as the requests are answered."""
    served = [o for o in outcomes if o.error is None and o.kind != "malformed"]
    curves = {}
    for label, values in (
        ("time to first token", [o.ttft_s for o in served]),
        ("time per further token", [o.per_token_s for o in served]),
        ("whole completion", [o.latency_s for o in served if o.kind == "complete"]),
    ):
        ordered = sorted(1e3 * v for v in values if v is not None)
        curves[label] = (ordered, [(i + 1) / len(ordered) for i in range(len(ordered))])
    streams = [o for o in served if o.ttft_s is not None]
    scatter = {"streams": ([o.prompt_len for o in streams], [1e3 * o.ttft_s for o in streams])}
    return [
        report.Panel("latency distribution", "fraction of requests", curves, xlabel="ms"),
        report.Panel("time to first token", "ms", scatter, xlabel="prompt tokens", linestyle="none", ylog=True),
        report.Panel(
            "server RSS, all processes",
            "MiB",
            {"RSS": tuple(zip(*trace, strict=True)) or ((), ())},
            xlabel="requests answered (the warm-up passes first)",
            xlog=False,
        ),  # fmt: skip
    ]


if __name__ == "__main__":
    main()
