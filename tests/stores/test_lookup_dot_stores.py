"""`lookup_dot` (PEER's gate) of the value stores that live on one process: the local table and the offloaded ones
equal a float64 loop over the whole table, with the gradients each store trains. The sharded stores are checked on
2 processes in tests/parallel/test_memory_parallel_v2.py; the quantized ones refuse pre-value tables."""

import pytest
import torch
from safetensors.torch import save_file

from ultramem.memory_implementations import MemoryImplementations
from ultramem.offload import DiskValueStore, HostValueStore, SafetensorsCheckpoint
from ultramem.quantized.format import QuantizationError
from ultramem.quantized.stores import QUANTIZED_STORES
from ultramem.value_stores import DeferredValueTable, MemoryValueTable

pytestmark = pytest.mark.numerics  # run again under a second CPU dispatch level (.ci/run)

NUM_ROWS, WIDTH, TOKENS, SLOTS = 40, 6, 33, 5  # 33 tokens: the embedding_bag path runs (from 32 tokens on)
NAME = "model.memory_layers.0.pre_values.weight"


def loop_reference(table: torch.Tensor, rows: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(rows.shape, dtype=torch.float64)
    for t in range(rows.shape[0]):
        for k in range(rows.shape[1]):
            out[t, k] = sum(table[rows[t, k], d].double() * query[t, d].double() for d in range(table.shape[1]))
    return out


@pytest.fixture(scope="module")
def lookup():
    torch.manual_seed(0)
    table = MemoryValueTable(NUM_ROWS, WIDTH, init_std=1.0)
    table.init_ultramem()
    rows = torch.randint(0, NUM_ROWS, (TOKENS, SLOTS))
    rows[0] = rows[1]  # repeated rows: each is read once by the offloaded stores
    query = torch.randn(TOKENS, WIDTH)
    return table, rows, query, loop_reference(table.weight.detach(), rows, query)


def _grads(out: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    return torch.autograd.grad((out * weights).sum(), tensors)


@pytest.mark.parametrize("implementation", ["torch", "embedding_bag"])
def test_local_table_equals_the_loop_and_trains_table_and_query(lookup, implementation):
    table, rows, query, expected = lookup
    ops = MemoryImplementations()[implementation]
    query = query.clone().requires_grad_()
    out = table.lookup_dot(rows, query, ops)
    assert out.shape == (TOKENS, SLOTS) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    reference = table.weight.detach().double().requires_grad_()
    reference_query = query.detach().double().requires_grad_()
    expected_grads = _grads(torch.einsum("tkd,td->tk", reference[rows], reference_query), reference, reference_query)
    for grad, wanted in zip(_grads(out, table.weight, query), expected_grads):
        torch.testing.assert_close(grad.double(), wanted, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, lookup) -> SafetensorsCheckpoint:
    folder = tmp_path_factory.mktemp("pre_values")
    save_file({NAME: lookup[0].weight.detach().contiguous()}, folder / "model.safetensors")
    return SafetensorsCheckpoint.find(folder)


@pytest.mark.parametrize("store_class", [HostValueStore, DiskValueStore])
def test_offloaded_stores_equal_the_loop_read_each_row_once_and_pass_the_query_gradient(lookup, checkpoint,
                                                                                       store_class):  # fmt: skip
    table, rows, query, expected = lookup
    store = store_class.from_table(DeferredValueTable(NUM_ROWS, WIDTH, 1.0), NAME, checkpoint=checkpoint)
    query = query.clone().requires_grad_()
    out = store.lookup_dot(rows, query, None)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert store.rows_read == rows.unique().numel()
    einsum_query = query.detach().clone().requires_grad_()
    (wanted,) = _grads(torch.einsum("tkd,td->tk", table.weight.detach()[rows], einsum_query), einsum_query)
    torch.testing.assert_close(_grads(out, query)[0], wanted, rtol=1e-5, atol=1e-5)


def test_a_deferred_table_says_how_to_attach_a_store(lookup):
    _, rows, query, _ = lookup
    with pytest.raises(RuntimeError, match="a value store attaches the value tables"):
        DeferredValueTable(NUM_ROWS, WIDTH, 1.0).lookup_dot(rows, query, None)


@pytest.mark.parametrize(("store", "name"), [("int8", NAME), ("cpu-int4", NAME), ("int8", "model.value_pool.weight")])
def test_quantized_stores_refuse_pre_value_and_pool_tables_in_one_line(lookup, store, name):
    table = lookup[0]
    with pytest.raises(
        QuantizationError,
        match=rf"memory_quantization='int\d' covers each memory layer's value table, not {name}: use memory_",
    ):
        QUANTIZED_STORES[store].from_table(table, name, num_cores=2)
