"""The random-checkpoint builder writing quantized tables directly (`--memory-quantization int8|int4`): the tables are
valid rows of the format (decoded by hand as PyTorch's own unpack decodes them, every group spanning its full code
range), the checkpoint records its format and loads as a converted one does, in every location."""

import json

import pytest
import torch
from model_support import small_config
from transformers import AutoModelForCausalLM

import ultramem.quantized  # noqa: F401 (registers the quantized stores)
from ultramem import UltraMemConfig, UltraMemForCausalLM
from ultramem.modeling_ultramem import MemoryInitScales
from ultramem.offload.random_checkpoint import main, write_random_checkpoint
from ultramem.quantized import QuantizationError, dequantize
from ultramem.quantized.format import group_bytes, quantized_width
from ultramem.quantized.stores import METADATA_FORMAT, METADATA_GROUP, QuantizedCheckpoint

FORMATS = [("int8", None, 8), ("int4", 4, 4)]  # (format, group size asked, resolved): Dv = 16, h = 2, chunk 8
PROMPT = torch.tensor([[5, 9, 3, 44, 7], [8, 1, 7, 2, 90]])
UNPACK = {
    "int8": torch.ops.quantized.embedding_bag_byte_unpack,
    "int4": torch.ops.quantized.embedding_bag_4bit_unpack,
}


def config() -> UltraMemConfig:
    return small_config(memory_value_dim=16, memory_num_keys=16)


@pytest.fixture(scope="module", params=FORMATS, ids=[f[0] for f in FORMATS])
def built(request, tmp_path_factory):
    format, group_size, resolved = request.param
    folder = tmp_path_factory.mktemp(format) / "ckpt"
    write_random_checkpoint(config(), folder, torch.bfloat16, memory_quantization=format, group_size=group_size)
    return folder, format, resolved


def test_tables_are_valid_rows_of_the_recorded_format(built):
    folder, format, group_size = built
    saved = json.loads((folder / "config.json").read_text())
    assert (saved["memory_quantization"], saved["memory_quantization_group_size"]) == (format, group_size)
    checkpoint = QuantizedCheckpoint(sorted(folder.glob("*.safetensors")))
    names = UltraMemForCausalLM(config()).get_value_table_names()
    assert checkpoint.table_names() == sorted(names)
    std = MemoryInitScales.from_config(config()).value_std
    levels = 255 if format == "int8" else 15
    for name in names:
        location = checkpoint.locate(name)
        assert checkpoint.metadata[location.path][METADATA_FORMAT] == format
        assert checkpoint.metadata[location.path][METADATA_GROUP] == str(group_size)
        table = checkpoint.read(name)
        rows, value_dim = config().memory_num_values, config().memory_value_dim
        assert table.dtype == torch.uint8 and table.shape == (rows, quantized_width(format, value_dim, group_size))
        groups = table.view(-1, group_bytes(format, group_size))  # the (N*G, group bytes) view the ops take
        decoded = dequantize(table, format, group_size)
        torch.testing.assert_close(decoded.view(-1, group_size), UNPACK[format](groups))  # what PyTorch's ops read
        assert torch.unique(table, dim=0).shape[0] == rows  # rows differ
        # each group was quantized from random numbers: its codes run from 0 (its min) to the top code (its max)
        codes = groups[:, :group_size] if format == "int8" else groups[:, : group_size // 2]
        if format == "int4":
            codes = torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(1)
        assert torch.all(codes.amin(1) == 0) and torch.all(codes.amax(1) == levels)
        assert torch.isfinite(decoded).all() and abs(decoded.std() / std - 1) < 0.1 and abs(decoded.mean()) < 0.1 * std


def test_loads_as_a_quantized_checkpoint_in_every_location_and_equals_its_dequantized_tables(built):
    folder, format, group_size = built
    models = {
        location: AutoModelForCausalLM.from_pretrained(folder, memory_offload=location, dtype=torch.float32).eval()
        for location in (None, "cpu", "disk")
    }
    with torch.no_grad():
        logits = {location: model(PROMPT).logits for location, model in models.items()}
    assert torch.isfinite(logits[None]).all()
    for location in ("cpu", "disk"):
        torch.testing.assert_close(logits[location], logits[None], rtol=1e-5, atol=1e-6)
    # the same weights (bf16 in the file, exact in float32) with the tables decoded: what the format says they are
    quantized = models[None]
    reference = UltraMemForCausalLM(config()).eval()
    state = {k: v for k, v in quantized.state_dict().items() if not k.endswith("values.weight")}
    reference.load_state_dict(state, strict=False)
    with torch.no_grad():
        for (_, layer), (_, q_layer) in zip(
            reference.named_memory_layers(), quantized.named_memory_layers(), strict=True
        ):
            layer.values.weight.copy_(dequantize(q_layer.values.weight, format, group_size))
        expected = reference(PROMPT).logits
    torch.testing.assert_close(logits[None], expected, rtol=0, atol=1e-5 * expected.abs().max())


def test_load_time_checks_see_the_recorded_format(built):
    folder, format, group_size = built
    other = "int4" if format == "int8" else "int8"
    with pytest.raises(QuantizationError, match=f"the checkpoint holds {format} tables"):
        UltraMemForCausalLM.from_pretrained(folder, memory_quantization=other)
    with pytest.raises(QuantizationError, match=f"have group size {group_size}, not 2"):
        UltraMemForCausalLM.from_pretrained(folder, memory_quantization_group_size=2)


def test_bad_settings_are_one_line_before_anything_is_written(tmp_path, capsys):
    with pytest.raises(QuantizationError, match=r"group size 3 must be a positive divisor of the MCS chunk 8"):
        write_random_checkpoint(config(), tmp_path / "a", torch.bfloat16, memory_quantization="int4", group_size=3)
    with pytest.raises(QuantizationError, match="this config has no value tables"):
        write_random_checkpoint(config().__class__(**{**config().to_dict(), "memory_layers": []}), tmp_path / "b",
                                torch.bfloat16, memory_quantization="int8")  # fmt: skip
    assert not any(tmp_path.iterdir())
    with pytest.raises(SystemExit, match="--group-size is the quantized tables' group"):
        main(["--preset", "tiny-ultramem", "--output", str(tmp_path / "c"), "--group-size", "32"])
    with pytest.raises(SystemExit, match=r"^error: group size 48 must be a positive divisor"):
        main(["--preset", "tiny-ultramem", "--output", str(tmp_path / "c"), "--memory-quantization", "int4",
              "--group-size", "48"])  # fmt: skip
    assert not any(tmp_path.iterdir())


def test_table_shapes_come_from_the_model_and_tables_no_store_quantizes_are_refused(tmp_path):
    """PEER's pre-value tables are narrower than the values: each table is written at its own width; quantizing a
    model that has them is one line before anything is written (no quantized store serves them)."""
    peer = config().__class__(**{**config().to_dict(), "value_gate": "peer", "pre_value_dim": 8})
    write_random_checkpoint(peer, tmp_path / "float", torch.bfloat16)
    checkpoint = QuantizedCheckpoint(sorted((tmp_path / "float").glob("*.safetensors")))
    model = UltraMemForCausalLM.from_pretrained(tmp_path / "float").eval()
    names = model.get_value_table_names()
    assert any(".pre_values." in name for name in names)
    for name in names:
        assert checkpoint.read(name).shape == model.get_parameter(name).shape, name
    with pytest.raises(QuantizationError, match="covers each memory layer's value table, not the pre-value tables"):
        write_random_checkpoint(peer, tmp_path / "q", torch.bfloat16, memory_quantization="int8")
    assert not (tmp_path / "q").exists()
