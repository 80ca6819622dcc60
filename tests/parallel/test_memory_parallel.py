"""Number-wise (pooling at the source and at the owner) and dimension-wise value stores on 2 and 4 gloo processes
against one process: logits, loss and every gradient; resident storage; bytes sent vs the paper's formulas."""

from __future__ import annotations

import json

import pytest
import torch.multiprocessing as mp
from memory_parallel_worker import STORES, run

TOLERANCE = 2e-5  # fp32, relative to the largest magnitude above 1: the reduction order differs with P


@pytest.fixture(scope="module", params=[(2, 2), (4, 4), (4, 2)], ids=["P2", "P4", "2x2-mesh"])
def ranks(request, tmp_path_factory):
    world, size = request.param
    folder = tmp_path_factory.mktemp(f"mp{world}x{size}")
    mp.spawn(run, args=(world, str(folder / "init"), str(folder), size), nprocs=world)
    return size, [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(world)]


def test_sharded_model_matches_one_process(ranks):
    _, results = ranks
    for rank in results:
        for key in STORES:
            errors = {name: error for name, error in rank["model"][key].items() if name != "resident_fraction"}
            assert max(errors.values()) < TOLERANCE, (key, errors)


def test_a_size_not_dividing_the_world_is_refused(ranks):
    _, results = ranks
    world = len(results)
    allowed = [size for size in range(1, world + 1) if world % size == 0]
    expected = f"memory_parallel_size={world + 1} does not divide the world size {world}; allowed: {allowed}"
    assert all(rank["size_error"] == expected for rank in results)


def test_each_rank_holds_one_shard(ranks):
    size, results = ranks
    for rank in results:
        for key in STORES:
            assert rank["model"][key]["resident_fraction"] == pytest.approx(1 / size)


@pytest.mark.parametrize("case", ["even", "skip"])
def test_store_matches_lookup_reduce_including_a_rank_without_rows(ranks, case):
    _, results = ranks
    for rank in results:
        for key in STORES:
            found = rank["store"][f"{case}/{key}"]
            assert max(found["forward"], found["table_grad"], found["scores_grad"]) < TOLERANCE, (key, found)


def test_no_table_sized_tensor_during_a_lookup(ranks):
    _, results = ranks
    for rank in results:
        for key in STORES:
            found = rank["store"][f"even/{key}"]
            assert found["largest_tensor"] < found["table_numel"]


def test_bytes_sent_match_the_paper_formulas(ranks):
    size, results = ranks
    for rank_index, rank in enumerate(results):
        predicted, store = rank["store"]["predicted"], rank["store"]
        number, owner, dimension = (store[f"even/{key}"]["sent_forward"] for key in STORES)
        assert number["indices"] == predicted["number"]["indices"]
        assert number["values"] == predicted["number"]["values"]
        assert dimension["indices"] == predicted["dimension"]["indices"]
        assert dimension["scores"] == predicted["dimension"]["scores"]
        assert dimension["pooled"] == predicted["dimension"]["pooled"]
        assert owner["indices"] == predicted["number"]["indices"]
        value_row = number["values"] / (predicted["number"]["indices"] / 8)  # bytes of one value row
        assert owner["pooled"] == store["even/number_owner"]["pairs_served"] * value_row
        assert owner["pooled"] <= number["values"]
        skip = store["skip/number"]["sent_forward"]
        # all rows on shard 0: it answers every other rank's slots and asks nobody; the other shards answer nobody
        assert skip["values"] == (size * number["values"] if rank_index % size == 0 else 0)
        # the backward sends the row gradients back to their owners only: as many bytes as the rows came with
        assert store["even/number"]["sent_total"]["values.grad"] == number["values"]
