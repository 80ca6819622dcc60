"""Tiny UltraMem checkpoints, Transformers' greedy reference, and vLLM engines run in a child process.

Each engine runs in its own process (`python serving_support.py request.json`), so the test process never holds an
engine and each engine's workers are gone when the call returns. Also run as that child process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
# `run_engine`'s engines keep their core in the child's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0): the scheduler,
# the KV cache and the model runner are the same code, without a second process importing vLLM and the model (about
# half of each engine test's time). The documented blocks, the server and the refusal tests keep vLLM's default, an
# engine process of its own (where the plugin is loaded by itself); tensor parallel's workers are processes either way.
IN_PROCESS_ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
BASE_ENGINE = dict(dtype="float32", max_model_len=512, enforce_eager=True, seed=0, disable_log_stats=False)


def build_checkpoint(path: Path, **overrides) -> torch.nn.Module:
    """Save a tiny UltraMem (head dim 32: vLLM's CPU attention needs >= 32) with the shipped tokenizer; return it.

    The conv weights, the value and pre-value tables and the query normalisation's statistics are redrawn at random:
    the init makes the conv the identity on the current token (a lost conv state would not change a single token),
    the values small and the statistics neutral (a statistic left unloaded would not change one either). N-gram
    memories (`ngram_layers`) get random conv weights too (zero at init) and the tokenizer's canonical ids.
    """
    from ultramem import UltraMemConfig, UltraMemForCausalLM
    from ultramem.ngram_memory import use_canonical_ids
    from ultramem.tokenization import load_tokenizer

    kwargs = dict(
        vocab_size=50304,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        max_position_embeddings=512,
        memory_layers=[[0, 2], [1, 1], [3, 3]],  # skip-layer and same-block placements, two reading one block
        memory_heads=2,
        memory_topk=4,
        memory_key_dim=32,
        memory_num_keys=16,
        memory_value_dim=32,
        tucker_rank=2,
        mcs_cores=2,
        ive_expansion=4,
        query_conv_kernel_size=5,
    )
    kwargs.update(overrides)
    torch.manual_seed(0)
    model = UltraMemForCausalLM(UltraMemConfig(**kwargs)).eval()
    with torch.no_grad():
        for layer in model.model.memory_layers:
            if layer.query.conv is not None:
                layer.query.conv.weight.normal_(0.0, 0.5)
                layer.query.conv.bias.normal_(0.0, 0.1)
            for name, buffer in layer.query.named_buffers():  # the query normalisation's, as after training
                if name.endswith("running_mean"):
                    buffer.normal_(0.0, 0.5)
                elif name.endswith("whitening"):
                    buffer.add_(torch.randn_like(buffer), alpha=0.2)
        for ngram in model.model.ngram_memories:
            ngram.conv.weight.normal_(0.0, 0.5)
            ngram.conv.bias.normal_(0.0, 0.1)
        for name in model.get_value_table_names():
            model.get_parameter(name).normal_(0.0, 1.0)
    tokenizer = load_tokenizer()
    use_canonical_ids(model, tokenizer)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


# The UltraMem family (docs/variants.md) at test size, each as the overrides of `build_checkpoint`'s defaults
V2 = dict(  # UltraMemV2: every block, MLP site, PEER pre-values, single projector, a shared pool of windows
    memory_site="mlp",
    memory_layers=[[0, 0], [1, 1], [2, 2], [3, 3]],
    memory_heads=1,
    share_query=False,
    use_query_conv=False,
    value_gate="peer",
    ive_single_projector=True,
    aux_loss_alpha=0.0,
    memory_value_dim=24,
    pre_value_dim=8,
    value_pool_size=128,
)
MEMORY_PLUS = dict(  # Memory+: PKM with softmax in place of two blocks' MLPs, one table shared, silu gate
    retrieval_mode="product_key",
    memory_score_softmax=True,
    share_query=False,
    qk_layernorm=False,
    ive_expansion=1,
    tucker_rank=1,
    mcs_cores=1,
    improved_init=False,
    use_query_conv=False,
    memory_site="instead_of_mlp",
    memory_layers=[[1, 1], [3, 3]],
    value_projection=True,
    value_gate="swilu",
    memory_value_dim=64,
    memory_num_values=256,
    value_pool_size=256,
)
PEER_GELU = dict(value_gate="peer_gelu", pre_value_dim=16, query_conv_kernel_size=4)  # V1 placement, GELU'd gate
# Engram: a hashed n-gram memory at block 1 (beside the default's product-key layers: tiny-ultramem-engram's layout),
# orders 2..3 with 4 hash heads each (8 primes, whose sum is even: tensor parallel splits the rows in two), a kernel-4
# conv dilated by 3 (its state: the last 9 inputs)
NGRAM = dict(
    ngram_layers=[1], ngram_order=3, ngram_heads=4, ngram_head_dim=32, ngram_table_size=1024, ngram_conv_kernel_size=4
)
EOS = 0  # UltraMemConfig's and the shipped tokenizer's: in a prompt, the n-grams after it start a new document


def prompts(lengths: list[int], seed: int, prefix: list[int] | None = None) -> list[list[int]]:
    """Random token ids of the given lengths (after a shared `prefix`)."""
    generator = torch.Generator().manual_seed(seed)
    return [(prefix or []) + torch.randint(10, 50000, (n,), generator=generator).tolist() for n in lengths]


@torch.no_grad()
def reference_ids(model: torch.nn.Module, batch: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Transformers' greedy `generate`, one prompt at a time (no padding), float32."""
    outputs = []
    for ids in batch:
        generated = model.generate(
            torch.tensor([ids]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False
        )
        outputs.append(generated[0, len(ids) :].tolist())
    return outputs


# Two CPU workers (tensor_parallel_size=2): vLLM binds each to a NUMA node unless told the cores; this machine has one
TENSOR_PARALLEL_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def run_engine(path: Path, batches: list[list[list[int]]], max_tokens: int, **engine) -> dict:
    """Greedy token ids of every prompt of every batch (one `generate` call per batch, in order, on one engine), the
    engine's counters (`vllm:prefix_cache_hits`, `vllm:num_preemptions`, ...), and the rows of each value table as
    each worker holds them (`table_rows`)."""
    request = path.parent / f"{path.name}-request.json"
    result = path.parent / f"{path.name}-result.json"
    request.write_text(json.dumps(dict(model=str(path), batches=batches, max_tokens=max_tokens, engine=engine)))
    tensor_parallel = TENSOR_PARALLEL_ENV if engine.get("tensor_parallel_size", 1) > 1 else {}
    env = {**os.environ, **ENGINE_ENV, **IN_PROCESS_ENGINE_ENV, **tensor_parallel}
    subprocess.run([sys.executable, __file__, str(request), str(result)], check=True, timeout=400, env=env)
    return json.loads(result.read_text())


def value_table_rows(model: torch.nn.Module) -> dict[str, int]:
    """Rows of every value and pre-value table a worker's model holds, by checkpoint name (run in each worker)."""
    tables = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {
        name: tensor.shape[0]
        for name, tensor in tables.items()
        if name.endswith(("values.weight", "value_pool.weight"))
    }


def _serve_request(request_file: str, result_file: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    request = json.loads(Path(request_file).read_text())
    llm = LLM(model=request["model"], **{**BASE_ENGINE, **request["engine"]})
    sampling = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=True)
    ids = []
    for batch in request["batches"]:
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], sampling, use_tqdm=False)
        ids.append([list(output.outputs[0].token_ids) for output in outputs])
    counters = {metric.name: metric.value for metric in llm.get_metrics() if hasattr(metric, "value")}
    tables = None
    if os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION"):  # pickled by reference: a module, not __main__
        from serving_support import value_table_rows as in_workers

        tables = llm.apply_model(in_workers)
    Path(result_file).write_text(json.dumps(dict(ids=ids, counters=counters, table_rows=tables)))


if __name__ == "__main__":
    _serve_request(*sys.argv[1:3])
