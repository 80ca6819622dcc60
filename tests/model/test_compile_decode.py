"""torch.compile(fullgraph=True) traces UltraMem's prefill and decoding steps with a StaticCache as one graph each,
and the compiled steps give the eager logits.

CUDA graphs (`torch.compile(mode="reduce-overhead")`, as `benchmarks/lib/models.py::decode_step` times decoding) need
the step as one graph. One graph break inside the model's layer loop makes Dynamo give up the loop's frame and compile
each layer's call on its own, once per layer until the recompile limit, after which the layers run eagerly (the first
H200 run: 931 launches per ultramem-680m-x12 step, 1 for the dense model). fullgraph=True turns a break into an error;
the aot_eager backend traces what Inductor would get, without Inductor's compile time.

A step right after `refresh_inference_cache` (as `generate` and the decode benchmark call it) reads what is derived
from the weights alone (LayerNorm'd keys, the cores' SVD) from `InferenceCache` instead of computing it
in its graph, and still follows weights changed in place between steps.
"""

import copy
from collections.abc import Callable

import pytest
import torch
import torch._dynamo
from model_support import small_config
from torch._dynamo.testing import CompileCounterWithBackend
from transformers import CompileConfig, StaticCache

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


def _decode(
    forward, model: UltraMemForCausalLM, prompt: torch.Tensor, tokens: torch.Tensor, after_prefill=lambda: None
) -> list[torch.Tensor]:
    """Logits of the prefill of `prompt` (B, T) by `model.forward`, then of each decoding step of `tokens` (B, S) by
    `forward`, on a fresh StaticCache."""
    cache = StaticCache(config=model.config, max_cache_len=CACHE_LENGTH)
    logits = [model(input_ids=prompt, cache=cache, use_cache=True).logits]
    after_prefill()
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


def _capturing(graphs: list[torch.fx.GraphModule]) -> Callable:
    """A Dynamo backend that keeps the graphs it is given in `graphs` and runs them as they are."""

    def backend(graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        graphs.append(graph)
        return graph.forward

    return backend


def _graph_computes(graph: torch.fx.GraphModule) -> dict[str, bool]:
    """Whether a Dynamo graph normalizes keys (runs a `key_norm`) and takes an SVD of the cores."""
    stacks = [str(node.meta.get("nn_module_stack", {})) for node in graph.graph.nodes]
    targets = [str(node.target) for node in graph.graph.nodes]
    return {"key_norm": any("key_norm" in stack for stack in stacks), "svd": any("svd" in t for t in targets)}


def _change_weights(model: UltraMemForCausalLM, how: str, inputs: torch.Tensor) -> None:
    """In place, as training and checkpoint loading do (two models changed alike stay alike)."""
    if how == "optimizer step":
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        with torch.enable_grad():
            model(input_ids=inputs, labels=inputs).loss.backward()
        optimizer.step()
    elif how == "load_state_dict":
        torch.manual_seed(1)
        model.load_state_dict(UltraMemForCausalLM(model.config).state_dict())


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("refreshed", [False, True], ids=["no-refresh", "refreshed"])
@torch.no_grad()
def test_compiled_decode_follows_weights_changed_in_place_and_reads_the_refreshed_cache(refreshed, variant):
    """Weights changed in place between compiled steps (after the eager prefill), by an optimizer step or by
    `load_state_dict`: the compiled steps give the eager logits of the new weights, with no recompilation. A step
    after `refresh_inference_cache` reads the LayerNorm'd keys and the cores' singular vectors from
    the cache, so its graph has no key norm and no SVD (what the CUDA-graph decode step recomputed); a step with no
    refresh before it computes them in its graph."""
    torch.manual_seed(0)
    model = UltraMemForCausalLM(small_config("torch", **VARIANTS[variant])).eval()
    reference = copy.deepcopy(model)
    prompt, tokens = torch.randint(1, 97, (2, PROMPT_LENGTH)), torch.randint(1, 97, (2, DECODE_STEPS))
    graphs: list[torch.fx.GraphModule] = []
    compiled = torch.compile(model.forward, backend=_capturing(graphs), fullgraph=True, dynamic=False)

    def step(**inputs) -> torch.Tensor:
        if refreshed:
            model.refresh_inference_cache()
        return compiled(**inputs)

    previous = None
    for how in ("nothing", "optimizer step", "load_state_dict"):
        eager = _decode(reference.forward, reference, prompt, tokens, lambda: _change_weights(reference, how, prompt))
        got = _decode(step, model, prompt, tokens, lambda: _change_weights(model, how, prompt))
        for i, (expected, actual) in enumerate(zip(eager, got)):
            torch.testing.assert_close(actual, expected, msg=lambda message: f"after {how}, step {i}: {message}")
        assert previous is None or not torch.allclose(got[-1], previous[-1])
        previous = got
    assert [_graph_computes(graph) for graph in graphs] == [{"key_norm": not refreshed, "svd": not refreshed}]


@torch.no_grad()
def test_static_cache_generate_compiled_matches_eager_before_and_after_a_weight_change():
    """`generate` with a static cache compiles its steps (here on CPU too) and refreshes the cache before each in
    `prepare_inputs_for_generation`: token for token the eager generation, before and after an in-place change."""
    torch.manual_seed(0)
    model = UltraMemForCausalLM(small_config("torch")).eval()
    prompt = torch.randint(1, 97, (2, PROMPT_LENGTH))
    graphs: list[torch.fx.GraphModule] = []
    compile_config = CompileConfig(fullgraph=True, dynamic=False, backend=_capturing(graphs), mode=None)
    compile_config._compile_all_devices = True
    generate = dict(max_new_tokens=DECODE_STEPS + 2, do_sample=False, cache_implementation="static")

    generated = []
    for _ in range(2):
        generated.append(model.generate(prompt, disable_compile=True, **generate))
        assert torch.equal(model.generate(prompt, compile_config=compile_config, **generate), generated[-1])
        for layer in model.model.memory_layers:
            layer.retrieval.row_keys.mul_(-1.5)
            layer.retrieval.cores.add_(0.5)
    assert not torch.equal(*generated)
    assert [_graph_computes(graph) for graph in graphs] == [{"key_norm": False, "svd": False}]  # one graph
