"""Quantized value stores (local, "cpu", "disk") and the streaming converter `python -m ultramem.quantize`, on a small
saved model: converted tables equal `quantize()` of the originals, every store equals the dequantized-table model,
generation is token for token the dequantized-table model's."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from model_support import small_config
from transformers.testing_utils import CaptureLogger

import ultramem.quantized  # noqa: F401 (registers the quantized stores)
from ultramem import UltraMemForCausalLM
from ultramem.quantize import convert, main
from ultramem.quantized import QuantizationError, dequantize, from_pretrained_quantized, quantize
from ultramem.quantized.stores import QUANTIZED_STORES, QuantizedCheckpoint, QuantizedValueTable
from ultramem.quantized.stores import logger as stores_logger

LOCATIONS = (None, "cpu", "disk")
PROMPT = {
    "input_ids": torch.tensor([[0, 0, 5, 9, 3, 44], [8, 1, 7, 2, 6, 90]]),
    "attention_mask": torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]),
}
FORMATS = [("int8", None), ("int4", 4)]  # Dv = 16, h = 2: chunk 8 (int8 one group per chunk)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, UltraMemForCausalLM]:
    folder = tmp_path_factory.mktemp("float")
    torch.manual_seed(3)
    model = UltraMemForCausalLM(small_config(memory_value_dim=16, memory_num_keys=16)).eval()
    with torch.no_grad():  # tables off their init scale, so that they matter to the logits
        for _, layer in model.named_memory_layers():
            layer.values.weight.normal_(0, 1.0)
    model.save_pretrained(folder, max_shard_size="40KB")  # sharded: the tables in their own files
    return folder, model


@pytest.fixture(scope="module")
def converted(saved, tmp_path_factory) -> dict[str, Path]:
    folder, _ = saved
    out = {}
    for format, group_size in FORMATS:
        out[format] = convert(folder, tmp_path_factory.mktemp(format) / "q", format, group_size)
    return out


def dequantized_model(reference: UltraMemForCausalLM, format: str, group_size: int) -> UltraMemForCausalLM:
    """The float model whose tables are the dequantized quantized tables (the reference a quantized model matches)."""
    model = UltraMemForCausalLM(reference.config).eval()
    model.load_state_dict(reference.state_dict())
    with torch.no_grad():
        for _, layer in model.named_memory_layers():
            quantized = quantize(layer.values.weight, format, model.config.mcs_cores, group_size)
            layer.values.weight.copy_(dequantize(quantized, format, group_size))
    return model


def greedy(model) -> torch.Tensor:
    return model.generate(**PROMPT, max_new_tokens=10, do_sample=False)


@pytest.mark.parametrize("format, group_size", FORMATS)
def test_converted_tables_equal_quantize_of_the_originals_and_the_rest_is_copied(saved, converted, format, group_size):
    folder, reference = saved
    out = converted[format]
    config = json.loads((out / "config.json").read_text())
    group_size = group_size or 8
    assert config["memory_quantization"] == format and config["memory_quantization_group_size"] == group_size
    assert (out / "modeling_ultramem.py").is_file() and (out / "model.safetensors.index.json").is_file()
    checkpoint, original = QuantizedCheckpoint.find(out), QuantizedCheckpoint.find(folder)
    assert len(checkpoint.table_names()) == 3
    for name in original.locations:
        if name in checkpoint.table_names():
            expected = quantize(original.read(name), format, 2, group_size)
            assert torch.equal(checkpoint.read(name), expected), name
        else:
            assert torch.equal(checkpoint.read(name), original.read(name)), name


@pytest.mark.parametrize("location", LOCATIONS)
@pytest.mark.parametrize("format, group_size", FORMATS)
def test_every_store_equals_the_dequantized_table_model_and_generates_its_tokens(
    saved, converted, format, group_size, location
):
    _, reference = saved
    model = from_pretrained_quantized(UltraMemForCausalLM, converted[format], memory_offload=location).eval()
    values = model.model.memory_layers[0].values
    assert (
        values.format == format and values.table.dtype == torch.uint8
        if location
        else values.weight.dtype == torch.uint8
    )
    dequantized = dequantized_model(reference, format, group_size or 8)
    with torch.no_grad():
        logits = model(**PROMPT).logits
        expected = dequantized(**PROMPT).logits
        original = reference(**PROMPT).logits
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    relative = ((logits - original).norm() / original.norm()).item()
    assert relative < (0.01 if format == "int8" else 0.2), relative  # int8: ~0.2%, int4 (groups of 4): ~3%
    assert torch.equal(greedy(model), greedy(dequantized))


def test_a_model_that_ignores_the_tables_is_caught(saved, converted):
    """The comparison above can fail: zeroed tables change the logits."""
    _, reference = saved
    model = from_pretrained_quantized(UltraMemForCausalLM, converted["int8"]).eval()
    for _, layer in model.named_memory_layers():
        layer.values.weight.zero_()
    with torch.no_grad():
        assert not torch.allclose(
            model(**PROMPT).logits, dequantized_model(reference, "int8", 8)(**PROMPT).logits, atol=1e-3
        )


@pytest.mark.parametrize("location", [None, "cpu"])
def test_quantizing_a_float_checkpoint_at_load_equals_the_converted_one(saved, converted, location):
    folder, _ = saved
    at_load = from_pretrained_quantized(
        UltraMemForCausalLM,
        folder,
        memory_quantization="int4",
        memory_quantization_group_size=4,
        memory_offload=location,
    )
    checkpoint = QuantizedCheckpoint.find(converted["int4"])
    for name, layer in at_load.named_memory_layers():
        table = layer.values.table if location else layer.values.weight
        assert torch.equal(table, checkpoint.read(f"{name}.values.weight"))
    assert at_load.config.memory_quantization == "int4" and at_load.config.memory_quantization_group_size == 4


def test_save_pretrained_of_a_quantized_model_writes_a_quantized_checkpoint(saved, converted, tmp_path):
    model = from_pretrained_quantized(UltraMemForCausalLM, converted["int8"]).eval()
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["memory_quantization"] == "int8"
    again = from_pretrained_quantized(UltraMemForCausalLM, tmp_path).eval()
    assert torch.equal(greedy(again), greedy(model))


def test_set_value_store_quantizes_an_in_memory_model(saved):
    _, reference = saved
    model = UltraMemForCausalLM(reference.config).eval()
    model.load_state_dict(reference.state_dict())
    model.set_value_store("cpu-int8", config=model.config)
    assert model.config.memory_quantization == "int8" and model.config.memory_quantization_group_size == 8
    assert torch.equal(greedy(model), greedy(dequantized_model(reference, "int8", 8)))
    model = UltraMemForCausalLM(reference.config).eval()
    model.load_state_dict(reference.state_dict())
    model.set_value_store("int4", config=model.config, group_size=4)
    assert isinstance(model.model.memory_layers[0].values, QuantizedValueTable)
    assert torch.equal(greedy(model), greedy(dequantized_model(reference, "int4", 4)))


@pytest.mark.parametrize("location", LOCATIONS)
def test_training_through_quantized_tables_leaves_them_and_says_so(converted, location):
    model = from_pretrained_quantized(UltraMemForCausalLM, converted["int8"], memory_offload=location).train()
    store = model.model.memory_layers[0].values
    table = (store.table if location else store.weight).clone()
    cores = model.model.memory_layers[0].retrieval.cores.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stores_logger.warning_once.cache_clear()
    with CaptureLogger(stores_logger) as captured:
        model(**PROMPT, labels=PROMPT["input_ids"]).loss.backward()
    assert captured.out.count("Quantized value tables are frozen") == 1
    assert model.model.memory_layers[0].retrieval.cores.grad.abs().sum() > 0
    optimizer.step()
    assert torch.equal(store.table if location else store.weight, table)
    assert not torch.equal(model.model.memory_layers[0].retrieval.cores, cores)


def test_loading_mismatches_are_one_line_before_loading(saved, converted):
    folder, _ = saved
    with pytest.raises(QuantizationError, match="holds int8 tables: load it with memory_quantization='int8'"):
        from_pretrained_quantized(UltraMemForCausalLM, converted["int8"], memory_quantization="int4")
    with pytest.raises(QuantizationError, match="group size 4, not 8"):
        from_pretrained_quantized(UltraMemForCausalLM, converted["int4"], memory_quantization_group_size=8)
    with pytest.raises(QuantizationError, match="needs a quantized checkpoint: python -m ultramem.quantize"):
        from_pretrained_quantized(UltraMemForCausalLM, folder, memory_quantization="int8", memory_offload="disk")
    with pytest.raises(QuantizationError, match="needs memory_quantization='int8' or 'int4'"):
        from_pretrained_quantized(UltraMemForCausalLM, folder)
    with pytest.raises(QuantizationError, match="needs the MCS core count"):
        QUANTIZED_STORES["int8"].from_table(UltraMemForCausalLM(small_config()).model.memory_layers[0].values, "v")


def test_converter_refuses_bad_input_with_one_line_before_any_work(saved, converted, tmp_path, monkeypatch, capsys):
    folder, _ = saved
    cases = [
        ([str(converted["int8"]), str(tmp_path / "a"), "--format", "int4"], "is already quantized"),
        ([str(folder), str(tmp_path / "b"), "--format", "int4", "--group-size", "3"], "divisor of the MCS chunk 8"),
        ([str(folder), str(converted["int4"]), "--format", "int8"], "is not an empty folder"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit, match=message):
            main(argv)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 100, 100))
    with pytest.raises(SystemExit, match=r"not enough disk space .* needs 0\.\d+ GB, 0\.00 GB free"):
        main([str(folder), str(tmp_path / "c"), "--format", "int8"])
    assert not any((tmp_path / name).exists() for name in "abc")


@pytest.mark.parametrize("location", LOCATIONS)
def test_a_converted_checkpoint_loads_through_auto_classes_with_and_without_the_setting(saved, converted, location):
    from transformers import AutoModelForCausalLM

    _, reference = saved
    expected = greedy(dequantized_model(reference, "int8", 8))
    for setting in ({}, {"memory_quantization": "int8"}):
        model = AutoModelForCausalLM.from_pretrained(converted["int8"], memory_offload=location, **setting).eval()
        assert model.config.memory_quantization == "int8"
        assert torch.equal(greedy(model), expected)
    at_load = AutoModelForCausalLM.from_pretrained(saved[0], memory_quantization="int8").eval()
    assert torch.equal(greedy(at_load), expected)
    float_model = AutoModelForCausalLM.from_pretrained(saved[0]).eval()
    assert float_model.config.memory_quantization is None and torch.equal(greedy(float_model), greedy(reference))


REMOTE_CODE_SCRIPT = """
import sys
import torch
from transformers import AutoModelForCausalLM  # ultramem is installed, not imported: the checkpoint's code runs
folder, expected = sys.argv[1], torch.load(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, memory_quantization="int4",
                                             memory_quantization_group_size=4).eval()
assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
with torch.no_grad():
    torch.testing.assert_close(model(**expected["prompt"]).logits, expected["logits"], rtol=0, atol=0)
print("SAME")
"""


def test_a_float_checkpoint_quantizes_at_load_through_remote_code(saved, tmp_path):
    """`trust_remote_code=True` without `import ultramem` (lm-eval's `--model hf`) loads the checkpoint's copy of the
    model class, whose value-store mixin is not the installed package's that quantizes the tables: the loader must
    find the copy's (it raised `TypeError: super(type, obj)`)."""
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    folder, _ = saved
    model = AutoModelForCausalLM.from_pretrained(folder, memory_quantization="int4", memory_quantization_group_size=4)
    with torch.no_grad():
        torch.save({"prompt": PROMPT, "logits": model.eval()(**PROMPT).logits}, tmp_path / "expected.pt")
    result = subprocess.run([sys.executable, "-c", REMOTE_CODE_SCRIPT, str(folder), str(tmp_path / "expected.pt")],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.stdout.strip().endswith("SAME"), result.stdout[-2000:] + result.stderr[-3000:]


def test_converter_streams_row_blocks_byte_identically(saved, converted, tmp_path, monkeypatch):
    """Blocks of a few rows (instead of 64 MB) give the same files: the streaming does not depend on the block."""
    import ultramem.quantize

    monkeypatch.setattr(ultramem.quantize, "COPY_BYTES", 200)
    out = convert(saved[0], tmp_path / "q", "int4", 4)
    files = sorted(p.name for p in converted["int4"].iterdir())
    assert files == sorted(p.name for p in out.iterdir())
    for name in files:
        assert (out / name).read_bytes() == (converted["int4"] / name).read_bytes(), name
