"""The Triton lookup-reduce over quantized tables, compiled on a CUDA device, against the dequantize-then-pool reference.

The CPU suite (tests/quantized/test_triton_quantized.py) runs the comparisons in Triton's interpreter at small shapes;
here they run compiled at the 680M memory shape (>= 1M rows, 4,096 tokens), int8 and int4 (two group sizes), fp32
and bf16 scores, with the issue's tolerance (1e-5 relative on the float32 output); then a model whose tables are
quantized on the GPU against the same model with the dequantized float tables, logits and greedy tokens. Same
switches as tests/gpu/test_triton_on_gpu.py (ULTRAMEM_GPU_SMOKE=1: CPU, interpreter, small shapes; ULTRAMEM_GPU_REPORT
records every comparison), whose `device` and `check` fixtures these tests use.
"""

import pytest
import test_triton_on_gpu as gpu_suite
import torch
from test_triton_on_gpu import DTYPES, SMOKE, TOLERANCE, dtype_name, model_on, relative_error

import ultramem.quantized  # noqa: F401 (registers the quantized value stores)
from ultramem.kernels.quantized_lookup import quantized_lookup_reduce
from ultramem.presets import get_config
from ultramem.quantized import dequantize, lookup_reduce_quantized, lookup_reduce_quantized_reference, quantize

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() or SMOKE),
        reason="needs a CUDA device (ULTRAMEM_GPU_SMOKE=1: on CPU in Triton's interpreter)",
    ),
]
ROWS, TOKENS = (256, 4) if SMOKE else (1 << 20, 4096)
DISTINCT_ROWS = 256 if SMOKE else 65_536  # quantized on the host, tiled to ROWS on the device
MEMORY = "ultramem-151m-x12" if SMOKE else "ultramem-680m-x12"
device, check = gpu_suite.device, gpu_suite.check  # the GPU suite's fixtures (the device, recorded comparisons)
FORMATS = [("int8", None), ("int4", 64), ("int4", 32)]  # None: one group per MCS chunk (the int8 default)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("format, group_size", FORMATS, ids=lambda v: str(v))
def test_quantized_lookup_reduce_matches_the_reference(device, check, format, group_size, dtype):
    """Forward (float32 in both: 1e-5 relative whatever the scores' dtype) and score gradient; rows drawn from a hot
    1/64 of the table (duplicates within and across tokens); `lookup_reduce_quantized` on the device is the kernel."""
    config = get_config(MEMORY)
    slots, num_groups, cores, dim = (config.memory_heads * config.memory_topk, config.ive_expansion,
                                     config.mcs_cores, config.memory_value_dim)  # fmt: skip
    group_size = group_size or dim // cores
    generator = torch.Generator().manual_seed(0)
    distinct = quantize(torch.randn(DISTINCT_ROWS, dim, generator=generator), format, cores, group_size)
    table = distinct.to(device).repeat(ROWS // DISTINCT_ROWS, 1)
    generator = torch.Generator(device=device).manual_seed(1)
    rows = torch.randint(0, ROWS // 64, (TOKENS, slots), device=device, generator=generator)
    groups = torch.randint(0, num_groups, (TOKENS, slots), device=device, generator=generator)
    scores = torch.randn(TOKENS, slots, cores, device=device, generator=generator).to(dtype)
    grad_out = torch.randn(TOKENS, num_groups, dim, device=device, generator=generator)
    results = {}
    for name, fn in (("kernel", quantized_lookup_reduce), ("reference", lookup_reduce_quantized_reference)):
        leaf = scores.clone().requires_grad_(True)
        out = fn(table, rows, groups, leaf, num_groups, format, group_size)
        results[name] = (out.detach(), *torch.autograd.grad(out, leaf, grad_out))
    (out, grad), (expected, expected_grad) = results["kernel"], results["reference"]
    detail = dict(config=MEMORY, format=format, group_size=group_size, dtype=dtype_name(dtype), tokens=TOKENS,
                  rows=ROWS)  # fmt: skip
    check("quantized lookup_reduce forward", relative_error(out, expected), 1e-5, **detail)
    check("quantized lookup_reduce backward: scores", relative_error(grad, expected_grad), TOLERANCE[dtype], **detail)
    if device.type == "cuda":
        dispatched = lookup_reduce_quantized(table, rows, groups, scores, num_groups, format, group_size)
        check("lookup_reduce_quantized on CUDA is the kernel: bits differing", float(not torch.equal(dispatched, out)),
              0.0, **detail)  # fmt: skip


@pytest.mark.parametrize("format", ["int8", "int4"])
def test_model_with_quantized_tables_matches_the_dequantized_float_model(device, check, format):
    """tiny-ultramem with its tables quantized on the device (the quantized stores' Triton path) against the same model
    holding the dequantized tables as float weights (the float Triton path): logits and greedy tokens."""
    model = model_on(device, torch.float32, "tiny-ultramem").eval()
    with torch.no_grad():  # tables off their init scale, so that they matter to the logits
        for _, layer in model.named_memory_layers():
            layer.values.weight.normal_(0, 1.0)
    reference = model_on(device, torch.float32, "tiny-ultramem").eval()
    reference.load_state_dict(model.state_dict())
    model.set_value_store(format, config=model.config)  # the format's default group size
    group_size = model.config.memory_quantization_group_size
    with torch.no_grad():
        for (_, layer), (_, float_layer) in zip(model.named_memory_layers(), reference.named_memory_layers()):
            float_layer.values.weight.copy_(dequantize(layer.values.weight.cpu(), format, group_size))
    length, new = (6, 3) if SMOKE else (32, 16)
    prompt = torch.randint(0, model.config.vocab_size, (2, length), device=device,
                           generator=torch.Generator(device=device).manual_seed(3))  # fmt: skip
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new, do_sample=False)
    with torch.no_grad():
        logits, expected = model(input_ids=prompt).logits, reference(input_ids=prompt).logits
        tokens, expected_tokens = model.generate(prompt, **kwargs), reference.generate(prompt, **kwargs)
    detail = dict(config="tiny-ultramem", format=format, group_size=group_size)
    check("quantized-table model vs dequantized float model: logits", relative_error(logits, expected), 1e-4, **detail)
    check("quantized-table model vs dequantized float model (greedy): tokens differing",
          (tokens != expected_tokens).float().mean().item(), 0.0, **detail)  # fmt: skip
