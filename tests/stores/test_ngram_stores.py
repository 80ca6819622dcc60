"""The n-gram memories' tables (Engram, issue 45) are value tables like the product-key ones: listed by
`get_value_table_names`, trained in the value-LR group, left out of an offloaded load and served by the "cpu" and
"disk" stores, which gather the rows of every n-gram memory for the whole step from before the first block, in the
background. Offloaded models give the in-memory model's logits and tokens, bit for bit."""

import pytest
import torch
from model_support import NGRAM, greedy_static_cache, perturbed_ngram_tables, small_config

from ultramem import UltraMemForCausalLM
from ultramem.diagnostics import retrieval_diagnostics
from ultramem.offload import DiskValueStore, HostValueStore
from ultramem.value_stores import MemoryValueTable, is_ngram_table, value_tables

OFFLOADS = ("cpu", "disk")
EOS = 5
PROMPT = {  # left padded, an EOS inside the second prompt
    "input_ids": torch.tensor([[0, 0, 15, 9, 3, 44, 12], [8, 1, 7, EOS, 6, 90, 13]]),
    "attention_mask": torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]]),
}
NGRAM_TABLES = ["model.ngram_memories.0.values.weight", "model.ngram_memories.1.values.weight"]


def ngram_model(seed: int = 3, **overrides) -> UltraMemForCausalLM:
    torch.manual_seed(seed)
    config = small_config(**{**NGRAM, "eos_token_id": EOS, **overrides})
    return perturbed_ngram_tables(UltraMemForCausalLM(config).eval())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ngram_offload")
    model = ngram_model()
    model.save_pretrained(folder)
    return folder, model


def greedy(model, **kwargs) -> torch.Tensor:
    return model.generate(**PROMPT, max_new_tokens=8, do_sample=False, **kwargs)


def test_ngram_tables_are_value_tables_of_the_stores_and_the_value_lr_group(tmp_path):
    from ultramem.training.arguments import UltraMemTrainingArguments
    from ultramem.training.schedule import VALUE_GROUP
    from ultramem.training.trainer import UltraMemTrainer

    model = ngram_model()
    names = model.get_value_table_names()
    assert [name for name in names if is_ngram_table(name)] == NGRAM_TABLES
    assert all(not is_ngram_table(name) for name in names if name.startswith("model.memory_layers."))
    assert all(isinstance(table, MemoryValueTable) for table in value_tables(model).values())
    args = UltraMemTrainingArguments(tmp_path, report_to="none", use_cpu=True, warmup_steps=0)
    trainer = UltraMemTrainer(model=model, args=args)
    trainer.create_optimizer_and_scheduler(num_training_steps=3)
    groups = {group["ultramem_group"]: {id(p) for p in group["params"]} for group in trainer.optimizer.param_groups}
    parameters = dict(model.named_parameters())
    assert groups[VALUE_GROUP] == {id(parameters[name]) for name in names}  # n-gram tables included
    assert {id(parameters[name]) for name in NGRAM_TABLES} <= groups[VALUE_GROUP]


@pytest.mark.numerics
@pytest.mark.parametrize("offload", OFFLOADS)
def test_offloaded_ngram_tables_give_the_in_memory_models_logits_and_tokens(saved, offload):
    folder, reference = saved
    model = UltraMemForCausalLM.from_pretrained(folder, memory_offload=offload).eval()
    store = HostValueStore if offload == "cpu" else DiskValueStore
    assert all(type(ngram.values) is store for ngram in model.model.ngram_memories)
    assert all(type(layer.values) is store for layer in model.model.memory_layers)
    with torch.no_grad():
        torch.testing.assert_close(model(**PROMPT).logits, reference(**PROMPT).logits, rtol=0, atol=0)
    assert torch.equal(greedy(model), greedy(reference))  # dynamic cache: the n-gram states in it
    assert torch.equal(greedy_static_cache(model, PROMPT, 8), greedy_static_cache(reference, PROMPT, 8))
    for ngram in model.model.ngram_memories:  # the blocking path gives the same tokens
        ngram.values.asynchronous = False
    assert torch.equal(greedy(model), greedy(reference))


def test_a_model_that_ignores_the_ngram_tables_is_caught(saved):
    """The comparison above can fail: a model whose n-gram tables are zero gives other logits."""
    folder, reference = saved
    model = UltraMemForCausalLM.from_pretrained(folder, memory_offload="cpu").eval()
    for ngram in model.model.ngram_memories:
        ngram.values.table.zero_()
    with torch.no_grad():
        assert not torch.allclose(model(**PROMPT).logits, reference(**PROMPT).logits, atol=1e-3)


def test_every_ngram_read_starts_before_the_first_block_and_the_layer_uses_it(saved):
    """The n-gram memory at block 3 starts its read in the background before block 0 runs; each n-gram store is read
    once per step (no blocking read in the layer), each distinct row once."""
    folder, _ = saved
    model = UltraMemForCausalLM.from_pretrained(folder, memory_offload="disk").eval()
    events, rows = [], {}
    model.model.layers[0].register_forward_pre_hook(lambda module, args: events.append("block 0"))
    for idx, ngram in enumerate(model.model.ngram_memories):
        store = ngram.values
        read, blocking = store.read_async, store.forward

        def started(slots, background=True, idx=idx, read=read):
            events.append(f"ngram {idx} started" if background else f"ngram {idx} read")
            rows[idx] = slots
            return read(slots, background)

        store.read_async = started
        store.forward = lambda *args, idx=idx, blocking=blocking: events.append(f"ngram {idx} read") or blocking(*args)
    with torch.no_grad():
        model(**PROMPT)
    assert events == ["ngram 0 started", "ngram 1 started", "block 0"]
    for idx, ngram in enumerate(model.model.ngram_memories):
        assert ngram.values.rows_read == rows[idx].unique().numel() < ngram.values.num_embeddings
        assert rows[idx].shape == (*PROMPT["input_ids"].shape, ngram.num_heads)  # every head's row of every token


@pytest.mark.numerics
def test_diagnostics_read_an_offloaded_ngram_table(tmp_path):
    """(An n-gram model without memory layers: the diagnostics do not read offloaded product-key layers, whose
    background lookup bypasses the layer's call that they record.)"""
    reference = ngram_model(memory_layers=[])
    reference.save_pretrained(tmp_path)
    model = UltraMemForCausalLM.from_pretrained(tmp_path, memory_offload="disk").eval()
    expected = retrieval_diagnostics(reference, PROMPT["input_ids"], PROMPT["attention_mask"])
    found = retrieval_diagnostics(model, PROMPT["input_ids"], PROMPT["attention_mask"])
    assert "ngram_1/gate_mean" in expected and found == pytest.approx(expected, rel=1e-6, abs=1e-7)


@pytest.mark.numerics
@pytest.mark.parametrize("offload", OFFLOADS)
def test_save_pretrained_of_an_offloaded_ngram_model_writes_its_tables(saved, offload, tmp_path):
    folder, reference = saved
    UltraMemForCausalLM.from_pretrained(folder, memory_offload=offload).save_pretrained(tmp_path)
    model = UltraMemForCausalLM.from_pretrained(tmp_path).eval()
    assert all(isinstance(ngram.values, MemoryValueTable) for ngram in model.model.ngram_memories)
    for name in NGRAM_TABLES:
        assert torch.equal(model.get_parameter(name), reference.get_parameter(name))


def test_set_value_store_offloads_an_in_memory_models_ngram_tables(saved, tmp_path):
    folder, reference = saved
    model = UltraMemForCausalLM.from_pretrained(folder).eval()
    model.set_value_store("disk", directory=tmp_path / "tables")
    files = sorted(path.name for path in (tmp_path / "tables").iterdir())
    assert files == sorted(f"{name}.safetensors" for name in model.get_value_table_names())
    assert all(type(ngram.values) is DiskValueStore for ngram in model.model.ngram_memories)
    assert torch.equal(greedy(model), greedy(reference))


def test_training_through_an_offloaded_ngram_table_leaves_it(saved):
    """The rest trains (the gate, projections and conv of the n-gram memory get gradients); the table stays."""
    folder, _ = saved
    model = UltraMemForCausalLM.from_pretrained(folder, memory_offload="cpu").train()
    ngram = model.model.ngram_memories[0]
    table = ngram.values.table.clone()
    model(**PROMPT, labels=PROMPT["input_ids"]).loss.backward()
    assert ngram.value_proj.weight.grad.abs().sum() > 0 and ngram.key_proj.weight.grad.abs().sum() > 0
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert torch.equal(ngram.values.table, table)


def test_an_ngram_model_built_for_offload_has_no_table_and_says_so():
    model = UltraMemForCausalLM(small_config(**{**NGRAM, "memory_layers": [], "memory_offload": "disk"}))
    assert not any(isinstance(module, MemoryValueTable) for module in model.modules())
    with pytest.raises(RuntimeError, match="attaches the value tables in from_pretrained"):
        model(PROMPT["input_ids"])
