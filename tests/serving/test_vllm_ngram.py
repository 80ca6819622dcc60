"""vLLM serves hashed n-gram memories (Engram) with exactly Transformers' greedy tokens (float32).

An n-gram memory needs each request's last N-1 token ids and its dilated conv's last (k-1) N inputs across vLLM's
steps: the checkpoints have random n-gram tables and conv weights and the tokenizer's canonical ids, and every engine
runs the scheduling paths that carry those states (several prompts through fewer sequence slots, prefill chunks of
64 tokens, prefix cache hits on a shared prefix), with an EOS inside a prompt. Runs in the vLLM environment
(.ci/vllm_tests.sh); skipped where vLLM is not installed.
"""

import copy
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip(
    "vllm.entrypoints.llm", reason="vLLM is not installed: .ci/vllm_tests.sh runs these in its own venv"
)

from serving_support import build_checkpoint, prompts, reference_ids, run_engine  # noqa: E402

from ultramem import UltraMemConfig, UltraMemForCausalLM  # noqa: E402
from ultramem.ngram_memory import ngram_table_rows  # noqa: E402
from ultramem.vllm.support import UnsupportedByVllm, check_supported  # noqa: E402

MAX_TOKENS = 16
EOS = 0  # UltraMemConfig's and the shipped tokenizer's
# Orders 2..3 with 4 heads each (8 hash heads, whose rows sum to an even count: tensor parallel splits them in two),
# a kernel-4 conv dilated by 3 (its state: the last 9 inputs)
NGRAM = dict(ngram_order=3, ngram_heads=4, ngram_head_dim=32, ngram_table_size=1024, ngram_conv_kernel_size=4)
# product-key memory layers [[0, 2], [1, 1], [3, 3]] (the default test model) and an n-gram memory at block 1: the
# shape of tiny-ultramem-engram
BESIDE_PRODUCT_KEYS = dict(**NGRAM, ngram_layers=[1])
# two n-gram memories and no product keys: tiny-engram's shape, with a second memory sharing the token window
ALONE = dict(**NGRAM, ngram_layers=[1, 3], memory_layers=[])
ENGINE = dict(
    max_num_seqs=3,
    max_num_batched_tokens=64,
    enable_chunked_prefill=True,
    enable_prefix_caching=True,
    max_model_len=256,
)


@pytest.fixture(scope="module")
def beside_product_keys(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm-ngram") / "beside-product-keys"
    return path, build_checkpoint(path, **BESIDE_PRODUCT_KEYS)


def batches() -> list[list[list[int]]]:
    """6 prompts of 1-150 tokens, one with an EOS at token 30 (its n-grams after it start a new document), then 2
    sharing the longest one's first 140 tokens (prefix cache hits)."""
    first = prompts([1, 2, 7, 40, 120, 150], seed=11)
    first[3][30] = EOS
    return [first, prompts([5, 20], seed=12, prefix=first[-1][:140])]


def serve_and_compare(path, model, **engine) -> dict:
    """Serve `batches()` and assert vLLM's greedy ids equal Transformers' and that the second batch hit the cache."""
    requests = batches()
    result = run_engine(path, requests, MAX_TOKENS, **{**ENGINE, **engine})
    for got, batch in zip(result["ids"], requests, strict=True):
        expected = reference_ids(model, batch, MAX_TOKENS)
        for ids, want, prompt in zip(got, expected, batch, strict=True):
            assert ids == want, f"prompt of {len(prompt)} tokens: vLLM {ids} != Transformers {want}"
    assert result["counters"]["vllm:prefix_cache_hits"] > 0, result["counters"]
    return result


def quantized(source, tmp_path, format: str):
    """`python -m ultramem.quantize` of `source`, and Transformers' model of the result (the reference)."""
    path = tmp_path / format
    subprocess.run([sys.executable, "-m", "ultramem.quantize", str(source), str(path), "--format", format], check=True)
    return path, UltraMemForCausalLM.from_pretrained(path).eval()


def test_ngram_memory_beside_product_keys(beside_product_keys):
    serve_and_compare(*beside_product_keys)


def test_control_lost_ngram_states_change_the_tokens(beside_product_keys):
    """The equalities can fail: Transformers' own greedy tokens change when the n-gram memory loses the ids before
    each step (as a served model that kept no history would) or its conv's past inputs."""
    _, model = beside_product_keys
    batch = batches()[0][3:5]
    expected = reference_ids(model, batch, MAX_TOKENS)
    no_history, no_conv_state = copy.deepcopy(model), copy.deepcopy(model)
    memory = no_history.model.ngram_memories[0]
    memory._history = lambda ids, cache: ids.new_full((ids.shape[0], memory.order - 1), memory.vocab_size)
    with torch.no_grad():
        no_conv_state.model.ngram_memories[0].conv.weight[..., :-1] = 0.0
    for stateless in (no_history, no_conv_state):
        changed = reference_ids(stateless, batch, MAX_TOKENS)
        assert all(got != want for got, want in zip(changed, expected, strict=True))


def test_ngram_memories_alone_int8(tmp_path):
    """Two n-gram memories reading one token window, no product keys, int8 tables read by the quantized lookup."""
    source = tmp_path / "float"
    build_checkpoint(source, **ALONE)
    path, model = quantized(source, tmp_path, "int8")
    assert model.model.ngram_memories[1].values.weight.dtype == torch.uint8  # the reference reads int tables too
    serve_and_compare(path, model)


def test_tensor_parallel_int4_splits_the_ngram_rows(beside_product_keys, tmp_path):
    """tensor_parallel_size=2 on int4 tables: each worker holds half of the rows of the n-gram table and of every
    product-key table."""
    path, model = quantized(beside_product_keys[0], tmp_path, "int4")
    result = serve_and_compare(path, model, tensor_parallel_size=2)
    whole = {name: model.get_parameter_or_buffer(name).shape[0] for name in model.get_value_table_names()}
    assert "model.ngram_memories.0.values.weight" in whole and len(result["table_rows"]) == 2, result["table_rows"]
    for rank in result["table_rows"]:
        assert rank == {name: rows // 2 for name, rows in whole.items()}, (rank, whole)


def _engine_config(hf_config, tensor_parallel_size=1, enable_prompt_embeds=False):
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_config=hf_config, enable_prompt_embeds=enable_prompt_embeds),
        parallel_config=SimpleNamespace(tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=1),
        speculative_config=None,
    )


def test_engine_settings_the_ngram_memories_cannot_serve_are_refused():
    config = UltraMemConfig(
        hidden_size=64, num_attention_heads=2, num_hidden_layers=2, **{**NGRAM, "ngram_layers": [1]}
    )
    rows = ngram_table_rows(config)[0]
    assert rows % 2 == 0 and rows % 4, rows
    check_supported(_engine_config(config, tensor_parallel_size=2))
    with pytest.raises(UnsupportedByVllm, match=rf"tensor_parallel_size=4 does not divide the {rows} rows of n-gram"):
        check_supported(_engine_config(config, tensor_parallel_size=4))
    with pytest.raises(UnsupportedByVllm, match=r"enable_prompt_embeds=True .*UltraMemConfig\.ngram_layers=\[1\]"):
        check_supported(_engine_config(config, enable_prompt_embeds=True))
