"""Quantized value tables under memory parallelism (2 gloo processes) against the one-process quantized model on the
same quantized tables: logits, greedy generation and the gradients of every other weight, int8 and int4, number-wise
(pooling at the source and at the owner) and dimension-wise; each rank reads only its rows; frozen-table fine-tuning
with `ultramem-train --memory_parallel` (torchrun, DDP) against one process; the refusals' lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from launch_support import LAUNCHERS, base_args, losses, python_module, run_command, write_config, write_corpus
from memory_parallel_load_worker import keys_loaded
from memory_parallel_worker import LargestTensor
from model_support import small_config
from transformers import AutoConfig

from ultramem import UltraMemForCausalLM
from ultramem.memory_implementations import TORCH_MEMORY_OPS
from ultramem.parallel import apply_memory_parallel, count_bytes, plan_memory_parallel
from ultramem.parallel.checkpoint import save_value_tables, sharded_tables
from ultramem.parallel.setup import memory_parallel_mesh
from ultramem.parallel.volume import LookupShape, dimension_volume, number_volume
from ultramem.quantize import convert
from ultramem.quantized import QuantizedCheckpoint
from ultramem.value_stores import deferred_value_tables

WORLD = 2
FORMATS = {"int8": None, "int4": 4}  # Dv = 16, mcs_cores = 2: int8 one group per 8-column chunk, int4 4 groups a row
STORES = {  # case -> (registered store without the format, its options)
    "number": ("number", {"pool_at": "source"}),
    "number_owner": ("number", {"pool_at": "owner"}),
    "dimension": ("dimension", {"num_cores": 2}),
}
PROMPT = torch.tensor([[5, 9, 3, 44, 17, 2], [8, 1, 7, 2, 6, 90]])
TOLERANCE = 1e-6  # fp32, relative to the largest magnitude above 1: the owner sums the slots in another order


def table_config():
    """Tables (1024 rows) larger than any other tensor of the model, so a whole one would show."""
    return small_config(memory_implementation="torch", memory_value_dim=16, memory_num_keys=64)


def _run_model(model: UltraMemForCausalLM) -> dict[str, torch.Tensor]:
    """Each memory layer's pooled rows (what its value store returns), logits, greedy tokens and the gradient of
    every trainable weight (queries, keys, cores, ...) of a loss."""
    model.zero_grad(set_to_none=True)
    found = {}

    def keep(name: str):
        return lambda module, args, output: found.setdefault(f"pooled/{name}", output.detach().float())

    hooks = [layer.values.register_forward_hook(keep(name)) for name, layer in model.named_memory_layers()]
    output = model(PROMPT, labels=PROMPT)
    for hook in hooks:
        hook.remove()
    output.loss.backward()
    found["logits"] = output.logits.detach()
    found.update({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
    with torch.no_grad():
        found["generated"] = model.generate(PROMPT[:, :3], max_new_tokens=6, do_sample=False).float()
    return found


def _errors(found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> dict[str, float]:
    assert found.keys() == expected.keys(), found.keys() ^ expected.keys()
    scale = {name: float(tensor.abs().max().clamp(min=1)) for name, tensor in expected.items()}
    return {name: float((found[name] - tensor).abs().max()) / scale[name] for name, tensor in expected.items()}


def _sharded(checkpoint: Path, store: str, options: dict, mesh, **quantization) -> tuple:
    """The model loaded deferred and its tables sharded from `checkpoint`; the largest tensor allocated meanwhile,
    the table keys the Transformers loader read."""
    with LargestTensor() as largest, keys_loaded() as read, deferred_value_tables():
        model = UltraMemForCausalLM.from_pretrained(checkpoint, **quantization)
        model.set_value_store(
            f"{store}-{model.config.memory_quantization}",
            mesh=mesh,
            checkpoint=QuantizedCheckpoint.find(checkpoint),
            **options,
        )
    return model, largest.largest, [key for key in read if key.endswith("values.weight")]


def _sent_by_a_lookup(table, config) -> dict[str, dict[str, float]]:
    """Bytes this rank sends in one lookup whose slots spread evenly over the owners, and what `auto`'s formulas
    predict for it from the store's `sent_sizes` (a quantized row as stored, pooled rows in float32)."""
    tokens, slots, num_groups, cores = 8, 6, 4, 2
    per_shard = table.weight.shape[0] // WORLD
    rows = (torch.arange(slots) % WORLD * per_shard).expand(tokens, slots) + torch.randint(
        0, per_shard, (tokens, slots)
    )
    groups, scores = torch.randint(0, num_groups, (tokens, slots)), torch.randn(tokens, slots, cores)
    with count_bytes() as sent, torch.no_grad():
        table(rows, groups, scores, num_groups, TORCH_MEMORY_OPS)
    shape = LookupShape(tokens, slots, config.memory_value_dim, cores, num_groups, **type(table).sent_sizes(config))
    formula = dimension_volume if table.shard_dim else number_volume
    return {"measured": dict(sent), "predicted": formula(shape, WORLD)}


def _worker(rank: int, init_file: str, out_dir: str, saved: str, converted: dict[str, str]) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    mesh = memory_parallel_mesh(WORLD)
    results: dict = {}
    for format, path in converted.items():
        expected = _run_model(UltraMemForCausalLM.from_pretrained(path))  # one process, the same quantized tables
        for case, (store, options) in STORES.items():
            model, largest, read = _sharded(Path(path), store, options, mesh)
            table = model.model.memory_layers[0].values
            results[f"{format}/{case}"] = {
                "errors": _errors(_run_model(model), expected),
                "largest": largest,
                "read": read,
                "table_numel": table.weight.numel(),
                "local_fraction": table.weight.to_local().numel() / table.weight.numel(),
                "store": type(table).__name__,
                "table_parameters": [name for name, _ in model.named_parameters() if "values" in name],
                "sent": _sent_by_a_lookup(table, model.config) if case != "number_owner" else None,
            }
        # a float checkpoint quantized while loading: each rank quantizes its own rows, to the same bytes
        quantization = {"memory_quantization": format, "memory_quantization_group_size": FORMATS[format]}
        model, _, _ = _sharded(Path(saved), "number", {}, mesh, **quantization)
        results[f"{format}/float_checkpoint"] = {"errors": _errors(_run_model(model), expected)}
        # what `ultramem-train --memory_parallel number` does: build deferred, then apply_memory_parallel
        with deferred_value_tables():
            model = UltraMemForCausalLM.from_pretrained(path)
        store = apply_memory_parallel(model, "number", WORLD, tokens=PROMPT.numel(), checkpoint=path)
        results[f"{format}/apply"] = {"errors": _errors(_run_model(model), expected), "store": store}
        # the sharded tables written as one checkpoint, which one process loads as the same quantized model
        out = Path(out_dir, f"saved-{format}")
        tables = sharded_tables(model)
        if rank == 0:
            dense = {k: v for k, v in model.state_dict().items() if k not in tables}
            model.save_pretrained(out, state_dict=dense)
        dist.barrier()
        save_value_tables(model, str(out), rank == 0)
        results[f"{format}/saved"] = {"errors": _errors(_run_model(UltraMemForCausalLM.from_pretrained(out)), expected)}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    folder = tmp_path_factory.mktemp("mp-quantized")
    torch.manual_seed(3)
    model = UltraMemForCausalLM(table_config()).eval()
    with torch.no_grad():  # tables off their init scale, so that they matter to the logits
        for _, layer in model.named_memory_layers():
            layer.values.weight.normal_(0, 1.0)
    model.save_pretrained(folder / "float")
    converted = {format: convert(folder / "float", folder / format, format, group) for format, group in FORMATS.items()}
    return folder / "float", converted


@pytest.fixture(scope="module")
def ranks(checkpoints, tmp_path_factory) -> list[dict]:
    saved, converted = checkpoints
    folder = tmp_path_factory.mktemp("mp-quantized-run")
    paths = {format: str(path) for format, path in converted.items()}
    mp.spawn(_worker, args=(str(folder / "init"), str(folder), str(saved), paths), nprocs=WORLD)
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("case", STORES)
def test_sharded_quantized_model_matches_one_process(ranks, format, case):
    for rank in ranks:
        found = rank[f"{format}/{case}"]
        assert max(found["errors"].values()) < TOLERANCE, found["errors"]
        assert found["errors"]["generated"] == 0
        assert len(found["errors"]) > 3, "no gradient reached the queries, keys and cores"
        assert found["store"].startswith("Quantized") and found["store"].endswith(format.capitalize())
        assert found["table_parameters"] == [], "a quantized table is frozen: no parameter"


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("case", STORES)
def test_each_rank_reads_only_its_quantized_rows(ranks, format, case):
    for rank in ranks:
        found = rank[f"{format}/{case}"]
        assert found["read"] == [], "the Transformers loader read whole tables"
        assert found["largest"] < found["table_numel"], found
        assert found["local_fraction"] == pytest.approx(1 / WORLD)


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("case", ["number", "dimension"])
def test_bytes_sent_are_what_auto_plans_with(ranks, format, case):
    """`memory_parallel="auto"` weighs the partitionings by these formulas: number-wise, a quantized row goes back
    as stored (here int8 2 bytes a value with 8-column groups, int4 1.5 with 4-column ones, against float32's 4)."""
    for rank in ranks:
        sent = rank[f"{format}/{case}"]["sent"]
        assert {label: sent["measured"][label] for label in sent["predicted"]} == pytest.approx(sent["predicted"])
    if case == "number":
        row_bytes = ranks[0][f"{format}/number"]["sent"]["predicted"]["values"] / (6 * 8 / WORLD)
        assert row_bytes == {"int8": 32, "int4": 24}[format]  # Dv = 16: int8 2 groups of 8 + 8, int4 4 of 2 + 4


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("case", ["float_checkpoint", "apply", "saved"])
def test_quantized_at_load_applied_as_the_trainer_does_and_saved(ranks, format, case):
    for rank in ranks:
        found = rank[f"{format}/{case}"]
        assert max(found["errors"].values()) < TOLERANCE, found["errors"]
        assert found["errors"]["generated"] == 0
    if case == "apply":
        assert all(rank[f"{format}/apply"]["store"] == f"number-{format}" for rank in ranks)


def test_tables_loaded_whole_are_refused_before_any_work(checkpoints):
    _, converted = checkpoints
    for options in ({}, {"memory_offload": "cpu"}):
        model = UltraMemForCausalLM.from_pretrained(converted["int8"], **options)
        store = type(model.model.memory_layers[0].values).__name__
        with pytest.raises(ValueError) as error:
            apply_memory_parallel(model, "number", WORLD)  # no process group: refused before the mesh is built
        assert str(error.value) == (
            f"memory_parallel='number' shards tables each rank reads its part of, but "
            f"model.memory_layers.0.values.weight is already served by {store} (memory_offload / "
            "memory_quantization loaded it whole): allowed: memory_offload=None, and quantized tables loaded inside "
            "ultramem.value_stores.deferred_value_tables() with apply_memory_parallel(..., checkpoint=path)"
        )


def test_dimension_split_across_quantization_groups_is_refused():
    config = small_config(
        memory_value_dim=24, tucker_rank=1, mcs_cores=1, memory_quantization="int4", memory_quantization_group_size=8
    )
    with pytest.raises(ValueError) as error:
        plan_memory_parallel(config, "dimension", 2, tokens=1)
    assert str(error.value) == (
        "memory_parallel='dimension' splits each int4 row's 3 quantization groups (memory_value_dim=24 / "
        "memory_quantization_group_size=8) over 2 ranks: the size must divide 3; choose another "
        "memory_parallel_size, or memory_parallel='number'"
    )
    assert plan_memory_parallel(config, "auto", 2, tokens=1)[0] == "number"  # auto leaves it out


def test_frozen_table_fine_tuning_matches_one_process_and_saves_the_tables_unchanged(tmp_path):
    config, corpus = write_config(tmp_path), write_corpus(tmp_path)
    torch.manual_seed(7)
    UltraMemForCausalLM(AutoConfig.for_model(**json.loads(config.read_text()))).save_pretrained(tmp_path / "start")
    convert(tmp_path / "start", tmp_path / "int8", "int8")

    def argv(name: str, batch: int, **flags) -> list[str]:
        args = base_args(config, corpus, tmp_path / name, max_steps=3, per_device_train_batch_size=batch,
                         diagnostics_batch_size=0, model_name_or_path=tmp_path / "int8", **flags)  # fmt: skip
        at = args.index("--config_file")  # the checkpoint's config (memory_quantization="int8")
        return args[:at] + args[at + 2 :]

    run_command(python_module("ultramem.training", *argv("single", 4)))
    command, flags = LAUNCHERS["torchrun"]
    run_command([*command, "ultramem.training", *argv("sharded", 2, memory_parallel="number"), *flags])
    assert losses(tmp_path / "sharded") == pytest.approx(losses(tmp_path / "single"), abs=1e-5)
    start, trained = (UltraMemForCausalLM.from_pretrained(tmp_path / name) for name in ("int8", "sharded"))
    for (_, before), (_, after) in zip(start.named_memory_layers(), trained.named_memory_layers(), strict=True):
        assert type(after.values).__name__ == "QuantizedValueTableInt8"
        assert torch.equal(after.values.weight, before.values.weight)
