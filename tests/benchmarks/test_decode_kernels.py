"""benchmarks/decode_kernels.py (issue 34, item 3): the kernels a compiled decode step launches, counted in the code
Inductor generates on CPU. The memory layer's bound is checked here, where the count is the same on every run."""

import json

import decode_kernels

MAX_KERNELS_PER_MEMORY_LAYER = 6  # issue 34's target for the decode step


def test_launches_are_read_from_generated_code():
    code = """
def call(args):
    buf0 = empty_strided_cpu((2, 8), (8, 1), torch.float32)
    cpp_fused_native_layer_norm_0(arg0_1, buf0)
    extern_kernels.mm(buf0, arg1_1, out=buf1)
    buf2 = torch.ops.ultramem.tucker_topk.default(buf1, buf1, arg2_1, arg3_1, arg4_1, 4)
    triton_poi_fused_add_1.run(buf3, buf4, 16, stream=stream0)
    cpp_fused_native_layer_norm_2(buf2, buf5)
"""
    assert decode_kernels.launches(code) == {
        "generated:cpp_fused_native_layer_norm": 2,
        "generated:triton_poi_fused_add": 1,
        "extern:mm": 1,
        "op:ultramem.tucker_topk": 1,
    }


def test_the_triton_memory_layer_launches_at_most_six_kernels_in_a_decode_step(tmp_path, capsys):
    """tiny-ultramem against tiny-dense, compiled on CPU: with the one-kernel selection (opt-in) the memory layer's
    extra launches stay within issue 34's bound (its selection one kernel, no `topk`); the default Triton path (the
    candidate kernel between the axes' `topk`) and the PyTorch path launch more (11 and 9 at torch 2.13)."""
    decode_kernels.main(["--size", "tiny", "--device", "cpu", "--results-dir", str(tmp_path)])
    result = json.loads((tmp_path / "decode_kernels_cpu.json").read_text())
    rows = {row["model"]: row for row in result["rows"]}
    layers = result["memory_layers"]
    fused, triton, torch_path = rows["ultramem/triton+fused-selection"], rows["ultramem/triton"], rows["ultramem/torch"]
    assert fused["by_name"]["op:ultramem.tucker_topk"] == layers and "op:aten.topk" not in fused["by_name"]
    assert fused["by_name"]["op:ultramem.lookup_reduce"] == layers
    assert fused["per_memory_layer_over_dense"] <= MAX_KERNELS_PER_MEMORY_LAYER, fused
    assert "op:ultramem.tucker_topk" not in triton["by_name"]
    assert triton["by_name"]["op:ultramem.tucker_candidate_index"] == layers
    assert torch_path["by_name"]["op:aten.topk"] >= 2 * layers  # the reference: each axis' top-m, then the grid's
    extra = [row["per_memory_layer_over_dense"] for row in (fused, triton, torch_path)]
    assert extra[0] < min(extra[1:]), extra  # the one-kernel selection launches the fewest
    assert "ultramem/triton+fused-selection" in capsys.readouterr().out
