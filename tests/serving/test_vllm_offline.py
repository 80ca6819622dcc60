"""vLLM's offline engine serving UltraMem gives exactly Transformers' greedy tokens (float32).

Each engine runs in a child process (`serving_support.run_engine`); the checkpoints have random conv weights and values
(a lost or mixed-up conv state changes the tokens), and n-gram memories (Engram) random tables and conv weights (a
lost token history or conv state changes them too). Runs in the vLLM environment (.ci/vllm_tests.sh); skipped where
vLLM is not installed.
"""

import copy
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

# A submodule, not "vllm": without vLLM installed, "vllm" is found as this test folder (a namespace package on the
# path pytest gives tests/conftest.py)
pytest.importorskip(
    "vllm.entrypoints.llm", reason="vLLM is not installed: .ci/vllm_tests.sh runs these in its own venv"
)

from serving_support import (  # noqa: E402
    EOS,
    MEMORY_PLUS,
    NGRAM,
    PEER_GELU,
    V2,
    build_checkpoint,
    prompts,
    reference_ids,
    run_engine,
)

from ultramem import UltraMemConfig, UltraMemForCausalLM  # noqa: E402
from ultramem.ngram_memory import ngram_table_rows  # noqa: E402
from ultramem.vllm.support import UnsupportedByVllm, check_supported  # noqa: E402

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def ultramem_engram(tmp_path_factory):
    """TDQKR with IVE and multi-core scoring, query conv k=5, memory layers [[0, 2], [1, 1], [3, 3]], and an n-gram
    memory at block 1 (`NGRAM`: a kernel-4 conv dilated by 3, the tokenizer's canonical ids)."""
    path = tmp_path_factory.mktemp("vllm") / "ultramem-engram"
    return path, build_checkpoint(path, **NGRAM)


@pytest.fixture(scope="module")
def pkm(tmp_path_factory):
    """PKM (product keys, one score per slot, softmax), no IVE, query conv k=1 (no state), separate row and column
    queries without LayerNorm, tied head."""
    path = tmp_path_factory.mktemp("vllm") / "pkm-k1"
    model = build_checkpoint(
        path,
        retrieval_mode="product_key",
        tucker_rank=1,
        mcs_cores=1,
        ive_expansion=1,
        memory_num_values=256,
        memory_score_softmax=True,
        share_query=False,
        qk_layernorm=False,
        query_conv_kernel_size=1,
        tie_word_embeddings=True,
    )
    return path, model


def assert_same_ids(got: list[list[int]], expected: list[list[int]], batch: list[list[int]]) -> None:
    for ids, want, prompt in zip(got, expected, batch, strict=True):
        assert ids == want, f"prompt of {len(prompt)} tokens: vLLM {ids} != Transformers {want}"


def test_batching_chunked_prefill_prefix_caching_and_preemption(ultramem_engram):
    """One engine, every scheduling path a conv state (the query convs', the n-gram memory's conv and token window)
    must survive:
    - continuous batching: 9 prompts of 1..200 tokens through 6 sequence slots, one with an EOS inside;
    - chunked prefill: chunks of 64 tokens, so long prompts continue their conv states across steps;
    - preemption: 8 KV blocks, and prompts that cross a 128-token block while decoding, so requests are evicted and
      recomputed;
    - prefix caching ("align" mode copies conv states): a second call of 2 prompts sharing the first 160 tokens of
      the longest prompt."""
    path, model = ultramem_engram
    first = prompts([1, 2, 7, 33, 64, 120, 122, 124, 200], seed=1)
    first[3][20] = EOS
    second = prompts([5, 20], seed=2, prefix=first[-1][:160])
    result = run_engine(
        path,
        [first, second],
        MAX_TOKENS,
        max_num_seqs=6,
        max_num_batched_tokens=64,
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
        max_model_len=256,
        num_gpu_blocks_override=8,
    )
    for got, batch in zip(result["ids"], (first, second), strict=True):
        assert_same_ids(got, reference_ids(model, batch, MAX_TOKENS), batch)
    counters = result["counters"]
    assert counters["vllm:prefix_cache_hits"] > 0 and counters["vllm:num_preemptions"] > 0, counters


def _lose_query_conv_states(model: UltraMemForCausalLM) -> None:
    for layer in model.model.memory_layers:
        layer.query.conv.weight.data[..., :-1] = 0.0


def _lose_ngram_conv_state(model: UltraMemForCausalLM) -> None:
    model.model.ngram_memories[0].conv.weight.data[..., :-1] = 0.0


def _lose_ngram_history(model: UltraMemForCausalLM) -> None:
    """The ids before each step dropped: a decoded token's n-grams hold no earlier token."""
    memory = model.model.ngram_memories[0]
    memory._tokens = lambda ids, cache: torch.nn.functional.pad(ids, (memory.order - 1, 0), value=memory.vocab_size)


LOST_STATES = {
    "query_conv": _lose_query_conv_states,
    "ngram_conv": _lose_ngram_conv_state,
    "ngram_history": _lose_ngram_history,
}


@pytest.mark.parametrize("state", sorted(LOST_STATES))
def test_control_a_lost_state_changes_the_tokens(state, ultramem_engram):
    """The equalities above can fail: with a conv's past taps zeroed, or the n-gram memory's ids before each step
    dropped, what a model that loses that state computes, Transformers' own greedy tokens change."""
    path, model = ultramem_engram
    batch = prompts([33, 130], seed=1)
    expected = reference_ids(model, batch, MAX_TOKENS)
    stateless = copy.deepcopy(model)
    LOST_STATES[state](stateless)
    assert all(got != want for got, want in zip(reference_ids(stateless, batch, MAX_TOKENS), expected, strict=True))


def test_pkm_without_conv_state(pkm):
    path, model = pkm
    batch = prompts([1, 9, 40, 150], seed=4)
    result = run_engine(path, [batch], MAX_TOKENS, max_num_seqs=2)
    assert_same_ids(result["ids"][0], reference_ids(model, batch, MAX_TOKENS), batch)


# One engine per checkpoint with every scheduling path at once: 5 prompts through 3 sequence slots (one with an EOS
# inside), prefill chunks of 64 tokens, then 2 prompts sharing the longest one's first 140 tokens (prefix caching)
FAMILY_ENGINE = dict(
    max_num_seqs=3,
    max_num_batched_tokens=64,
    enable_chunked_prefill=True,
    enable_prefix_caching=True,
    max_model_len=256,
)


def _serve_and_compare(path, model, **engine) -> dict:
    first = prompts([1, 7, 40, 120, 150], seed=6)
    first[2][20] = EOS
    second = prompts([5, 20], seed=7, prefix=first[-1][:140])
    result = run_engine(path, [first, second], MAX_TOKENS, **{**FAMILY_ENGINE, **engine})
    for got, batch in zip(result["ids"], (first, second), strict=True):
        assert_same_ids(got, reference_ids(model, batch, MAX_TOKENS), batch)
    assert result["counters"]["vllm:prefix_cache_hits"] > 0, result["counters"]
    return result


# Engram alone (tiny-engram's layout): two n-gram memories, which read one token window, and no product-key layer
ENGRAM = {**NGRAM, "ngram_layers": [1, 3], "memory_layers": []}


@pytest.mark.parametrize(
    "variant", [MEMORY_PLUS, PEER_GELU, ENGRAM], ids=["memory_plus", "peer_gelu_conv4", "engram_alone"]
)
def test_family_under_batching_chunked_prefill_and_prefix_caching(variant, tmp_path):
    """Memory+ (PKM in place of MLPs, silu gate, shared table), a GELU'd PEER gate with a kernel-4 query conv, and
    n-gram memories without product keys: the Transformers model's own memory modules, served. UltraMemV2 is served
    compiled (`test_compiled_mode`, beside an n-gram memory) and in eager mode with tensor parallel
    (`test_tensor_parallel_shards_the_value_rows`); UltraMem beside an n-gram memory in float32
    (`test_batching_chunked_prefill_prefix_caching_and_preemption`), int8 (`test_quantized_tables`) and int4 with
    tensor parallel."""
    path = tmp_path / "checkpoint"
    _serve_and_compare(path, build_checkpoint(path, **variant))


# vLLM's CPU default for compiled mode is one Dynamo trace (DYNAMO_TRACE_ONCE) handed to Inductor; UltraMem runs
# that default. UltraMemV2 runs the same trace with the eager backend (what vLLM's own CPU CI runs, VLLM_CPU_CI_ENV):
# what it adds over UltraMem is its lookup's trace (the PEER gate's `lookup_dot`, the shared pool), not new Inductor
# codegen, and Inductor's compile of a second model took 160 s of the vLLM job's 480. UltraMemV2 has an n-gram memory
# at block 1 here: its hashing and table read in the trace, its token window and conv custom ops as the query conv
COMPILED = {
    "ultramem": ({}, {}),
    "ultramemv2": ({**V2, **NGRAM}, {"compilation_config": {"mode": 2, "backend": "eager"}}),
}


@pytest.mark.parametrize("variant", sorted(COMPILED))
def test_compiled_mode(variant, tmp_path):
    """Without `enforce_eager`, vLLM traces the whole model with Dynamo (the conv state layers, custom ops, stay
    opaque) and compiles it for batch sizes it has not seen: the same tokens as Transformers, hence as eager mode. The
    lookup's bag offsets used to have a data-dependent length, which the compiled graph specialised on the warm-up
    batch."""
    overrides, compilation = COMPILED[variant]
    path = tmp_path / "checkpoint"
    _serve_and_compare(path, build_checkpoint(path, **overrides), enforce_eager=False, **compilation)


@pytest.mark.parametrize("variant", ["int4", "ultramemv2"])
def test_tensor_parallel_shards_the_value_rows(variant, ultramem_engram, tmp_path):
    """tensor_parallel_size=2, two CPU worker processes: each holds half of the rows of every value table (the int4
    tables of the skip-layer model with a kernel-5 conv, its n-gram table among them; UltraMemV2's shared pool and PEER
    pre-values, read through `lookup_dot`) and the greedy tokens are Transformers' (so those of
    tensor_parallel_size=1, tested above)."""
    if variant == "int4":
        path = tmp_path / "int4"
        subprocess.run(
            [sys.executable, "-m", "ultramem.quantize", str(ultramem_engram[0]), str(path), "--format", "int4"],
            check=True,
        )
        model = UltraMemForCausalLM.from_pretrained(path).eval()
    else:
        path = tmp_path / "checkpoint"
        model = build_checkpoint(path, **V2)
    result = _serve_and_compare(path, model, tensor_parallel_size=2)
    whole = {name: model.get_parameter_or_buffer(name).shape[0] for name in model.get_value_table_names()}
    assert len(whole) >= 2 and len(result["table_rows"]) == 2, result["table_rows"]
    for rank in result["table_rows"]:
        assert rank == {name: rows // 2 for name, rows in whole.items()}, (rank, whole)


def test_quantized_tables(ultramem_engram, tmp_path):
    """A checkpoint converted to int8 by `python -m ultramem.quantize` serves its uint8 tables (the product-key tables
    and the n-gram table) through the quantized lookup (a table is never dequantized whole), with the tokens of
    Transformers loading the same checkpoint. int4 is served with tensor parallel
    (`test_tensor_parallel_shards_the_value_rows`)."""
    source, _ = ultramem_engram
    path = tmp_path / "int8"
    subprocess.run([sys.executable, "-m", "ultramem.quantize", str(source), str(path), "--format", "int8"], check=True)
    model = UltraMemForCausalLM.from_pretrained(path).eval()
    tables = (model.model.memory_layers[0].values, model.model.ngram_memories[0].values)
    assert all(table.weight.dtype == torch.uint8 for table in tables)  # the reference reads int tables too
    _serve_and_compare(path, model)


def _engine_config(
    hf_config, tensor_parallel_size=1, pipeline_parallel_size=1, speculative_config=None, enable_prompt_embeds=False
):
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_config=hf_config, enable_prompt_embeds=enable_prompt_embeds),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size
        ),
        speculative_config=speculative_config,
    )


def test_offloaded_tables_are_refused():
    config = UltraMemConfig(hidden_size=64, num_attention_heads=2, num_hidden_layers=2, memory_layers=[[0, 1]])
    config.memory_offload = "disk"
    with pytest.raises(UnsupportedByVllm, match=r"UltraMemConfig\.memory_offload='disk' .* is not served by ultramem"):
        check_supported(_engine_config(config))


@pytest.mark.parametrize(
    "setting, match",
    [
        (dict(tensor_parallel_size=3), "tensor_parallel_size=3 does not divide UltraMemConfig.memory_num_values"),
        (dict(tensor_parallel_size=4), "tensor_parallel_size=4 does not divide num_attention_heads=2"),
        (dict(pipeline_parallel_size=2), "pipeline_parallel_size=2"),
        (dict(speculative_config=object()), "speculative decoding"),
    ],
)
def test_unverified_engine_settings_are_refused(setting, match):
    config = UltraMemConfig(hidden_size=64, num_attention_heads=2, num_hidden_layers=2, memory_layers=[[0, 1]])
    with pytest.raises(UnsupportedByVllm, match=match):
        check_supported(_engine_config(config, **setting))
    check_supported(_engine_config(config))  # the defaults are served


def test_engine_settings_the_ngram_memories_cannot_serve_are_refused():
    """A tensor-parallel size that does not divide an n-gram table's rows (each rank holds an equal block), and prompt
    embeddings (the n-gram memories hash the token ids)."""
    config = UltraMemConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, **NGRAM)
    rows = ngram_table_rows(config)[0]
    assert rows % 2 == 0 and rows % 4, rows
    check_supported(_engine_config(config, tensor_parallel_size=2))
    with pytest.raises(UnsupportedByVllm, match=rf"tensor_parallel_size=4 does not divide the {rows} rows of n-gram"):
        check_supported(_engine_config(config, tensor_parallel_size=4))
    with pytest.raises(UnsupportedByVllm, match=r"enable_prompt_embeds=True .*UltraMemConfig\.ngram_layers=\[1\]"):
        check_supported(_engine_config(config, enable_prompt_embeds=True))
