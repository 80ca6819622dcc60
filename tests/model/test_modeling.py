"""The model against independent references: GPT-NeoX, a float64 loop implementation, full recomputation."""

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from model_support import left_padded_batch, perturbed_model, reference_memory_layer, small_config
from transformers import DataCollatorWithFlattening, DynamicCache, GPTNeoXConfig, GPTNeoXForCausalLM

from ultramem import (
    UltraMemForCausalLM,
    UltraMemForQuestionAnswering,
    UltraMemForSequenceClassification,
    UltraMemForTokenClassification,
)
from ultramem.diagnostics import WORST_LAYER, retrieval_diagnostics
from ultramem.init_scales import mcs_output_gain

# ----------------------------------------------------------------------------------------------------
# Backbone
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_backbone_matches_gpt_neox(attn_implementation):
    """With no memory layers the model is GPT-NeoX (sequential residual, full rotary) without linear biases."""
    config = small_config(memory_layers=[])
    config._attn_implementation = attn_implementation
    ours = perturbed_model(config)
    neox_config = GPTNeoXConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        intermediate_size=config.intermediate_size,
        hidden_act="gelu",
        max_position_embeddings=config.max_position_embeddings,
        layer_norm_eps=config.layer_norm_eps,
        use_parallel_residual=False,
        rotary_pct=1.0,
        rope_theta=config.rope_parameters["rope_theta"],
        tie_word_embeddings=False,
        attn_implementation=attn_implementation,
    )
    neox = GPTNeoXForCausalLM(neox_config).eval()
    head_dim = config.head_dim
    with torch.no_grad():
        neox.gpt_neox.embed_in.weight.copy_(ours.model.embed_tokens.weight)
        for theirs, mine in zip(neox.gpt_neox.layers, ours.model.layers):
            for name in ("input_layernorm", "post_attention_layernorm"):
                getattr(theirs, name).load_state_dict(getattr(mine, name).state_dict())
            attention = mine.self_attn
            per_head = [
                torch.cat(
                    [
                        proj.weight[h * head_dim : (h + 1) * head_dim]
                        for proj in (attention.q_proj, attention.k_proj, attention.v_proj)
                    ]
                )
                for h in range(config.num_attention_heads)
            ]
            theirs.attention.query_key_value.weight.copy_(torch.cat(per_head))
            theirs.attention.query_key_value.bias.zero_()
            theirs.attention.dense.weight.copy_(attention.o_proj.weight)
            theirs.attention.dense.bias.zero_()
            theirs.mlp.dense_h_to_4h.weight.copy_(mine.mlp.up_proj.weight)
            theirs.mlp.dense_h_to_4h.bias.zero_()
            theirs.mlp.dense_4h_to_h.weight.copy_(mine.mlp.down_proj.weight)
            theirs.mlp.dense_4h_to_h.bias.zero_()
        neox.gpt_neox.final_layer_norm.load_state_dict(ours.model.norm.state_dict())
        neox.lm_head.weight.copy_(ours.lm_head.weight)
    input_ids, attention_mask = left_padded_batch(config.vocab_size, [9, 6])
    with torch.no_grad():
        expected = neox(input_ids, attention_mask=attention_mask).logits
        actual = ours(input_ids, attention_mask=attention_mask).logits
    real = attention_mask.bool()
    assert (actual - expected)[real].abs().max() < 1e-5


# ----------------------------------------------------------------------------------------------------
# Memory layer against a float64 reference written from the paper's equations
# ----------------------------------------------------------------------------------------------------


def test_memory_layer_matches_float64_reference():
    config = small_config(share_query=False)
    model = perturbed_model(config, seed=3)
    layer = model.model.memory_layers[0]
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 5, config.hidden_size, generator=generator)
    upstream = torch.randn(2, 5, config.hidden_size, generator=generator)

    output = layer(hidden)
    output.backward(upstream)

    params = {name: p.detach().double().requires_grad_() for name, p in layer.named_parameters()}
    expected = reference_memory_layer(layer, hidden.double(), params)
    expected.backward(upstream.double())

    torch.testing.assert_close(output.double(), expected, rtol=1e-5, atol=1e-6)
    for name, param in layer.named_parameters():
        expected_grad = params[name].grad  # float32 accumulation error grows with the gradient's scale
        scale = max(1.0, expected_grad.abs().max().item())
        torch.testing.assert_close(param.grad.double(), expected_grad, rtol=1e-4, atol=1e-6 * scale, msg=name)
    assert params["retrieval.cores"].grad.abs().sum() > 0
    assert params["query.conv.weight"].grad.abs().sum() > 0


def test_product_key_retrieval_is_exact_and_softmax_pools_to_one():
    """PKM's two-phase top-m finds the exact top-m; with softmax the scores of each head sum to 1."""
    config = small_config(
        retrieval_mode="product_key",
        tucker_rank=1,
        mcs_cores=1,
        memory_score_softmax=True,
        ive_expansion=1,
        value_projection=False,
        memory_value_dim=32,
        memory_num_keys=12,
    )
    model = perturbed_model(config)
    input_ids, attention_mask = left_padded_batch(config.vocab_size, [8, 5])
    stats = retrieval_diagnostics(model, input_ids, attention_mask)
    assert stats["tdqkr_recall"] == pytest.approx(1.0)
    layer = model.model.memory_layers[0]
    _, scores = layer.retrieve(torch.randn(1, 4, config.hidden_size))
    torch.testing.assert_close(scores.sum(-2), torch.ones(1, 4, config.memory_heads, 1))


def test_retrieval_diagnostics_ranges():
    model = perturbed_model(small_config())
    input_ids, attention_mask = left_padded_batch(97, [10, 7, 3])
    stats = retrieval_diagnostics(model, input_ids, attention_mask)
    per_layer = ("tdqkr_recall", "slot_usage", "usage_vs_uniform", "usage_kl", "query_cosine", "input_cosine")
    per_layer += ("top1_score", "memory_output_std")
    layers = range(model.config.num_memory_layers)
    assert set(stats) == {
        *per_layer,
        *(f"{worst.__name__}_{name}" for name, worst in WORST_LAYER.items()),
        *(f"layer_{j}/{name}" for j in layers for name in per_layer),
    }
    for name in per_layer:  # the plain name is the mean over layers
        assert stats[name] == pytest.approx(sum(stats[f"layer_{j}/{name}"] for j in layers) / len(layers))
    assert stats["min_slot_usage"] == min(stats[f"layer_{j}/slot_usage"] for j in layers)
    assert stats["max_input_cosine"] == max(stats[f"layer_{j}/input_cosine"] for j in layers)
    assert 0.0 < stats["tdqkr_recall"] <= 1.0
    assert 0.0 < stats["slot_usage"] <= 1.0 and stats["usage_vs_uniform"] > 0 and stats["usage_kl"] >= 0
    assert -1.0 <= stats["input_cosine"] <= 1.0
    assert stats["memory_output_std"] > 0


def test_aux_loss_formula_and_loss_sum():
    config = small_config(aux_loss_alpha=0.5, aux_loss_tau=0.01)
    model = perturbed_model(config)
    input_ids, _ = left_padded_batch(config.vocab_size, [6, 6])
    out = model(input_ids, labels=input_ids)
    expected = 0.0
    for layer in model.model.memory_layers:
        for head_core in layer.retrieval.cores.detach().double().sum(1):
            singular = np.linalg.svd(head_core.numpy(), compute_uv=False)
            expected += 0.5 / (config.tucker_rank - 1) * sum(max(0.0, s - 0.01) ** 2 for s in singular[1:])
    assert out.aux_loss.item() == pytest.approx(expected, rel=1e-5)
    torch.testing.assert_close(out.loss, out.lm_loss + out.aux_loss)
    out.loss.backward()
    assert model.model.memory_layers[0].retrieval.cores.grad.abs().sum() > 0


def test_aux_loss_comes_with_a_loss_or_in_training_only():
    """A function of the weights alone: a forward that computes no loss (each step of `generate`) leaves it out."""
    model = perturbed_model(small_config())
    input_ids, _ = left_padded_batch(model.config.vocab_size, [6, 6])
    expected = model.model.aux_loss().detach()
    assert expected > 0
    assert model.train()(input_ids).aux_loss is not None
    model.eval()
    assert model(input_ids).aux_loss is None
    torch.testing.assert_close(model(input_ids, labels=input_ids).aux_loss, expected)


# ----------------------------------------------------------------------------------------------------
# Padding, caching, generation
# ----------------------------------------------------------------------------------------------------


def test_left_padding_does_not_leak_into_query_conv():
    """A left-padded row gives the same logits on its real tokens as the same tokens alone."""
    config = small_config()
    model = perturbed_model(config)
    input_ids, attention_mask = left_padded_batch(config.vocab_size, [9, 5])
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        padded = model(input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        alone = model(input_ids[1:, -5:]).logits
        garbage = input_ids.clone()
        garbage[1, :4] = 7  # different pad content must not matter
        padded_garbage = model(garbage, attention_mask=attention_mask, position_ids=position_ids).logits
    torch.testing.assert_close(padded[1, -5:], alone[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(padded[1, -5:], padded_garbage[1, -5:], rtol=0, atol=0)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_packed_sequences_do_not_leak_into_each_other(attn_implementation):
    """Padding-free rows (`DataCollatorWithFlattening`) give each sequence's own logits and gradients.

    Attention stays within each sequence through Transformers' packed mask; the query convolutions must too.
    """
    config = small_config(use_cache=False)
    config._attn_implementation = attn_implementation
    model = perturbed_model(config)
    generator = torch.Generator().manual_seed(3)
    sequences = [torch.randint(1, config.vocab_size, (length,), generator=generator) for length in (7, 2, 5)]
    batch = DataCollatorWithFlattening()([{"input_ids": sequence.tolist()} for sequence in sequences])
    packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    alone = [model(sequence[None]).logits for sequence in sequences]
    torch.testing.assert_close(packed, torch.cat(alone, 1), rtol=1e-5, atol=1e-5)

    conv = model.model.memory_layers[0].query.conv
    packed_grad = torch.autograd.grad(packed.square().sum(), conv.weight)[0]
    alone_grad = torch.autograd.grad(sum(logits.square().sum() for logits in alone), conv.weight)[0]
    torch.testing.assert_close(packed_grad, alone_grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_incremental_decoding_matches_full_recompute(attn_implementation):
    """Prefill then one token at a time through the cache gives the logits of a full forward pass."""
    config = small_config()
    config._attn_implementation = attn_implementation
    model = perturbed_model(config)
    input_ids, attention_mask = left_padded_batch(config.vocab_size, [11, 7, 4], seed=2)
    with torch.no_grad():
        full = model(input_ids, attention_mask=attention_mask).logits
        cache = DynamicCache(config=config)
        prefill = 4
        steps = [model(input_ids[:, :prefill], attention_mask=attention_mask[:, :prefill], cache=cache).logits]
        for t in range(prefill, input_ids.shape[1]):
            out = model(input_ids[:, t : t + 1], attention_mask=attention_mask[:, : t + 1], cache=cache)
            steps.append(out.logits)
    incremental = torch.cat(steps, dim=1)
    real = attention_mask.bool()
    torch.testing.assert_close(incremental[real], full[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_beams", [1, 3], ids=["greedy", "beam-search"])
def test_cached_generation_equals_uncached(num_beams):
    """Generation with the KV + query-conv cache equals recomputing everything at every step; beam search
    reorders the cache's query-conv states with its beams."""
    config = small_config(vocab_size=211)
    model = perturbed_model(config, seed=7)
    input_ids, attention_mask = left_padded_batch(config.vocab_size, [12, 8, 3], seed=4)
    kwargs = dict(
        attention_mask=attention_mask, max_new_tokens=32, do_sample=False, pad_token_id=0, num_beams=num_beams
    )
    cached = model.generate(input_ids, use_cache=True, **kwargs)
    uncached = model.generate(input_ids, use_cache=False, **kwargs)
    assert cached.shape == (3, input_ids.shape[1] + 32)
    assert torch.equal(cached, uncached)
    assert len(set(cached[:, -32:].flatten().tolist())) > 3  # not a degenerate constant output


@pytest.mark.parametrize(
    "prompt_length, overrides",
    [(1, {}), (18, {}), (18, {"memory_layers": [[0, 1], [0, 2], [1, 3], [2, 3], [3, 3]]})],
    ids=["prompt1", "prompt18", "5-memory-layers-in-4-blocks"],
)
def test_assisted_and_prompt_lookup_decoding_equal_greedy(prompt_length, overrides):
    """Candidate tokens that the model rejects are cropped from its cache, query-conv states included.

    The assistant is another model, so candidates are rejected (its own greedy output differs); two memory
    layers read the same block (each needs a conv-state slot of its own: `crop` fails on an unfilled one); a
    one-token prompt is shorter than the conv's k-1 = 3 past inputs. With more memory layers than blocks
    (5 in 4), hybrid cache layers hold several states and none is left unfilled.
    """
    config = small_config(vocab_size=211, query_conv_kernel_size=4, **overrides)
    model, assistant = perturbed_model(config, seed=7), perturbed_model(config, seed=8)
    generator = torch.Generator().manual_seed(5)
    ngram = torch.randint(1, config.vocab_size, (1, 9), generator=generator)
    input_ids = ngram.repeat(1, 2)[:, :prompt_length]  # repeated n-grams, for prompt lookup's candidates
    kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)
    greedy = model.generate(input_ids, **kwargs)
    assert not torch.equal(assistant.generate(input_ids, **kwargs), greedy)
    assert torch.equal(model.generate(input_ids, assistant_model=assistant, **kwargs), greedy)
    assert torch.equal(model.generate(input_ids, prompt_lookup_num_tokens=3, **kwargs), greedy)


def test_continuous_batching_equals_generate_without_query_convs_and_is_refused_with_them():
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    prompts = [[1, 2, 3], [4, 5]]
    generation = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
    # a few kB, not a share of RAM; the page size is `block_size` before Transformers 5.24
    page = (
        "page_size" if "page_size" in {f.name for f in dataclasses.fields(ContinuousBatchingConfig)} else "block_size"
    )
    paged = ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=64, **{page: 16})
    model = perturbed_model(small_config(vocab_size=211, use_query_conv=False))
    if not hasattr(ContinuousBatchingConfig(), "page_size"):  # before Transformers 5.24
        with pytest.raises(NotImplementedError, match="needs Transformers >= 5.24"):
            model.generate_batch(inputs=prompts, generation_config=generation, continuous_batching_config=paged)
        return
    batched = model.generate_batch(inputs=prompts, generation_config=generation, continuous_batching_config=paged)
    expected = [model.generate(torch.tensor([p]), generation_config=generation)[0, len(p) :].tolist() for p in prompts]
    assert [batched[key].generated_tokens for key in sorted(batched)] == expected
    with pytest.raises(NotImplementedError, match="query-conv states"):
        perturbed_model(small_config()).generate_batch(
            inputs=prompts, generation_config=generation, continuous_batching_config=paged
        )


def test_plain_dynamic_cache_gives_a_clear_error():
    model = perturbed_model(small_config())
    with pytest.raises(ValueError, match="DynamicCache\\(config=model.config\\)"):
        model(torch.ones(1, 3, dtype=torch.long), cache=DynamicCache())


# ----------------------------------------------------------------------------------------------------
# Transformers features
# ----------------------------------------------------------------------------------------------------


def test_task_heads_pool_like_llama_and_add_the_aux_loss():
    """Sequence classification scores the last non-padding token (left or right padding); every head's loss
    is its task loss plus the TDQKR aux loss, and reaches the Tucker cores."""
    config = small_config(num_labels=3)
    torch.manual_seed(0)
    input_ids = torch.tensor([[0, 0, 5, 9, 3, 44], [8, 1, 7, 2, 6, 0]])  # pad_token_id = 0, left and right
    labels = torch.tensor([2, 0])
    classifier = UltraMemForSequenceClassification(config)
    out = classifier(input_ids, labels=labels)
    scores = classifier.score(classifier.model(input_ids).last_hidden_state)  # (B, T, 3)
    pooled = scores[torch.arange(2), torch.tensor([5, 4])]
    torch.testing.assert_close(out.logits, pooled)
    torch.testing.assert_close(out.loss, F.cross_entropy(pooled, labels) + classifier.model.aux_loss())
    out.loss.backward()
    assert classifier.model.memory_layers[0].retrieval.cores.grad.abs().sum() > 0

    tagger = UltraMemForTokenClassification(config)
    token_labels = torch.randint(0, 3, input_ids.shape)
    out = tagger(input_ids, labels=token_labels)
    torch.testing.assert_close(
        out.loss, F.cross_entropy(out.logits.flatten(0, 1), token_labels.flatten()) + tagger.model.aux_loss()
    )

    reader = UltraMemForQuestionAnswering(config)
    start, end = torch.tensor([1, 2]), torch.tensor([3, 4])
    out = reader(input_ids, start_positions=start, end_positions=end)
    span_loss = (F.cross_entropy(out.start_logits, start) + F.cross_entropy(out.end_logits, end)) / 2
    torch.testing.assert_close(out.loss, span_loss + reader.model.aux_loss())
    assert isinstance(reader(input_ids, start_positions=start, end_positions=end, return_dict=False), tuple)


def test_task_head_trainer_step_is_the_same_with_gradient_accumulation(tmp_path):
    """Batch 4 in one step equals 2 x 2 accumulated: the Trainer averages the heads' mean losses over the
    micro-batches (with `accepts_loss_kwargs` left True, as Llama's heads do, it sums them: twice the step)."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    # no query statistics: they make two micro-batches differ from their union (batch statistics, as BatchNorm's; running
    # ones fold the first micro-batch in before the second)
    config = small_config(num_labels=3, hidden_dropout=0.0, attention_dropout=0.0, query_norm="none")
    torch.manual_seed(0)
    initial = UltraMemForSequenceClassification(config).state_dict()
    generator = torch.Generator().manual_seed(1)
    data = Dataset.from_dict(
        {"input_ids": torch.randint(1, 97, (4, 6), generator=generator).tolist(), "labels": [0, 1, 2, 1]}
    )

    def one_step(batch_size: int, accumulation: int) -> torch.Tensor:
        model = UltraMemForSequenceClassification(config)
        model.load_state_dict(initial)
        args = TrainingArguments(
            tmp_path / f"{batch_size}x{accumulation}",
            per_device_train_batch_size=batch_size,
            gradient_accumulation_steps=accumulation,
            max_steps=1,
            learning_rate=0.1,
            max_grad_norm=0.0,
            optim="sgd",
            lr_scheduler_type="constant",
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            use_cpu=True,
        )
        Trainer(model=model, args=args, train_dataset=data).train()
        return model.score.weight.detach()

    whole, accumulated = one_step(4, 1), one_step(2, 2)
    assert not torch.equal(whole, initial["score.weight"])
    torch.testing.assert_close(accumulated, whole, rtol=1e-5, atol=1e-6)


def test_inputs_embeds_and_hidden_states():
    config = small_config()
    model = perturbed_model(config)
    input_ids, _ = left_padded_batch(config.vocab_size, [6, 6])
    with torch.no_grad():
        by_ids = model(input_ids, output_hidden_states=True)
        by_embeds = model(inputs_embeds=model.get_input_embeddings()(input_ids))
    torch.testing.assert_close(by_ids.logits, by_embeds.logits)
    assert len(by_ids.hidden_states) == config.num_hidden_layers + 1
    assert by_ids.hidden_states[0].shape == (2, 6, config.hidden_size)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gradient_checkpointing_gives_same_gradients(use_reentrant):
    config = small_config()
    input_ids, _ = left_padded_batch(config.vocab_size, [8, 8])
    grads = []
    for checkpointing in (False, True):
        model = perturbed_model(config).train()
        if checkpointing:
            # `activation_checkpointing_enable` from Transformers 5.24 on, `gradient_checkpointing_enable` before
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable({"use_reentrant": use_reentrant})
        model(input_ids, labels=input_ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], msg=name)


def test_value_table_names_point_at_the_tables():
    config = small_config()
    model = perturbed_model(config)
    names = model.get_value_table_names()
    params = dict(model.named_parameters())
    assert len(names) == len(config.memory_layers)
    for name in names:
        assert params[name].shape == (config.memory_num_values, config.memory_value_dim)


def test_improved_init_scales():
    """Values start at N(0, E/(2 m H L)) (times the MCS gain) and the layer output near N(0, 1/(2L)) (appendix A)."""
    config = small_config(memory_num_keys=64, memory_value_dim=64, memory_key_dim=32, hidden_size=64)
    model = perturbed_model(config)
    values = model.model.memory_layers[0].values.weight
    expected_std = (
        config.ive_expansion / (2 * config.memory_topk * config.memory_heads * config.num_hidden_layers)
    ) ** 0.5
    expected_std *= mcs_output_gain(config.memory_num_keys, config.memory_topk, config.tucker_rank, config.mcs_cores)
    assert values.std().item() == pytest.approx(expected_std, rel=0.05)
    input_ids = torch.randint(1, config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    stats = retrieval_diagnostics(model, input_ids)
    target = (1 / (2 * config.num_hidden_layers)) ** 0.5
    assert 0.5 * target < stats["memory_output_std"] < 2.0 * target


def _make_cores_rank_one(model: UltraMemForCausalLM, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.memory_layers:
            cores = layer.retrieval.cores  # (H, h, r, r)
            heads, num_cores, rank, _ = cores.shape
            u, t = torch.randn(heads, rank, generator=generator), torch.randn(heads, rank, generator=generator)
            cores.copy_((torch.einsum("ha,hb->hab", u, t) / num_cores).unsqueeze(1).expand_as(cores))


def test_signed_candidates_make_two_phase_top_m_exact_for_rank_one_cores():
    """The paper's positive-only candidates miss the negative x negative quadrant of a rank-1 core."""
    input_ids, attention_mask = left_padded_batch(97, [16, 12, 9], seed=8)
    recalls = {}
    for signed in (False, True):
        config = small_config(tdqkr_signed_candidates=signed, memory_num_keys=24, query_norm="none")  # raw queries
        model = perturbed_model(config, seed=9)
        _make_cores_rank_one(model, seed=10)
        recalls[signed] = retrieval_diagnostics(model, input_ids, attention_mask)["tdqkr_recall"]
    assert recalls[True] == pytest.approx(1.0)
    assert recalls[False] < 0.8


def test_static_cache_extended_decode_matches_full_forward():
    """The decode benchmarks' cache path: StaticCache prefill, then one token at a time, with a random query conv."""
    from transformers import StaticCache

    config = small_config()
    torch.manual_seed(0)
    model = UltraMemForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "conv" in name:  # the identity init would hide a stale conv state
                param.normal_()
        input_ids = torch.randint(1, config.vocab_size, (2, 9))
        full = model(input_ids).logits
        cache = StaticCache(config=config, max_cache_len=16)
        steps = [model(input_ids[:, :4], cache=cache).logits]
        steps += [model(input_ids[:, t : t + 1], cache=cache).logits for t in range(4, 9)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_closed_form_core_svd_matches_lapack():
    """The closed-form 2x2 SVD the model uses on accelerators, against LAPACK."""
    from ultramem.memory_ops import core_svd, svd_2x2

    torch.manual_seed(0)
    cores = torch.randn(4096, 2, 2, dtype=torch.float64)
    values, u, t = svd_2x2(cores)
    ref_values, ref_u, ref_t = core_svd(cores)  # LAPACK on CPU
    sign = (u * ref_u).sum(-1, keepdim=True).sign()
    torch.testing.assert_close(values, ref_values, rtol=0, atol=1e-12)
    torch.testing.assert_close(u * sign, ref_u, rtol=0, atol=1e-10)
    torch.testing.assert_close(t * sign, ref_t, rtol=0, atol=1e-10)


def test_model_is_unchanged_with_the_closed_form_svd(monkeypatch):
    """Logits, aux loss and its gradient are the same when the model takes the accelerator (closed-form) path."""
    from ultramem import modeling_ultramem
    from ultramem.memory_ops import svd_2x2

    config = small_config(memory_layers=[[0, 2], [1, 3]])
    torch.manual_seed(0)
    model = UltraMemForCausalLM(config)
    input_ids = torch.randint(1, config.vocab_size, (2, 7))

    def run():
        model.zero_grad()
        out = model(input_ids, labels=input_ids)
        out.loss.backward()
        cores = model.model.memory_layers[0].retrieval.cores.grad.clone()
        return out.logits.detach(), out.aux_loss.detach(), cores

    lapack = run()
    monkeypatch.setattr(modeling_ultramem, "core_svd", svd_2x2)
    closed_form = run()
    for reference, value in zip(lapack, closed_form, strict=True):
        torch.testing.assert_close(value, reference, rtol=1e-5, atol=1e-6)
