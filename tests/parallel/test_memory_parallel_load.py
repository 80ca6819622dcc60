"""Sharded runs set up from a checkpoint or fresh (2 gloo processes): each rank reads or draws only its shard."""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp
from memory_parallel_load_worker import MODES, run, table_config

from ultramem import UltraMemForCausalLM

WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mp-load")
    torch.manual_seed(0)
    UltraMemForCausalLM(table_config()).save_pretrained(folder / "checkpoint")
    mp.spawn(run, args=(WORLD, str(folder / "init"), str(folder), str(folder / "checkpoint")), nprocs=WORLD)
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


@pytest.mark.parametrize("mode", MODES)
def test_sharded_load_matches_the_one_process_model(ranks, mode):
    for rank in ranks:
        found = rank[f"load/{mode}"]
        assert found["logits"] < 1e-5 and found["loss"] < 1e-6, found
        assert found["local_numel"] == found["table_numel"] // WORLD
        assert found["tables_loaded"] == [], "the loader read whole tables"


@pytest.mark.parametrize("case", [f"{kind}/{mode}" for kind in ("load", "fresh") for mode in MODES])
def test_no_table_sized_tensor_during_setup(ranks, case):
    for rank in ranks:
        assert rank[case]["largest"] < rank[case]["table_numel"], rank[case]


@pytest.mark.parametrize("mode", MODES)
def test_a_fresh_shard_has_the_init_std(ranks, mode):
    for rank in ranks:
        found = rank[f"fresh/{mode}"]
        assert found["std"] == pytest.approx(found["init_std"], rel=0.05)
        assert abs(found["mean"]) < 0.1 * found["init_std"]
        assert found["shards_differ"]
