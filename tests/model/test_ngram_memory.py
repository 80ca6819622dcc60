"""The hashed n-gram memory (Engram, issue 45): the hash against a pure-Python integer reference, the layer against a
float64 loop of its equations, cached generation against recomputation, the canonical map, save and load with and
without the package, and bad input as one line."""

import pytest
import torch
import torch.nn.functional as F
from model_support import assert_loads_alike_with_and_without_the_package, left_padded_batch, small_config
from transformers import DynamicCache

from ultramem import UltraMemForCausalLM
from ultramem.configuration_ultramem import UltraMemConfigError
from ultramem.memory_query import MemoryInputs
from ultramem.ngram_memory import canonical_token_ids, hash_multipliers, head_moduli
from ultramem.tokenization import load_tokenizer

EOS = 5
NGRAM = dict(ngram_layers=[1, 3], ngram_order=3, ngram_heads=2, ngram_head_dim=4, ngram_table_size=60)


def ngram_model(seed: int = 0, **overrides) -> UltraMemForCausalLM:
    """A small model with n-gram memories at blocks 1 and 3 whose conv, gate and canonical map all matter."""
    torch.manual_seed(seed)
    config = small_config(**{**NGRAM, "eos_token_id": EOS, **overrides})
    model = UltraMemForCausalLM(config).eval()
    for ngram in model.model.ngram_memories:
        torch.nn.init.normal_(ngram.conv.weight, std=0.5)
        torch.nn.init.normal_(ngram.conv.bias, std=0.1)
        torch.nn.init.normal_(ngram.values.weight, std=1.0)
        canonical = torch.arange(config.vocab_size + 1)
        canonical[10:20] = 10  # ten ids share one canonical id
        ngram.set_canonical_ids(canonical)
    return model


def reference_rows(ngram, ids: list[int], history: list[int] | None = None) -> list[list[int]]:
    """Each token's rows from the definition, in Python integers: the n-gram of order n is the token and the n-1 before
    it within its document (an EOS ends one; before the first token, no token: id vocab_size)."""
    vocab = ngram.vocab_size
    order, heads = ngram.order, ngram.num_heads // (ngram.order - 1)
    multipliers = hash_multipliers(vocab, order, ngram.ngram_idx, ngram.seed)
    moduli = [int(m) for m in ngram.moduli]
    offsets = [sum(moduli[:i]) for i in range(len(moduli))]
    canonical = [int(c) for c in ngram.canonical_ids]
    tokens = (history or []) + ids
    start = len(history or [])
    rows = []
    for t in range(start, len(tokens)):
        document_start = max([p + 1 for p in range(t) if tokens[p] == EOS], default=0)
        row, mixed = [], canonical[tokens[t]] * multipliers[0]
        for back in range(1, order):
            p = t - back
            token = canonical[tokens[p]] if p >= document_start else vocab
            mixed ^= token * multipliers[back]
            assert mixed < 2**63  # no overflow on any path
            for head in range(heads):
                i = (back - 1) * heads + head
                row.append(mixed % moduli[i] + offsets[i])
        rows.append(row)
    return rows


def test_the_hash_is_the_integer_definition_across_documents_and_steps():
    ngram = ngram_model().model.ngram_memories[1]
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(1, ngram.vocab_size, (2, 20), generator=generator)
    ids[0, 6] = ids[1, 0] = ids[1, 1] = ids[0, 19] = EOS  # documents end inside, at the start and at the end
    ids[1, 8:12] = torch.tensor([11, 12, 13, 14])  # tokens that share a canonical id
    rows = ngram.rows(ngram.ngrams(ids))
    for b in range(2):
        assert rows[b].tolist() == reference_rows(ngram, ids[b].tolist())
    assert rows.dtype == torch.int64 and bool((rows < ngram.table_rows).all())


def test_multipliers_and_primes_are_fixed_integers():
    """The same on every platform and process: pure-Python integers; every head of the model a prime of its own."""
    assert hash_multipliers(97, 3, 0, 0) == hash_multipliers(97, 3, 0, 0)
    assert all(m % 2 == 1 and m * 98 < 2**63 for m in hash_multipliers(2**20, 4, 5, 7))
    model = ngram_model()
    primes = [int(m) for ngram in model.model.ngram_memories for m in ngram.moduli]
    assert len(set(primes)) == len(primes) == 8 and primes == head_moduli(60 // 4, 8, 0)


def reference_layer(ngram, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """y = v + SiLU(Conv(RMSNorm(v))), v = sigmoid(signed_sqrt(RMSNorm(h) . RMSNorm(W_k e) / sqrt(D))) W_v e, in
    float64, token by token (the conv dilated by N over the tokens before)."""
    f64 = {name: p.detach().double() for name, p in ngram.named_parameters()}
    rows = reference_rows(ngram, ids.tolist())
    dim, eps = hidden.shape[-1], ngram.hidden_norm.eps

    def rms(x, weight):
        return x / torch.sqrt((x * x).mean() + eps) * weight

    values = []
    for t, row in enumerate(rows):
        e = f64["values.weight"][row].flatten()
        score = rms(hidden[t].double(), f64["hidden_norm.weight"]) @ rms(
            f64["key_proj.weight"] @ e, f64["key_norm.weight"]
        )
        score = score / dim**0.5
        values.append(torch.sigmoid(torch.sign(score) * score.abs().sqrt()) * (f64["value_proj.weight"] @ e))
    normed = [rms(v, f64["value_norm.weight"]) for v in values]
    weight, kernel, dilation = f64["conv.weight"][:, 0], f64["conv.weight"].shape[-1], ngram.order
    out = []
    for t, v in enumerate(values):
        conv = f64["conv.bias"].clone()
        for tap in range(kernel):  # tap i reads the token i * N back
            back = (kernel - 1 - tap) * dilation
            if t - back >= 0:
                conv += weight[:, tap] * normed[t - back]
        out.append(v + F.silu(conv))
    return torch.stack(out)


def test_the_layer_is_its_equations_in_float64():
    model = ngram_model()
    ngram = model.model.ngram_memories[0]
    ids = torch.randint(1, 97, (1, 14), generator=torch.Generator().manual_seed(4))
    ids[0, 5] = EOS
    hidden = torch.randn(1, 14, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        output = ngram(hidden, ids)
    torch.testing.assert_close(output[0].double(), reference_layer(ngram, hidden[0], ids[0]), rtol=1e-4, atol=1e-5)


def test_cached_generation_equals_recomputation_with_left_padding_and_an_eos_in_a_prompt():
    """Dynamic and static caches; beam search reorders the n-gram states with the rest."""
    model = ngram_model(seed=1)
    input_ids, attention_mask = left_padded_batch(97, [9, 4, 7])
    input_ids[0, 4] = EOS
    out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False)
    for row in range(3):  # each prompt alone, unpadded, recomputed at every step
        tokens = input_ids[row : row + 1, attention_mask[row].bool()]
        with torch.no_grad():
            for _ in range(6):
                tokens = torch.cat([tokens, model(tokens).logits[:, -1:].argmax(-1)], dim=1)
        assert out[row, attention_mask.shape[1] - attention_mask[row].sum() :].tolist() == tokens[0].tolist()
    static = model.generate(
        input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False, cache_implementation="static"
    )
    assert torch.equal(static, out)
    beams = model.generate(input_ids[:1, 4:], max_new_tokens=4, num_beams=3, do_sample=False)
    assert torch.equal(beams, model.generate(input_ids[:1, 4:], max_new_tokens=4, num_beams=3, use_cache=False))


@pytest.mark.parametrize("conv", [{}, {"ngram_conv_kernel_size": 1}], ids=["conv", "one-tap-conv"])
def test_steps_of_several_tokens_continue_the_history(conv):
    """A conv of one tap keeps no state (its config gives it no cache slot): the ids' history alone carries on."""
    model = ngram_model(seed=2, **conv)
    ids = torch.randint(1, 97, (2, 11), generator=torch.Generator().manual_seed(6))
    ids[1, 6] = EOS
    with torch.no_grad():
        full = model(ids).logits
        first = model(ids[:, :1], use_cache=True)
        second = model(ids[:, 1:3], cache=first.past_key_values)
        rest = model(ids[:, 3:], cache=second.past_key_values)
    torch.testing.assert_close(torch.cat([first.logits, second.logits, rest.logits], 1), full, rtol=1e-5, atol=1e-5)


def test_a_cache_that_records_the_past_for_a_crop_continues_the_history():
    """While `generate` records the past to crop rejected candidates (assisted decoding), the ids' state grows past
    the N-1 a step reads; after the crop the steps go on as a recomputation."""
    model = ngram_model(seed=7)
    ids = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(8))
    ids[1, 4] = EOS
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        full = model(ids).logits
        model(ids[:, :3], cache=cache, use_cache=True)
        for layer in cache.layers:
            if hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording()
        steps = [model(ids[:, 3:4], cache=cache).logits, model(ids[:, 4:8], cache=cache).logits]
        cache.crop(-3)  # candidates 5..7 rejected
        steps += [model(ids[:, 5:6], cache=cache).logits, model(ids[:, 6:7], cache=cache).logits]
    torch.testing.assert_close(steps[0], full[:, 3:4], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(steps[1], full[:, 4:8], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(steps[2:], 1), full[:, 5:7], rtol=1e-5, atol=1e-5)


def _prefill_and_decode(ngram, hidden: torch.Tensor, ids: torch.Tensor, config) -> torch.Tensor:
    """The layer's output (B, T, D) over a 4-token prefill and one-token decode steps through a generation cache."""
    inputs = MemoryInputs(cache=DynamicCache(config=config))
    steps = [ngram(hidden[:, :4], ids[:, :4], inputs)]
    steps += [ngram(hidden[:, t : t + 1], ids[:, t : t + 1], inputs) for t in range(4, ids.shape[1])]
    return torch.cat(steps, 1)


def test_inference_folds_equal_the_modules_one_by_one():
    """At inference the two projections run as one matmul, the gate's two norms as one and a decode step's
    dilated conv reads its window with its taps spread over it (each cached, `cached_entries`): the outputs of training's
    path, the modules one by one, also after the weights change in place and after a refresh."""
    model = ngram_model(seed=6)
    ngram = model.model.ngram_memories[0]
    ids = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(9))
    ids[1, 5] = EOS
    hidden = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        for change in (lambda: None, lambda: [p.mul_(1.5) for p in ngram.parameters()]):
            change()
            folded = _prefill_and_decode(ngram, hidden, ids, model.config)
            assert set(ngram.inference_cache.versions) == {"folded"}  # the folded path ran
            assert set(ngram.conv.inference_cache.versions) == {"spread_taps"}
            ngram.train()  # training's path (grad off: the cache is not read)
            torch.testing.assert_close(folded, _prefill_and_decode(ngram, hidden, ids, model.config))
            ngram.eval()
        assert set(ngram.cached_entries()) == {"folded"} and set(ngram.conv.cached_entries()) == {"spread_taps"}
        for module in (ngram, ngram.conv):
            for name, entry in module.cached_entries().items():
                module.inference_cache.refresh(name, *entry)
        torch.testing.assert_close(_prefill_and_decode(ngram, hidden, ids, model.config), folded)


def test_an_adapted_projection_runs_its_own_forward():
    """A projection that is not a plain `nn.Linear` (an adapter's wrapper, a quantized layer) is not folded."""

    class Adapted(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) + 0.5

    model = ngram_model(seed=6)
    ngram = model.model.ngram_memories[0]
    ids = torch.randint(1, 97, (1, 6), generator=torch.Generator().manual_seed(11))
    hidden = torch.randn(1, 6, 32, generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        plain = ngram(hidden, ids)
        adapted = Adapted(ngram.key_proj.in_features, ngram.key_proj.out_features, bias=False)
        adapted.weight.copy_(ngram.key_proj.weight)
        ngram.key_proj = adapted
        output = ngram(hidden, ids)
        assert "folded" not in ngram.cached_entries()
        assert not torch.allclose(output, plain)
        ngram.train()
        torch.testing.assert_close(output, ngram(hidden, ids))


def test_packed_sequences_hash_as_separate_rows():
    model = ngram_model(seed=3)
    a, b = torch.randint(1, 97, (1, 6)), torch.randint(1, 97, (1, 5))
    position_ids = torch.cat([torch.arange(6), torch.arange(5)]).unsqueeze(0)
    with torch.no_grad():
        packed = model(torch.cat([a, b], 1), position_ids=position_ids, use_cache=False).logits
        alone = torch.cat([model(a).logits, model(b).logits], 1)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def test_the_canonical_map_merges_case_and_spaces_and_keeps_special_tokens():
    tokenizer = load_tokenizer()  # the tokenizer the package ships
    vocab = len(tokenizer)
    canonical = canonical_token_ids(tokenizer, vocab)
    assert canonical.shape == (vocab + 1,) and int(canonical[vocab]) == vocab
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokenizer.tokenize(" The the THE")]
    assert len({int(canonical[i]) for i in ids}) < len(set(ids))  # variants of one word share an id
    for special in tokenizer.all_special_ids:
        assert int(canonical[special]) == special
    assert bool((canonical <= torch.arange(vocab + 1)).all())  # each maps to the first of its class


def test_save_and_load_with_and_without_the_package(tmp_path):
    assert_loads_alike_with_and_without_the_package(ngram_model(seed=4), torch.randint(1, 97, (2, 9)), tmp_path)


def test_a_loaded_model_ends_documents_at_its_eos(tmp_path):
    """The EOS ids are not saved (the config holds them): a load builds them again (it left them uninitialised, and
    n-grams reached across a loaded model's EOS)."""
    model = ngram_model(seed=5)
    model.save_pretrained(tmp_path)
    loaded = UltraMemForCausalLM.from_pretrained(tmp_path).eval()
    assert all(ngram.eos_ids.tolist() == [EOS] for ngram in loaded.model.ngram_memories)
    ids = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(7))
    ids[:, 5] = EOS
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("overrides", "field", "allowed"),
    [
        (dict(ngram_layers=[4]), "ngram_layers[0]", "must be in [0, 4)"),
        (dict(ngram_layers=[1, 1]), "ngram_layers", "each block once"),
        (dict(ngram_order=1), "ngram_order", "must be >= 2"),
        (dict(ngram_table_size=3), "ngram_table_size", "must be >= the 4 hash heads"),
    ],
)
def test_bad_config_is_one_line_naming_the_field(overrides, field, allowed):
    with pytest.raises(UltraMemConfigError) as error:
        small_config(**{**NGRAM, **overrides})
    message = str(error.value)
    assert f"UltraMemConfig.{field}=" in message and allowed in message and "\n" not in message


def test_bad_input_is_one_line_before_any_work():
    model = ngram_model()
    with pytest.raises(ValueError, match="^UltraMemConfig.ngram_layers: .*pass input_ids$"):
        model(inputs_embeds=torch.randn(1, 3, 32))
    with pytest.raises(ValueError, match="canonical_ids has 50 entries; .* vocab_size \\+ 1 = 98"):
        model.model.ngram_memories[0].set_canonical_ids(torch.arange(50))
