"""Worker of the memory-parallel tests: one gloo process of P, comparing sharded stores with one process.

Run by `torch.multiprocessing.spawn` from `test_memory_parallel.py`; each rank writes its findings to JSON.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import torch.distributed as dist
from model_support import small_config
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from ultramem import UltraMemForCausalLM
from ultramem.memory_implementations import TORCH_MEMORY_OPS
from ultramem.parallel import count_bytes
from ultramem.parallel.setup import memory_parallel_mesh
from ultramem.parallel.volume import LookupShape, dimension_volume, number_volume

STORES = {"number": {"pool_at": "source"}, "number_owner": {"pool_at": "owner"}, "dimension": {"num_cores": 2}}


class LargestTensor(TorchDispatchMode):
    """Largest tensor (elements) any operator produces while active; a DTensor counts by its local shard, and a
    view (of a memory-mapped file, say) or a meta tensor, allocating nothing, not at all."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, DTensor):
                tensor = tensor.to_local()
            if isinstance(tensor, torch.Tensor) and not tensor.is_meta:
                self.largest = max(self.largest, tensor.numel())
        return out


def _store_name(key: str) -> str:
    return key.removesuffix("_owner")


def _max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference, relative to the largest expected magnitude when that exceeds 1."""
    return float((a - b).detach().abs().max() / b.detach().abs().max().clamp(min=1)) if a.numel() else 0.0


def model_checks(mesh, world: int, rank: int) -> dict:
    """Logits, loss and every gradient of the sharded model on this rank's batch slice vs one process."""
    torch.manual_seed(0)
    # query_norm="none": the reference holds every rank's tokens on every rank, so the query's batch statistics, summed
    # over ranks, would count each token once per rank (their distributed sum: tests/model/test_query_normalization.py)
    config = small_config(memory_implementation="torch", query_norm="none")
    reference = UltraMemForCausalLM(config)
    input_ids = torch.randint(1, config.vocab_size, (2 * world, 9))
    out = reference(input_ids, labels=input_ids)
    out.loss.backward()
    mine = slice(2 * rank, 2 * rank + 2)
    results = {}
    for key, options in STORES.items():
        model = copy.deepcopy(reference)
        model.zero_grad()
        model.set_value_store(_store_name(key), mesh=mesh, **options)
        sharded = model(input_ids[mine], labels=input_ids[mine])
        sharded.loss.backward()
        loss = sharded.loss.detach().clone()
        dist.all_reduce(loss)
        errors = {
            "logits": _max_error(sharded.logits, out.logits[mine]),
            "loss": abs(float(loss) / world - float(out.loss)),
        }
        expected = dict(reference.named_parameters())
        for name, param in model.named_parameters():
            grad = param.grad
            if hasattr(grad, "to_local"):  # a value-table shard: compare with the same slice of the full gradient
                dim = model.get_submodule(name.removesuffix(".weight")).shard_dim
                full = expected[name].grad.chunk(mesh.size(1), dim=dim)[mesh.get_local_rank("shard")]
                errors[name] = _max_error(grad.to_local(), full)
                errors["resident_fraction"] = param.to_local().numel() / param.numel()
            else:
                dist.all_reduce(grad)
                errors[name] = _max_error(grad / world, expected[name].grad)
        results[key] = errors
    return results


def store_checks(mesh, rank: int) -> dict:
    """One store on crafted lookups: rank 1 receives no rows; forward, gradients, bytes, largest tensor."""
    torch.manual_seed(1)
    size = mesh.size(1)
    num_rows, value_dim, tokens, slots, cores, groups_n = 64 * size, 8 * size, 5, 4 * size, 2, 2
    table = torch.nn.Embedding(num_rows, value_dim)
    table.weight.data.normal_()
    per_shard = num_rows // size
    # every token's slots spread evenly over the owners (except in the "skip" case, where rank 1 owns none)
    even = (torch.arange(slots) % size * per_shard).expand(tokens, slots) + torch.randint(0, per_shard, (tokens, slots))
    skip = torch.randint(0, per_shard, (tokens, slots))  # every row in shard 0
    groups = torch.randint(0, groups_n, (tokens, slots))
    scores = torch.randn(tokens, slots, cores)
    results = {}
    for case, rows in {"even": even, "skip": skip}.items():
        scores_ref = scores.clone().requires_grad_()
        expected = TORCH_MEMORY_OPS.lookup_reduce(table.weight, rows, groups, scores_ref, groups_n)
        expected.pow(2).sum().backward()
        full_grad = table.weight.grad.clone()
        table.weight.grad = None
        for key, options in STORES.items():
            store = type_of(key).from_table(table, "values.weight", mesh, **options)
            scores_mine = scores.clone().requires_grad_()
            with count_bytes() as sent, LargestTensor() as largest:
                pooled = store(rows, groups, scores_mine, groups_n, TORCH_MEMORY_OPS)
                forward = dict(sent)
                pooled.pow(2).sum().backward()
            shard = full_grad.chunk(size, dim=store.shard_dim)[mesh.get_local_rank("shard")]
            # every rank ran the same lookups, so the data-parallel mean of the shard gradient is the full one's
            results[f"{case}/{key}"] = {
                "forward": _max_error(pooled, expected),
                "table_grad": _max_error(store.weight.grad.to_local(), shard),
                "scores_grad": _max_error(scores_mine.grad, scores_ref.grad),
                "sent_forward": forward,
                "sent_total": dict(sent),
                "largest_tensor": largest.largest,
                "table_numel": num_rows * value_dim,
                "pairs_served": pairs_served(rows, groups, per_shard, mesh.get_local_rank("shard"), size),
            }
    shape = LookupShape(tokens=tokens, slots=slots, value_dim=value_dim, num_cores=cores, num_groups=groups_n)
    results["predicted"] = {"number": number_volume(shape, size), "dimension": dimension_volume(shape, size)}
    return results


def type_of(key: str):
    from ultramem.value_stores import VALUE_STORES

    return VALUE_STORES[_store_name(key)]


def pairs_served(rows: torch.Tensor, groups: torch.Tensor, per_shard: int, shard: int, size: int) -> int:
    """Pooled rows `shard` returns to the other ranks with owner pooling, all ranks asking for the same `rows`:
    its distinct (token, group) pairs, once per other rank of the shard group."""
    token = torch.arange(rows.shape[0]).unsqueeze(1).expand_as(rows)
    code = token * (int(groups.max()) + 1) + groups
    return int(code[rows // per_shard == shard].unique().numel()) * (size - 1)


def run(rank: int, world: int, init_file: str, out_dir: str, size: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    mesh = memory_parallel_mesh(size)
    results = {"model": model_checks(mesh, world, rank), "store": store_checks(mesh, rank)}
    try:
        memory_parallel_mesh(world + 1)
    except ValueError as error:
        results["size_error"] = str(error)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()
