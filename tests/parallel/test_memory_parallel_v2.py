"""UltraMemV2's tables on 2 gloo processes: a V2 model (PEER pre-values, a memory layer beside every MLP, with a
shared value pool or per-layer tables) sharded number-wise (pooling at the source or owner) or dimension-wise gives
one process's logits, loss and every gradient; `lookup_dot` of each store against the whole table; a pool's cyclic
rows in the lookup-reduce, and written (safetensors, DCP) in the table's own order."""

from __future__ import annotations

import json

import pytest
import torch.multiprocessing as mp
from memory_parallel_v2_worker import MODEL_STORES, MODELS, STORES, run

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
