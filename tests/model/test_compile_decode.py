"""torch.compile(fullgraph=True) traces UltraMem's prefill and decoding steps with a StaticCache as one graph each,
and the compiled steps give the eager logits.

CUDA graphs (`torch.compile(mode="reduce-overhead")`, as `benchmarks/lib/models.py::decode_step` times decoding) need
the step as one graph. One graph break inside the model's layer loop makes Dynamo give up the loop's frame and compile
each layer's call on its own, once per layer until the recompile limit, after which the layers run eagerly (the first
H200 run: 931 launches per ultramem-680m-x12 step, 1 for the dense model). fullgraph=True turns a break into an error;
the aot_eager backend traces what Inductor would get, without Inductor's compile time.
"""

import pytest
import torch
import torch._dynamo
from conftest import small_config
from torch._dynamo.testing import CompileCounterWithBackend
from transformers import StaticCache

from ultramem import UltraMemForCausalLM
from ultramem.kernels import triton_available
from ultramem.kernels._device import interpreting
from ultramem.memory_implementations import memory_ops_for

PROMPT_LENGTH, DECODE_STEPS, CACHE_LENGTH = 5, 3, 12
# Triton launches on CUDA tensors, or on CPU tensors in its interpreter (conftest turns it on without a GPU)
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not interpreting() else "cpu")
IMPLEMENTATIONS = [
    pytest.param(None, id="device-default"),  # what the decode benchmark runs: Triton on a GPU
    "torch",
    "embedding_bag",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(not triton_available(), reason="needs triton with CUDA or TRITON_INTERPRET=1"),
    ),
]
# small_config has every UltraMem feature on (query conv, TDQKR with MCS, IVE, skip-layer placement); V2 adds the
# per-block memory beside the MLP, the PEER gate on pre-values and the value pool shared by the layers
VARIANTS = {
    "ultramem": {},
    "ultramemv2": dict(
        memory_layers=[[0, 0], [1, 1]], memory_site="mlp", value_gate="peer", pre_value_dim=4, value_pool_size=64
    ),
}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _decode(forward, model: UltraMemForCausalLM, prompt: torch.Tensor, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Logits of the prefill of `prompt` (B, T) by `model.forward`, then of each decoding step of `tokens` (B, S) by
    `forward`, on a fresh StaticCache."""
    cache = StaticCache(config=model.config, max_cache_len=CACHE_LENGTH)
    logits = [model(input_ids=prompt, cache=cache, use_cache=True).logits]
    for step in range(tokens.shape[1]):
        logits.append(forward(input_ids=tokens[:, step : step + 1], cache=cache, use_cache=True).logits)
    return logits


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@torch.no_grad()
def test_compiled_decode_steps_are_one_graph_with_the_eager_logits(implementation, variant):
    torch.manual_seed(0)
    model = UltraMemForCausalLM(small_config(implementation, **VARIANTS[variant])).to(DEVICE).eval()
    prompt = torch.randint(1, 97, (2, PROMPT_LENGTH), device=DEVICE)
    tokens = torch.randint(1, 97, (2, DECODE_STEPS), device=DEVICE)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model.forward, backend=counter, fullgraph=True, dynamic=False)

    eager = _decode(model.forward, model, prompt, tokens)
    got = _decode(compiled, model, prompt, tokens)

    assert counter.frame_count == 1  # every step replays the first step's graph: no recompilation as the cache fills
    for step, (expected, actual) in enumerate(zip(eager, got)):
        torch.testing.assert_close(actual, expected, msg=lambda message: f"step {step}: {message}")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@torch.no_grad()
def test_compiled_prefill_into_a_static_cache_is_one_graph_with_the_eager_logits(implementation):
    torch.manual_seed(0)
    model = UltraMemForCausalLM(small_config(implementation)).to(DEVICE).eval()
    prompt = torch.randint(1, 97, (2, PROMPT_LENGTH), device=DEVICE)
    attention_mask = torch.ones_like(prompt)
    attention_mask[0, :2] = 0  # left padding
    compiled = torch.compile(model.forward, backend="aot_eager", fullgraph=True, dynamic=False)

    def prefill(forward) -> torch.Tensor:
        cache = StaticCache(config=model.config, max_cache_len=CACHE_LENGTH)
        return forward(input_ids=prompt, attention_mask=attention_mask, cache=cache, use_cache=True).logits

    torch.testing.assert_close(prefill(compiled), prefill(model.forward))


def test_the_device_default_implementation_is_chosen_inside_a_graph():
    """With no implementation set, every memory layer's forward asks for the device's default: on CUDA that asks
    whether Triton can launch, which must not call what Dynamo cannot trace (torch 2.11 refuses `find_spec`, which
    broke the GPU decode graph; 2.13 traces it, so a regression shows here only on older torch)."""

    def uses_default(x: torch.Tensor) -> torch.Tensor:
        return x if memory_ops_for(None, torch.device("cuda")) is not None else -x

    torch.compile(uses_default, backend="eager", fullgraph=True)(torch.ones(1))
