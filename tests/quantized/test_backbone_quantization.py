"""Quantizing the backbone with Transformers' `quantization_config` (torchao, bitsandbytes) leaves the value tables as
they are: float tables stay the checkpoint's parameters (even with torchao's `include_input_output_embeddings=True`,
whose default config would otherwise reach every `nn.Embedding`), and quantized tables (`memory_quantization`) stay
their uint8 rows, while the backbone's linear layers are quantized."""

import pytest
import torch
from model_support import small_config
from transformers import AutoModelForCausalLM

import ultramem.quantized  # noqa: F401 (registers the quantized stores)
from ultramem import UltraMemForCausalLM
from ultramem.quantize import convert
from ultramem.quantized.stores import QuantizedCheckpoint

PROMPT = torch.tensor([[5, 9, 3, 44, 7], [8, 1, 7, 2, 90]])
# linear layers of sizes bitsandbytes' 4-bit CPU kernel takes (multiples of its 32- and 64-wide blocks)
BNB_FRIENDLY = dict(hidden_size=64, intermediate_size=128, memory_value_dim=64, memory_key_dim=16, vocab_size=128)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("float")
    torch.manual_seed(0)
    model = UltraMemForCausalLM(small_config(**BNB_FRIENDLY, tie_word_embeddings=False)).eval()
    model.save_pretrained(folder)
    return folder, {name: table.values.weight.detach().clone() for name, table in model.named_memory_layers()}


def assert_tables_are_the_checkpoints(model, tables: dict[str, torch.Tensor]) -> None:
    for name, layer in model.named_memory_layers():
        weight = layer.values.weight
        assert type(weight) is torch.nn.Parameter and type(weight.data) is torch.Tensor, (name, type(weight))
        assert torch.equal(weight.detach(), tables[name]), name


def torchao_config(include_embeddings: bool):
    """torchao's int8 weight-only config for the linear layers; with the embeddings, int4 for the input embedding
    and the int8 default for every other module it reaches (Transformers' documented recipe)."""
    torchao = pytest.importorskip("torchao", reason="torchao is not installed (pip install torchao)")
    from torchao.quantization import FqnToConfig, Int8WeightOnlyConfig, IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerAxis
    from transformers import TorchAoConfig

    if not include_embeddings:
        return TorchAoConfig(Int8WeightOnlyConfig()), torchao
    embedding = IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerAxis(0))
    fqn = FqnToConfig({"_default": Int8WeightOnlyConfig(), "model.embed_tokens": embedding})
    return TorchAoConfig(fqn, include_input_output_embeddings=True), torchao


@pytest.mark.filterwarnings("ignore:Config Deprecation")
@pytest.mark.parametrize("include_embeddings", [False, True], ids=["linear", "with_embeddings"])
def test_torchao_quantizes_the_backbone_and_leaves_float_tables_alone(saved, include_embeddings):
    folder, tables = saved
    config, torchao = torchao_config(include_embeddings)
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=config).eval()
    quantized = torchao.utils.TorchAOBaseTensor
    assert isinstance(model.model.layers[0].self_attn.q_proj.weight, quantized)  # the backbone is quantized
    assert isinstance(model.model.embed_tokens.weight, quantized) == include_embeddings
    assert_tables_are_the_checkpoints(model, tables)
    assert config.modules_to_not_convert is None  # the user's config object is not changed
    with torch.no_grad():
        assert torch.isfinite(model(PROMPT).logits).all()


@pytest.mark.filterwarnings("ignore:Config Deprecation")
@pytest.mark.parametrize("location", [None, "cpu"])
def test_torchao_leaves_quantized_tables_as_their_rows(saved, location, tmp_path):
    converted = convert(saved[0], tmp_path / "int8", "int8")
    config, torchao = torchao_config(include_embeddings=True)
    model = AutoModelForCausalLM.from_pretrained(converted, quantization_config=config, memory_offload=location)
    assert isinstance(model.model.layers[0].self_attn.q_proj.weight, torchao.utils.TorchAOBaseTensor)
    checkpoint = QuantizedCheckpoint(sorted(converted.glob("*.safetensors")))
    for name, layer in model.named_memory_layers():
        rows = layer.values.weight if location is None else layer.values.table
        assert type(rows) is torch.Tensor and torch.equal(rows, checkpoint.read(f"{name}.values.weight")), name
    with torch.no_grad():
        assert torch.isfinite(model(PROMPT).logits).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_bitsandbytes_quantizes_the_linear_layers_and_leaves_the_tables_alone(saved, bits):
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install bitsandbytes)")
    from transformers import BitsAndBytesConfig

    folder, tables = saved
    config = BitsAndBytesConfig(**{f"load_in_{bits}bit": True})
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=config, device_map="cpu").eval()
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == ("Linear8bitLt" if bits == 8 else "Linear4bit")
    assert_tables_are_the_checkpoints(model, tables)
    with torch.no_grad():
        assert torch.isfinite(model(PROMPT).logits).all()
