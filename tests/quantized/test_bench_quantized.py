"""benchmarks/bench_quantized.py measures what it says: zero KL for the float model, a small positive one for int8,
a larger one for int4, table bytes of the format."""

import importlib.util
from pathlib import Path

import torch
from conftest import small_config

from ultramem import UltraMemForCausalLM

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_quantized.py"
spec = importlib.util.spec_from_file_location("bench_quantized", SCRIPT)
bench_quantized = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_quantized)


def test_measure_orders_the_formats_by_their_error(tmp_path):
    torch.manual_seed(0)
    model = UltraMemForCausalLM(small_config(memory_value_dim=16, memory_num_keys=16)).eval()
    with torch.no_grad():
        for _, layer in model.named_memory_layers():
            layer.values.weight.normal_(0, 1.0)
    model.save_pretrained(tmp_path)
    blocks = torch.randint(1, 97, (4, 16), generator=torch.Generator().manual_seed(0))
    variants = [("fp32", None, None), ("int8", "int8", None), ("int4-g8", "int4", 8), ("int4-g4", "int4", 4)]
    rows = {row["variant"]: row for row in bench_quantized.measure(tmp_path, blocks, variants, batch_size=2)}
    assert rows["fp32"]["kl_per_token"] == 0 and rows["fp32"]["table_rms_error"] == 0
    assert 0 < rows["int8"]["kl_per_token"] < rows["int4-g4"]["kl_per_token"] < rows["int4-g8"]["kl_per_token"]
    assert 0 < rows["int8"]["table_rms_error"] < 0.01 < rows["int4-g4"]["table_rms_error"]
    num_values = model.config.memory_num_values * 3  # three memory layers
    assert rows["fp32"]["table_bytes"] == num_values * 16 * 4
    assert rows["int8"]["table_bytes"] == num_values * 2 * (8 + 8)
    assert rows["int4-g4"]["table_bytes"] == num_values * 4 * (2 + 4)
    assert "| int4-g4 | 4 |" in bench_quantized.markdown(list(rows.values()), 60, "x")
