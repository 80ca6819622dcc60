"""UltraMemV2's tables in the value stores: PEER pre-values beside the values of every memory layer, or one value
pool (and pre-value pool) of the model shared by all layers. Offloaded generation equals in-memory, a save/load
round trip keeps the logits, and every table (by `get_value_table_names`) is served by the chosen store."""

from pathlib import Path

import pytest
import torch
from model_support import small_config

from ultramem import UltraMemForCausalLM
from ultramem.offload import DiskValueStore, HostValueStore
from ultramem.quantized.format import QuantizationError
from ultramem.value_stores import DeferredValueTable, MemoryValueTable, deferred_value_tables, value_tables

PROMPT = {
    "input_ids": torch.tensor([[0, 0, 5, 9, 3, 44], [8, 1, 7, 2, 6, 90]]),
    "attention_mask": torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]),  # left padded
}
# UltraMemV2 on the small test model: memory beside every block's MLP, PEER pre-values, one projector; "pool" shares
# one pool of 72 rows (each layer's window: 36)
SWITCHES = dict(memory_layers=[[block, block] for block in range(4)], memory_site="mlp", value_gate="peer",
                pre_value_dim=4, ive_single_projector=True)  # fmt: skip
VARIANTS = {"layers": SWITCHES, "pool": {**SWITCHES, "value_pool_size": 72}}
TABLES = {
    "layers": [f"model.memory_layers.{j}.{table}.weight" for j in range(4) for table in ("values", "pre_values")],
    "pool": ["model.value_pool.weight", "model.pre_value_pool.weight"],
}


@pytest.fixture(scope="module", params=VARIANTS)
def saved(request, tmp_path_factory) -> tuple[str, Path, UltraMemForCausalLM]:
    folder = tmp_path_factory.mktemp(f"v2-{request.param}")
    torch.manual_seed(3)
    model = UltraMemForCausalLM(small_config(**VARIANTS[request.param])).eval()
    model.save_pretrained(folder)
    return request.param, folder, model


def greedy(model) -> torch.Tensor:
    return model.generate(**PROMPT, max_new_tokens=8, do_sample=False)


def assert_round_trip(loaded: UltraMemForCausalLM, reference: UltraMemForCausalLM) -> None:
    """Every tensor bit for bit, and the logits to float32 rounding: the loaded weights are views of the safetensors
    file (8-byte aligned), and a CPU's GEMM may round unaligned operands differently (2e-7 on an AMD EPYC)."""
    expected = reference.state_dict()
    state = loaded.state_dict()
    assert sorted(state) == sorted(expected) and all(torch.equal(state[name], expected[name]) for name in state)
    torch.testing.assert_close(loaded(**PROMPT).logits, reference(**PROMPT).logits, rtol=1e-6, atol=1e-6)


def test_every_table_is_listed_and_round_trips(saved):
    variant, folder, reference = saved
    assert sorted(reference.get_value_table_names()) == sorted(TABLES[variant])
    assert all(isinstance(table, MemoryValueTable) for table in value_tables(reference).values())
    assert_round_trip(UltraMemForCausalLM.from_pretrained(folder).eval(), reference)


@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_offloaded_generation_equals_in_memory(saved, offload):
    variant, folder, reference = saved
    model = UltraMemForCausalLM.from_pretrained(folder, memory_offload=offload).eval()
    stores = value_tables(model)
    assert sorted(stores) == sorted(TABLES[variant])
    assert all(type(store) is {"cpu": HostValueStore, "disk": DiskValueStore}[offload] for store in stores.values())
    torch.testing.assert_close(model(**PROMPT).logits, reference(**PROMPT).logits, rtol=1e-6, atol=1e-6)
    assert torch.equal(greedy(model), greedy(reference))
    assert all(store.rows_read > 0 for store in stores.values())  # pre-value tables are read through their store


def test_set_value_store_offloads_an_in_memory_model_and_saves_an_ordinary_checkpoint(saved, tmp_path):
    variant, _, reference = saved
    model = UltraMemForCausalLM(reference.config).eval()
    model.load_state_dict(reference.state_dict())
    model.set_value_store("cpu")
    assert all(isinstance(store, HostValueStore) for store in value_tables(model).values())
    torch.testing.assert_close(model(**PROMPT).logits, reference(**PROMPT).logits, rtol=1e-6, atol=1e-6)
    model.save_pretrained(tmp_path)
    assert_round_trip(UltraMemForCausalLM.from_pretrained(tmp_path).eval(), reference)


def test_deferred_tables_are_every_table(saved):
    variant, _, reference = saved
    with deferred_value_tables():
        model = UltraMemForCausalLM(reference.config)
    assert sorted(model.get_value_table_names()) == sorted(TABLES[variant])
    assert all(isinstance(table, DeferredValueTable) for table in value_tables(model).values())


def test_quantized_loading_refuses_pre_values_in_one_line(saved):
    _, folder, _ = saved
    with pytest.raises(QuantizationError, match="not the pre-value tables of value_gate='peer': use memory_quant"):
        UltraMemForCausalLM.from_pretrained(folder, memory_quantization="int8")
