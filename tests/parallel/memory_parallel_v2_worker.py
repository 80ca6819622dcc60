"""Worker of the UltraMemV2 memory-parallel tests: one gloo process of 2, comparing sharded stores with one process.

Run by `torch.multiprocessing.spawn` from `test_memory_parallel_v2.py`; each rank writes its findings to JSON.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from model_support import small_config
from safetensors.torch import load_file
from torch import nn

from ultramem import UltraMemForCausalLM
from ultramem.memory_implementations import TORCH_MEMORY_OPS
from ultramem.parallel import count_bytes
from ultramem.parallel.checkpoint import TABLES_FILE, _write_tables, sharded_tables
from ultramem.parallel.number import blocks_to_cyclic, cyclic_to_blocks
from ultramem.parallel.resume import load_table_states, save_table_states
from ultramem.parallel.setup import memory_parallel_mesh
from ultramem.value_stores import VALUE_STORES

POOL, PRE_VALUES = "model.value_pool.weight", "model.memory_layers.0.pre_values.weight"
# store key -> (registered store, its options, the table it serves)
STORES = {
    "number": ("number", {}, PRE_VALUES),
    "number_cyclic": ("number", {}, POOL.replace("value_pool", "pre_value_pool")),
    "dimension": ("dimension", {"num_cores": 2}, PRE_VALUES),
}
NUM_ROWS, WIDTH, SLOTS = 24, 8, 6


def _max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference, relative to the largest expected magnitude when that exceeds 1."""
    return float((a - b).detach().abs().max() / b.detach().abs().max().clamp(min=1)) if a.numel() else 0.0


def _rank_lookups(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's rows and queries: rank 0 has 5 tokens, rank 1 three, all in rows of one window of the table."""
    generator = torch.Generator().manual_seed(10 + rank)
    tokens = 5 - 2 * rank
    rows = torch.randint(4, 4 + NUM_ROWS // 2, (tokens, SLOTS), generator=generator)  # a window: blocks split it 8:4
    return rows, torch.randn(tokens, WIDTH, generator=generator)


def lookup_dot_checks(mesh, rank: int, world: int) -> dict:
    """Each sharded store's lookup_dot vs the whole table's: dots, query and table gradients, bytes, ownership."""
    torch.manual_seed(1)
    table = nn.Embedding(NUM_ROWS, WIDTH)
    table.weight.data.normal_()
    full = table.weight.detach().requires_grad_()
    expected_grad = torch.zeros_like(full)
    mine = None
    for source in range(world):  # the table's gradient sums every rank's lookups; the stores make it their mean
        rows, query = _rank_lookups(source)
        query = query.requires_grad_()
        dots = TORCH_MEMORY_OPS.lookup_dot(full, rows, query)
        grad_table, grad_query = torch.autograd.grad(dots.pow(2).sum(), (full, query))
        expected_grad += grad_table / world
        if source == rank:
            mine = (rows, query.detach(), dots.detach(), grad_query)
    rows, query, expected, expected_query_grad = mine
    results = {}
    for key, (store_name, options, name) in STORES.items():
        store = VALUE_STORES[store_name].from_table(table, name, mesh, **options)
        query_mine = query.clone().requires_grad_()
        with count_bytes() as sent:
            dots = store.lookup_dot(rows, query_mine, TORCH_MEMORY_OPS)
            dots.pow(2).sum().backward()
        owned = store.shard_view(expected_grad, store.rank, store.size, store.cyclic)
        window = torch.arange(4, 4 + NUM_ROWS // 2)  # the rows asked for
        held = (
            store.shard_view(torch.arange(NUM_ROWS), store.rank, store.size, store.cyclic)
            if store.shard_dim == 0
            else window
        )
        results[key] = {
            "dots": _max_error(dots, expected),
            "query_grad": _max_error(query_mine.grad, expected_query_grad),
            "table_grad": _max_error(store.weight.grad.to_local(), owned),
            "cyclic": store.cyclic,
            "window_share": torch.isin(window, held).float().mean().item(),  # of the rows this rank serves
            "sent": dict(sent),
        }
    return results


def cyclic_layout_checks(mesh, rank: int, folder: str) -> dict:
    """A cyclic store's lookup-reduce; its shards exchanged into blocks and back; written to a safetensors file and
    through DCP in the table's own order, read back by a store with blocks."""
    torch.manual_seed(2)
    table = nn.Embedding(NUM_ROWS, WIDTH)
    table.weight.data.normal_()
    store = VALUE_STORES["number"].from_table(table, POOL, mesh, pool_at="owner")
    size, group = store.size, store.group
    rows, _ = _rank_lookups(rank)
    groups = torch.randint(0, 2, rows.shape)
    scores = torch.randn(*rows.shape, 2)
    pooled = store(rows, groups, scores, 2, TORCH_MEMORY_OPS)
    expected = TORCH_MEMORY_OPS.lookup_reduce(table.weight.detach(), rows, groups, scores, 2)
    local = store.weight.to_local().detach()
    blocks = cyclic_to_blocks(local, size, rank, group)
    results = {
        "lookup_reduce": _max_error(pooled, expected),
        "local_is_cyclic": _max_error(local, table.weight.detach()[rank::size]),
        "to_blocks": _max_error(blocks, table.weight.detach().chunk(size)[rank]),
        "round_trip": _max_error(blocks_to_cyclic(blocks, size, rank, group), local),
    }

    holder = nn.Module()
    holder.model = nn.Module()
    holder.model.value_pool = store
    path = os.path.join(folder, TABLES_FILE)
    _write_tables(sharded_tables(holder), path, is_writer=rank == 0)
    dist.barrier()
    results["written"] = _max_error(load_file(path)[POOL], table.weight.detach())

    holder.get_value_table_names = lambda: [POOL]
    optimizer = torch.optim.AdamW(holder.parameters())
    store.weight.grad = torch.distributed.tensor.DTensor.from_local(
        torch.ones_like(local), mesh, store.weight.placements, run_check=False
    )
    optimizer.step()
    stepped = store.weight.to_local().detach().clone()
    save_table_states(holder, optimizer, os.path.join(folder, "resume"))
    reader = nn.Module()
    reader.model = nn.Module()
    reader.model.value_pool = VALUE_STORES["number"].from_table(table, POOL, mesh, cyclic=False)  # blocks
    reader.get_value_table_names = lambda: [POOL]
    reader_optimizer = torch.optim.AdamW(reader.parameters())
    load_table_states(reader, reader_optimizer, os.path.join(folder, "resume"))
    expected_blocks = cyclic_to_blocks(stepped, size, rank, group)
    state = reader_optimizer.state[reader.model.value_pool.weight]["exp_avg"].to_local()
    results["resumed_in_blocks"] = _max_error(reader.model.value_pool.weight.to_local(), expected_blocks)
    results["resumed_state"] = _max_error(state, cyclic_to_blocks(optimizer.state[store.weight]["exp_avg"].to_local(),
                                                                  size, rank, group))  # fmt: skip
    return results


def v2_config(**overrides):
    """UltraMemV2 on the small test model: a memory layer beside every block's MLP, PEER pre-values, one projector,
    and (unless `value_pool_size=None`) a pool of 72 rows, each layer's window 36 of them."""
    switches = dict(memory_layers=[[block, block] for block in range(4)], memory_site="mlp", value_gate="peer",
                    pre_value_dim=4, ive_single_projector=True, value_pool_size=72)  # fmt: skip
    return small_config(memory_implementation="torch", **{**switches, **overrides})


MODELS = {"pool": {}, "layers": {"value_pool_size": None}}
MODEL_STORES = {"number": {"pool_at": "source"}, "number_owner": {"pool_at": "owner"}, "dimension": {"num_cores": 2}}


def model_checks(mesh, world: int, rank: int) -> dict:
    """Logits, loss and every gradient of the sharded V2 model on this rank's batch slice vs one process."""
    results = {}
    for model_key, overrides in MODELS.items():
        torch.manual_seed(0)
        config = v2_config(query_norm="none", **overrides)  # as in memory_parallel_worker.model_checks: the reference
        reference = UltraMemForCausalLM(config)  # holds every rank's tokens on every rank
        input_ids = torch.randint(1, config.vocab_size, (2 * world, 9))
        out = reference(input_ids, labels=input_ids)
        out.loss.backward()
        expected = dict(reference.named_parameters())
        mine = slice(2 * rank, 2 * rank + 2)
        for key, options in MODEL_STORES.items():
            model = copy.deepcopy(reference)
            model.zero_grad()
            model.set_value_store(key.removesuffix("_owner"), mesh=mesh, **options)
            sharded = model(input_ids[mine], labels=input_ids[mine])
            sharded.loss.backward()
            loss = sharded.loss.detach().clone()
            dist.all_reduce(loss)
            errors = {
                "logits": _max_error(sharded.logits, out.logits[mine]),
                "loss": abs(float(loss) / world - float(out.loss)),
            }
            tables = []
            for name, param in model.named_parameters():
                if hasattr(param.grad, "to_local"):  # a table's shard: the same part of the full gradient
                    store = model.get_submodule(name.removesuffix(".weight"))
                    full = store.shard_view(expected[name].grad, store.rank, store.size, store.cyclic)
                    errors[name] = _max_error(param.grad.to_local(), full)
                    tables.append(name)
                else:
                    dist.all_reduce(param.grad)
                    errors[name] = _max_error(param.grad / world, expected[name].grad)
            results[f"{model_key}/{key}"] = {"errors": errors, "sharded_tables": sorted(tables),
                                             "table_names": sorted(model.get_value_table_names())}  # fmt: skip
    return results


def run(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    mesh = memory_parallel_mesh(world)
    results = {"lookup_dot": lookup_dot_checks(mesh, rank, world), "cyclic": cyclic_layout_checks(mesh, rank, out_dir),
               "model": model_checks(mesh, world, rank)}  # fmt: skip
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()
