"""benchmarks/serve_load.py's plan, which its figures rely on (the load itself runs on a real server in the vLLM job:
tests/serving/test_vllm_server.py)."""

import serve_load


def test_the_plan_reaches_the_length_limit_and_sends_every_malformed_request():
    limit, max_tokens = 64, 8
    requests = serve_load.plan("m", 120, limit, max_tokens, vocab=1000, sample=3, malformed_every=10)
    bodies = [r.body for r in requests if r.kind != "malformed"]
    assert max(len(body["prompt"]) + body["max_tokens"] for body in bodies) == limit  # at the limit, never over
    assert min(len(body["prompt"]) for body in bodies) >= 1
    every_problem = {r.problem for r in serve_load.malformed_requests("m", limit, 1000)}
    assert {r.problem for r in requests if r.kind == "malformed"} == every_problem and len(every_problem) == 10
    samples = [r.body for r in requests if r.sample]
    assert len(samples) == 3 and all(b["temperature"] == 0 and b["ignore_eos"] and "stop" not in b for b in samples)
    assert {"complete", "stream", "hang_up"} <= {r.kind for r in requests}
    assert any("stop" in body for body in bodies)
