"""CPU smoke test of benchmarks/bench_generate.py (issue 34, item 5): generate as users call it, per-token times
from one timestamp per new token with the prefill excluded. Structure and consistency only, no timing asserted."""

import json
import statistics

import bench_generate
import pytest


def test_bench_generate_times_every_new_token_after_the_prefill(tmp_path, capsys):
    new_tokens = 4
    argv = ["--device", "cpu", "--sizes", "tiny", "--batch-sizes", "1,2", "--prompt", "8", "--new-tokens",
            str(new_tokens), "--warmup", "1", "--iters", "2", "--statistic", "median", "--moe-impl", "eager",
            "--kinds", "dense,ultramem,moe,engram,engram-disk", "--interleave", "--results-dir", str(tmp_path), "--name", "generate"]  # fmt: skip
    bench_generate.main(argv)
    payload = json.loads((tmp_path / "generate.json").read_text())
    assert payload["complete"] and payload["environment"]["device"].startswith("CPU")
    assert payload["settings"]["interleaved"]
    rows = payload["rows"]
    assert {(r["kind"], r["cache"], r["batch"]) for r in rows} == {
        (kind, cache, batch)
        for kind in ("dense", "ultramem", "moe", "engram", "engram-disk")
        for cache in ("eager", "static")
        for batch in (1, 2)
    }
    for row in rows:
        # one timestamp per new token: new_tokens - 1 per-token times a call, the prefill apart
        assert len(row["token_ms"]) == 2 and all(len(run) == new_tokens - 1 for run in row["token_ms"])
        assert all(t > 0 for run in row["token_ms"] for t in run) and row["prefill_ms"] > 0
        assert row["ms"] == pytest.approx(statistics.median(t for run in row["token_ms"] for t in run))
        assert row["compiled"] is False  # Transformers compiles a static cache's forward on CUDA only
    by_key = {(r["cache"], r["batch"], r["kind"]): r["ms"] for r in rows}
    for ratio in payload["ratios"]:
        key = (ratio["cache"], ratio["batch"])
        assert ratio["ultramem/dense"] == pytest.approx(by_key[(*key, "ultramem")] / by_key[(*key, "dense")])
        assert ratio["moe/ultramem"] == pytest.approx(by_key[(*key, "moe")] / by_key[(*key, "ultramem")])
        assert ratio["engram/dense"] == pytest.approx(by_key[(*key, "engram")] / by_key[(*key, "dense")])
        assert ratio["engram-disk/engram"] == pytest.approx(by_key[(*key, "engram-disk")] / by_key[(*key, "engram")])
    presets = {m["kind"]: (m["preset"], m.get("value_store")) for m in payload["models"]}
    assert presets["engram"] == ("tiny-engram", None) and presets["engram-disk"] == ("tiny-engram", "disk")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["generate.json", "generate.png"]  # table files gone
    assert (tmp_path / "generate.png").stat().st_size > 0
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith("tiny")  # the table is printed last


def test_by_part_times_each_part_of_the_step_in_place(tmp_path, capsys):
    """`--by-part`: each model's memory layers (product-key and n-gram), blocks and LM head, from hooked calls apart
    from the timed ones, and the memory layers' last steps again with warm caches; a dense model has no memory part.
    UltraMem with the C++ kernels shares UltraMem's model."""
    argv = ["--device", "cpu", "--sizes", "tiny", "--batch-sizes", "1", "--prompt", "8", "--new-tokens", "3",
            "--warmup", "0", "--iters", "1", "--caches", "eager", "--kinds", "dense,ultramem,ultramem-cpp,engram",
            "--interleave", "--by-part", "--results-dir", str(tmp_path), "--name", "generate"]  # fmt: skip
    bench_generate.main(argv)
    payload = json.loads((tmp_path / "generate.json").read_text())
    rows = {row["kind"]: row for row in payload["rows"]}
    # UltraMem with the C++ kernels is UltraMem's model (one copy of the weights), its kernels switched at each call
    described = {model["kind"]: model for model in payload["models"]}
    assert (
        described["ultramem-cpp"]["memory_implementation"] == "cpp"
        and "memory_implementation" not in described["ultramem"]
    )
    for kind, row in rows.items():
        parts = row["by_part_ms"]
        assert set(parts) == {"memory", "blocks", "head", "rest", "memory_warm"}
        assert parts["blocks"] > 0 and parts["head"] > 0
        assert (parts["memory"] > 0) == (parts["memory_warm"] > 0) == (kind != "dense")
    assert "where a decode step's time goes" in capsys.readouterr().out
    assert (tmp_path / "generate.png").stat().st_size > 0  # with the step by part


def test_bench_generate_needs_two_new_tokens():
    with pytest.raises(SystemExit, match="--new-tokens must be >= 2"):
        bench_generate.parse_args(["--device", "cpu", "--new-tokens", "1"])
    with pytest.raises(SystemExit, match="--caches"):
        bench_generate.parse_args(["--device", "cpu", "--caches", "paged"])
    with pytest.raises(SystemExit, match="--kinds: the ratios are against dense"):
        bench_generate.parse_args(["--device", "cpu", "--kinds", "ultramem,engram"])
    with pytest.raises(SystemExit, match="no Engram preset at size 1.6b"):
        bench_generate.parse_args(["--device", "cpu", "--sizes", "1.6b", "--kinds", "dense,engram"])
