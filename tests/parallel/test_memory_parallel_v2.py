"""UltraMemV2's tables on 2 gloo processes: a V2 model (PEER pre-values, a memory layer beside every MLP, with a
shared value pool or per-layer tables) sharded number-wise (pooling at the source or owner) or dimension-wise gives
one process's logits, loss and every gradient; `lookup_dot` of each store against the whole table; a pool's cyclic
rows in the lookup-reduce, and written (safetensors, DCP) in the table's own order; `ultramem-train
--memory_parallel number` on a V2 config trains as one process and saves the pools in table order."""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp
from launch_support import (
    LAUNCHERS,
    one_process_run,
    run_command,
    steps_before_divergence,
    training_logs,
    write_config,
)
from memory_parallel_v2_worker import MODEL_STORES, MODELS, STORES, run, v2_config
from selection_support import compare_selections

from ultramem import UltraMemForCausalLM
from ultramem.parallel import plan_memory_parallel

pytestmark = pytest.mark.numerics  # run again under a second CPU dispatch level (.ci/run)

WORLD, TOLERANCE = 2, 1e-5
MODEL_TOLERANCE = 2e-5  # fp32, relative to the largest magnitude above 1: the reduction order differs


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mp-v2")
    mp.spawn(run, args=(WORLD, str(folder / "init"), str(folder)), nprocs=WORLD)
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


@pytest.mark.parametrize("store", STORES)
def test_sharded_lookup_dot_equals_the_whole_table(ranks, store):
    for rank in ranks:
        found = rank["lookup_dot"][store]
        assert max(found["dots"], found["query_grad"], found["table_grad"]) < TOLERANCE, found
        assert found["sent"]["indices"] > 0 and found["sent"]["queries"] > 0 and found["sent"]["dots"] > 0


def test_a_pools_rows_are_owned_cyclically_so_a_window_is_spread_evenly(ranks):
    for rank in ranks:
        assert rank["lookup_dot"]["number_cyclic"]["cyclic"] and not rank["lookup_dot"]["number"]["cyclic"]
        assert rank["lookup_dot"]["number_cyclic"]["window_share"] == 0.5
    assert sorted(rank["lookup_dot"]["number"]["window_share"] for rank in ranks) == pytest.approx([1 / 3, 2 / 3])


def test_cyclic_rows_pool_and_are_written_in_the_tables_own_order(ranks):
    for rank in ranks:
        assert max(rank["cyclic"].values()) < TOLERANCE, rank["cyclic"]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("store", MODEL_STORES)
def test_sharded_v2_model_matches_one_process(ranks, model, store):
    for rank in ranks:
        found = rank["model"][f"{model}/{store}"]
        assert max(found["errors"].values()) < MODEL_TOLERANCE, found["errors"]
        assert found["sharded_tables"] == found["table_names"]  # values and pre-values, or the two pools
        pools = ["model.pre_value_pool.weight", "model.value_pool.weight"]
        assert (found["table_names"] == pools) == (model == "pool"), found["table_names"]


# `ultramem-train --memory_parallel` with a V2 config: the trainer's plan, value-LR group, and the final checkpoint
# written from the shards (a pool's cyclic rows in table order) against one process from the same checkpoint;
# query_norm="none" as in test_memory_parallel_training.py
V2_TRAINING = dict(memory_layers=[[0, 0], [1, 1]], memory_site="mlp", value_gate="peer", pre_value_dim=4,
                   ive_single_projector=True, value_pool_size=96, query_norm="none")  # fmt: skip
STEPS, GLOBAL_BATCH = 6, 4
PROBE = torch.arange(64).reshape(2, 32) * 97 % 50000


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mp-v2-training")
    return folder, one_process_run(folder, write_config(folder, **V2_TRAINING), STEPS, GLOBAL_BATCH)


def test_sharded_v2_training_matches_one_process(training):
    """Number-wise, so the pools' rows are owned cyclically (dimension-wise: the model checks above)."""
    folder, argv = training
    command, flags = LAUNCHERS["torchrun"]
    result = run_command([*command, "ultramem.training", *argv("number", GLOBAL_BATCH // 2, memory_parallel="number"),
                          *flags])  # fmt: skip
    assert "memory_parallel=number shards 2 of " in result.stdout, result.stdout[-3000:]  # the two pools
    agreed = steps_before_divergence(training_logs(folder / "number"), training_logs(folder / "single"), 1e-5)
    sharded, single = (UltraMemForCausalLM.from_pretrained(folder / run).eval() for run in ("number", "single"))
    comparison = compare_selections(single, sharded, PROBE)
    if agreed < STEPS:  # two trajectories from the step a near-tie parted them: the checkpoint loaded, nothing more
        return
    for name in ("model.value_pool.weight", "model.pre_value_pool.weight"):  # written from cyclic shards
        torch.testing.assert_close(sharded.get_parameter(name), single.get_parameter(name), rtol=0, atol=5e-5)
    # AdamW's normalised steps lift fp32 reduction-order noise in the LM head's rows of tokens never seen to ~2e-4
    assert comparison.logits_error <= 2e-3 and comparison.compared_tokens >= PROBE.numel() // 2, comparison


def test_the_plan_checks_the_pre_value_width_and_the_pools_rows():
    with pytest.raises(ValueError, match=r"splits pre_value_dim=6 over 4 ranks: the size must divide 6; choose"):
        plan_memory_parallel(v2_config(pre_value_dim=6, memory_value_dim=16), "dimension", 4, 64)
    assert plan_memory_parallel(v2_config(pre_value_dim=6), "dimension", 2, 64)[0] == "dimension"
    with pytest.raises(ValueError, match="splits the 72 value rows over 5 ranks"):  # the pool's, not a window's 36
        plan_memory_parallel(v2_config(), "number", 5, 64)
    assert plan_memory_parallel(v2_config(), "number", 8, 64)[0] == "number"  # 72 rows, 8 ranks
