"""The n-gram memories' tables (Engram, issue 45) in int8 / int4: `python -m ultramem.quantize` converts them with the
product-key tables (or alone), every quantized store reads their rows as they are, the quantized model is the
dequantized-table model's, and a briefly trained model's validation loss moves by far less than 0.5% in int8."""

import copy
import json

import pytest
import torch
from model_support import NGRAM, perturbed_ngram_tables, small_config

import ultramem.quantized  # noqa: F401 (registers the quantized stores)
from ultramem import UltraMemForCausalLM
from ultramem.offload.random_checkpoint import write_random_checkpoint
from ultramem.quantize import convert
from ultramem.quantized import dequantize, from_pretrained_quantized, quantize
from ultramem.quantized.stores import QuantizedCheckpoint, table_group_size

LOCATIONS = (None, "cpu", "disk")
# Dv = 16 with 2 MCS cores: the model's group is the chunk of 8 (int8) or 4 (int4); the n-gram rows (4 values) take
# their own default where 8 does not divide them (int8: the row, 4)
FORMATS = [("int8", None, 8, 4), ("int4", 4, 4, 4)]  # format, group asked, model's group, n-gram tables' group
PROMPT = {
    "input_ids": torch.tensor([[0, 0, 15, 9, 3, 44, 12], [8, 1, 7, 2, 6, 90, 13]]),
    "attention_mask": torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]]),
}
NGRAM_TABLES = ["model.ngram_memories.0.values.weight", "model.ngram_memories.1.values.weight"]


def ngram_config(**overrides):
    return small_config(**{**NGRAM, "memory_value_dim": 16, "memory_num_keys": 16, **overrides})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ngram_float")
    torch.manual_seed(3)
    model = perturbed_ngram_tables(UltraMemForCausalLM(ngram_config()).eval())
    with torch.no_grad():
        for _, layer in model.named_memory_layers():
            layer.values.weight.normal_(0, 1.0)
    model.save_pretrained(folder, max_shard_size="40KB")  # sharded: tables in files of their own
    return folder, model


@pytest.fixture(scope="module")
def converted(saved, tmp_path_factory):
    folder, _ = saved
    return {
        format: convert(folder, tmp_path_factory.mktemp(format) / "q", format, group) for format, group, *_ in FORMATS
    }


def dequantized_model(reference: UltraMemForCausalLM, format: str, group_size: int, ngram_group: int):
    """The float model whose tables (product-key and n-gram) are their quantized tables dequantized."""
    model = UltraMemForCausalLM(reference.config).eval()
    model.load_state_dict(reference.state_dict())
    with torch.no_grad():
        for name in model.get_value_table_names():
            weight = model.get_parameter(name)
            cores, group = (1, ngram_group) if "ngram" in name else (model.config.mcs_cores, group_size)
            weight.copy_(dequantize(quantize(weight, format, cores, group), format, group))
    return model


def greedy(model) -> torch.Tensor:
    return model.generate(**PROMPT, max_new_tokens=8, do_sample=False)


@pytest.mark.parametrize(("format", "asked", "group", "ngram_group"), FORMATS)
def test_the_converter_quantizes_the_ngram_tables_with_their_own_rows(saved, converted, format, asked, group,
                                                                       ngram_group):  # fmt: skip
    folder, model = saved
    out = converted[format]
    config = json.loads((out / "config.json").read_text())
    assert config["memory_quantization"] == format and config["memory_quantization_group_size"] == group
    checkpoint, original = QuantizedCheckpoint.find(out), QuantizedCheckpoint.find(folder)
    assert checkpoint.table_names() == sorted(model.get_value_table_names())
    for name in NGRAM_TABLES:
        assert table_group_size(format, model.config, name, group) == ngram_group
        assert torch.equal(checkpoint.read(name), quantize(original.read(name), format, 1, ngram_group)), name


@pytest.mark.parametrize("location", LOCATIONS)
@pytest.mark.parametrize(("format", "asked", "group", "ngram_group"), FORMATS)
def test_every_quantized_store_reads_ngram_rows_as_they_are(saved, converted, format, asked, group, ngram_group,
                                                            location):  # fmt: skip
    _, reference = saved
    model = from_pretrained_quantized(UltraMemForCausalLM, converted[format], memory_offload=location).eval()
    dequantized = dequantized_model(reference, format, group, ngram_group)
    for ngram, expected in zip(model.model.ngram_memories, dequantized.model.ngram_memories, strict=True):
        assert ngram.values.format == format and ngram.values.group_size == ngram_group
        rows = torch.randint(0, ngram.table_rows, (2, 5, ngram.num_heads))
        # the read: each row dequantized, the heads' rows side by side (no pooling, no score)
        torch.testing.assert_close(ngram.read(rows), expected.read(rows), rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(model(**PROMPT).logits, dequantized(**PROMPT).logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(greedy(model), greedy(dequantized))


def test_a_quantized_model_that_reads_wrong_ngram_rows_is_caught(saved, converted):
    """The comparison above can fail: the n-gram tables' rows shifted by one give other logits."""
    _, reference = saved
    model = from_pretrained_quantized(UltraMemForCausalLM, converted["int8"]).eval()
    for ngram in model.model.ngram_memories:
        ngram.values.weight.copy_(ngram.values.weight.roll(1, dims=0))
    with torch.no_grad():
        expected = dequantized_model(reference, "int8", 8, 4)(**PROMPT).logits
        assert not torch.allclose(model(**PROMPT).logits, expected, atol=1e-3)


@pytest.mark.parametrize("location", [None, "cpu"])
def test_quantizing_at_load_equals_the_converted_ngram_tables(saved, converted, location):
    folder, _ = saved
    at_load = from_pretrained_quantized(
        UltraMemForCausalLM, folder, memory_quantization="int8", memory_offload=location
    )
    checkpoint = QuantizedCheckpoint.find(converted["int8"])
    for name, ngram in zip(NGRAM_TABLES, at_load.model.ngram_memories, strict=True):
        assert torch.equal(ngram.values.table if location else ngram.values.weight, checkpoint.read(name))
    assert at_load.config.memory_quantization_group_size == 8  # the model's (its memory layers'), not the n-gram's


def test_set_value_store_and_save_pretrained_keep_the_ngram_tables_quantized(saved, tmp_path):
    _, reference = saved
    model = copy.deepcopy(reference)
    model.set_value_store("int4", config=model.config, group_size=4)
    assert model.config.memory_quantization_group_size == 4
    assert torch.equal(greedy(model), greedy(dequantized_model(reference, "int4", 4, 4)))
    model.save_pretrained(tmp_path)
    again = from_pretrained_quantized(UltraMemForCausalLM, tmp_path).eval()
    assert all(ngram.values.weight.dtype == torch.uint8 for ngram in again.model.ngram_memories)
    assert torch.equal(greedy(again), greedy(model))


def test_an_ngram_model_without_memory_layers_converts_with_its_rows_groups(tmp_path):
    """Its group size is resolved for its n-gram rows (int4's 64 does not divide 4: the row)."""
    torch.manual_seed(0)
    model = perturbed_ngram_tables(UltraMemForCausalLM(ngram_config(memory_layers=[])).eval())
    model.save_pretrained(tmp_path / "float")
    out = convert(tmp_path / "float", tmp_path / "q", "int4")
    assert json.loads((out / "config.json").read_text())["memory_quantization_group_size"] == 4
    quantized = from_pretrained_quantized(UltraMemForCausalLM, out, memory_offload="disk").eval()
    assert torch.equal(greedy(quantized), greedy(dequantized_model(model, "int4", 4, 4)))


def test_a_random_checkpoint_writes_quantized_ngram_tables(tmp_path):
    config = ngram_config()
    write_random_checkpoint(config, tmp_path, torch.float32, memory_quantization="int8")
    checkpoint = QuantizedCheckpoint.find(tmp_path)
    for name in NGRAM_TABLES:
        assert checkpoint.locations[name].dtype == torch.uint8
    model = from_pretrained_quantized(UltraMemForCausalLM, tmp_path, memory_offload="disk").eval()
    rows = torch.arange(model.model.ngram_memories[0].table_rows).view(1, -1, 1)
    assert model.model.ngram_memories[0].read(rows).abs().max() == 0  # n-gram rows start at zero, written so too
    assert greedy(model).shape == (2, PROMPT["input_ids"].shape[1] + 8)


# ---- quality: a briefly trained model ------------------------------------------------------------------------------

VOCAB, CONTEXT = 24, 32  # a second-order Markov chain over 24 tokens: the next token is one of 2 per (a, b) pair
STEPS = 40


def chain_blocks(count: int, seed: int) -> torch.Tensor:
    successors = torch.randint(1, VOCAB, (VOCAB, VOCAB, 2), generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(seed)
    columns = list(torch.randint(1, VOCAB, (2, count), generator=generator))
    for _ in range(CONTEXT - 2):
        pick = torch.randint(0, 2, (count,), generator=generator)
        columns.append(successors[columns[-2], columns[-1], pick])
    return torch.stack(columns, dim=1)


@pytest.fixture(scope="module")
def trained():
    """A small model with product keys and n-gram memories trained on the chain until its n-gram tables carry it."""
    torch.manual_seed(0)
    model = UltraMemForCausalLM(ngram_config(vocab_size=VOCAB, query_norm="none"))
    tables = set(model.get_value_table_names())
    groups = [[p for n, p in model.named_parameters() if (n in tables) == is_table] for is_table in (False, True)]
    optimizer = torch.optim.AdamW([{"params": groups[0]}, {"params": groups[1], "lr": 3e-2}], lr=3e-3)
    train = chain_blocks(16 * STEPS, seed=1)
    for batch in train.split(16):
        model(batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


@torch.no_grad()
def validation_loss(model) -> float:
    blocks = chain_blocks(64, seed=2)
    return model(blocks, labels=blocks).lm_loss.item()


def test_int8_tables_keep_the_validation_loss_of_a_trained_ngram_model(trained):
    """Within +0.5% in int8 (the issue's target); the n-gram tables carry enough of the loss that losing them moves
    it by more than that, so the comparison can fail."""
    loss = validation_loss(trained)
    assert loss < 0.9 * torch.log(torch.tensor(VOCAB - 1.0)).item()  # it learned the chain
    without = copy.deepcopy(trained)
    with torch.no_grad():
        for ngram in without.model.ngram_memories:
            ngram.values.weight.zero_()
    assert validation_loss(without) > 1.005 * loss
    for format in ("int8", "int4"):
        quantized = copy.deepcopy(trained)
        quantized.set_value_store(format, config=quantized.config)
        change = validation_loss(quantized) / loss - 1
        assert abs(change) < (0.005 if format == "int8" else 0.05), (format, change)
