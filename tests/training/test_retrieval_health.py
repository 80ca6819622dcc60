"""Retrieval stays alive: after a short run of the main job's recipe every memory layer still reads its table about as
widely as chance would, in UltraMem, UltraMemV2 and Memory+; without the query's across-token normalisation it does not
(the control that shows the test can fail). Held-out health is `retrieval_diagnostics` on the validation blocks."""

from __future__ import annotations

import argparse

import pytest

from ultramem.training.main_job import parse_args, train_one

STEPS = 30
# Share of what uniform picks of the same count would read, per memory layer (issue threshold: 0.4)
HEALTHY = 0.4


def _short_run(tmp_path, preset: str, overrides: str | None = None) -> dict[str, float]:
    args: argparse.Namespace = parse_args(
        ["--output_dir", str(tmp_path), "--max_steps", str(STEPS), "--eval_blocks", "16"]
    )
    result = train_one(preset, args, overrides)
    assert result.health_tokens >= 2048
    return result.health


@pytest.mark.parametrize("preset", ["tiny-ultramem", "tiny-ultramemv2", "tiny-memoryplus"])
def test_every_memory_layer_keeps_reading_its_table(tmp_path, preset):
    health = _short_run(tmp_path, preset)
    layers = [value for key, value in health.items() if key.endswith("/usage_vs_uniform")]
    assert len(layers) >= 2 and min(layers) == health["min_usage_vs_uniform"]
    assert health["min_usage_vs_uniform"] >= HEALTHY, health


def test_without_query_normalisation_a_layer_collapses(tmp_path):
    health = _short_run(tmp_path, "tiny-ultramem", "query_norm='none'")
    assert health["min_usage_vs_uniform"] < HEALTHY, health
    assert health["max_input_cosine"] > 0.3, health
