"""The value-store seam: the memory layer reads values only by calling its store (the lookup-reduce)."""

import pytest
import torch
from torch import nn

from ultramem import UltraMemForCausalLM
from ultramem.value_stores import VALUE_STORES, MemoryValueTable


class RecordingStore(nn.Module):
    """A store that keeps the table's weight and records every request (rows per call, the key it serves)."""

    def __init__(self, weight: nn.Parameter, name: str):
        super().__init__()
        self.weight = weight
        self.name = name
        self.requests: list[torch.Tensor] = []

    @classmethod
    def from_table(cls, table: MemoryValueTable, name: str) -> "RecordingStore":
        return cls(table.weight, name)

    def forward(self, rows, groups, scores, num_groups, ops):
        self.requests.append(rows)
        return ops.lookup_reduce(self.weight, rows, groups, scores, num_groups)


@pytest.fixture
def recording_store():
    VALUE_STORES["recording"] = RecordingStore
    yield RecordingStore
    del VALUE_STORES["recording"]


def test_a_registered_store_serves_every_lookup_and_changes_nothing(config, recording_store):
    torch.manual_seed(0)
    model = UltraMemForCausalLM(config).eval()
    input_ids = torch.randint(1, config.vocab_size, (2, 9))
    expected = model(input_ids).logits
    names = set(model.get_value_table_names())
    model.set_value_store("recording")
    stores = [layer.values for layer in model.model.memory_layers]
    assert all(isinstance(store, RecordingStore) for store in stores)
    assert {store.name for store in stores} == names  # the state-dict key of each table
    assert set(model.state_dict()) >= names  # parameter names unchanged
    torch.testing.assert_close(model(input_ids).logits, expected, rtol=0, atol=0)
    for store in stores:
        assert len(store.requests) == 1
        assert store.requests[0].shape == (2 * 9, config.memory_heads * config.memory_topk)


def test_set_value_store_rejects_unknown_names_and_double_wrapping(config, recording_store):
    model = UltraMemForCausalLM(config)
    with pytest.raises(ValueError, match="value store 'nowhere' is not registered; choose one of"):
        model.set_value_store("nowhere")
    model.set_value_store("recording")
    with pytest.raises(ValueError, match="already a RecordingStore store"):
        model.set_value_store("recording")


def test_local_store_is_the_table_itself(config):
    model = UltraMemForCausalLM(config)
    tables = [layer.values for layer in model.model.memory_layers]
    model.set_value_store("local")
    assert [layer.values for layer in model.model.memory_layers] == tables
