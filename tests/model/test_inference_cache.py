"""InferenceCache: the LayerNorm'd keys, the cores' singular vectors and the aux loss are reused at inference only
while the weights they come from are unchanged, and a cached forward is the uncached one bit for bit."""

import copy

import pytest
import torch
from model_support import small_config

from ultramem import UltraMemForCausalLM
from ultramem.inference_cache import InferenceCache
from ultramem.memory_query import window_projection

INPUT_IDS = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(1))


def _model(seed: int = 0, **overrides) -> UltraMemForCausalLM:
    torch.manual_seed(seed)
    return UltraMemForCausalLM(small_config(**overrides)).eval()


def _cached_logits(model: UltraMemForCausalLM) -> torch.Tensor:
    """With labels: the aux loss (the model's own cache) is computed with a loss only."""
    with torch.no_grad():
        return model(input_ids=INPUT_IDS, labels=INPUT_IDS).logits


def _uncached_logits(model: UltraMemForCausalLM) -> torch.Tensor:
    """Grad mode bypasses the cache: the same computation from the current weights."""
    with torch.enable_grad():
        return model(input_ids=INPUT_IDS).logits.detach()


def _caches(model: UltraMemForCausalLM) -> list:
    return [layer.retrieval.inference_cache for layer in model.model.memory_layers] + [model.model.inference_cache]


def _count_key_norm_calls(model: UltraMemForCausalLM) -> list[int]:
    calls = [0]
    for layer in model.model.memory_layers:
        layer.retrieval.key_norm.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("retrieval_mode", ["tucker", "product_key"])
def test_eval_no_grad_reuses_the_cache_and_matches_uncached(retrieval_mode):
    pkm = dict(tucker_rank=1, mcs_cores=1) if retrieval_mode == "product_key" else {}
    model = _model(retrieval_mode=retrieval_mode, **pkm)
    calls = _count_key_norm_calls(model)
    first = _cached_logits(model)
    filled = calls[0]
    assert filled > 0
    second = _cached_logits(model)
    assert calls[0] == filled  # keys not normalized again
    assert torch.equal(first, second)
    assert torch.equal(second, _uncached_logits(model))
    expected = {"keys", "singular_vectors"} if retrieval_mode == "tucker" else {"keys"}
    assert set(model.model.memory_layers[0].retrieval.inference_cache.versions) == expected


def test_train_empties_the_cache_and_training_forwards_bypass_it():
    model = _model()
    calls = _count_key_norm_calls(model)
    _cached_logits(model)
    model.train()
    assert not any(cache.versions for cache in _caches(model))
    with torch.no_grad():
        before = calls[0]
        model(input_ids=INPUT_IDS)
    assert calls[0] > before and not any(cache.versions for cache in _caches(model))
    model(input_ids=INPUT_IDS, labels=INPUT_IDS).loss.backward()
    retrieval = model.model.memory_layers[0].retrieval
    assert retrieval.row_keys.grad is not None and retrieval.cores.grad is not None


def test_optimizer_step_invalidates_the_cache():
    model = _model()
    stale = _cached_logits(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(input_ids=INPUT_IDS, labels=INPUT_IDS).loss.backward()  # eval mode: grads, the cache is bypassed
    optimizer.step()
    fresh = _cached_logits(model)
    assert not torch.allclose(fresh, stale)
    assert torch.equal(fresh, _uncached_logits(model))


def test_load_state_dict_invalidates_the_cache():
    model, other = _model(seed=0), _model(seed=1)
    _cached_logits(model)
    model.load_state_dict(other.state_dict())
    assert torch.equal(_cached_logits(model), _cached_logits(other))


@pytest.mark.parametrize("parameter", ["row_keys", "col_keys", "key_norm.weight", "key_norm.bias", "cores"])
def test_in_place_edit_invalidates_the_cache(parameter):
    model = _model()
    stale = _cached_logits(model)
    with torch.no_grad():
        for layer in model.model.memory_layers:
            layer.retrieval.get_parameter(parameter).add_(0.5)
    fresh = _cached_logits(model)
    assert not torch.allclose(fresh, stale)
    assert torch.equal(fresh, _uncached_logits(model))


def test_a_cache_filled_in_inference_mode_is_refilled_outside_it():
    """The cached tensors are updated in place: those first computed under `torch.inference_mode` (as vLLM runs)
    must not be inference tensors, which no write outside it may touch."""
    model = _model()
    with torch.inference_mode():
        model(input_ids=INPUT_IDS)
    with torch.no_grad():
        for layer in model.model.memory_layers:
            layer.retrieval.row_keys.add_(0.5)
            layer.retrieval.cores.add_(0.5)
    assert torch.equal(_cached_logits(model), _uncached_logits(model))


def test_dtype_change_invalidates_the_cache():
    model = _model()
    _cached_logits(model)
    model.to(torch.float64)
    assert _cached_logits(model).dtype == torch.float64
    assert torch.equal(_cached_logits(model), _uncached_logits(model))


def test_aux_loss_is_cached_and_follows_the_cores(monkeypatch):
    model = _model()
    computed = []
    compute = model.model._aux_loss_by_device
    monkeypatch.setattr(model.model, "_aux_loss_by_device", lambda cores: computed.append(1) or compute(cores))
    with torch.no_grad():
        aux = model.model.aux_loss()
        assert torch.equal(model.model.aux_loss(), aux) and len(computed) == 1  # the cached value
        model.model.memory_layers[0].retrieval.cores.mul_(3.0)
        cached = model.model.aux_loss()
    assert len(computed) == 2 and not torch.equal(cached, aux)  # `aux`, a copy, kept its value
    assert torch.equal(cached, model.model.aux_loss().detach())


def test_replacing_a_parameter_invalidates_the_cache():
    """A new tensor has another storage (the cache keeps the old one alive, so its address cannot be reused)."""
    model = _model()
    stale = _cached_logits(model)
    with torch.no_grad():
        for layer in model.model.memory_layers:
            retrieval = layer.retrieval
            retrieval.row_keys = torch.nn.Parameter(retrieval.row_keys.detach() * 2)
    fresh = _cached_logits(model)
    assert not torch.allclose(fresh, stale)
    assert torch.equal(fresh, _uncached_logits(model))


def test_a_filled_cache_is_neither_saved_nor_copied(tmp_path):
    """`torch.save(model)` and `copy.deepcopy` work after cached forwards (the cache holds parameters' storages,
    which `torch.save` refuses beside the parameters) and start with empty caches."""
    model = _model()
    expected = _cached_logits(model)
    torch.save(model, tmp_path / "model.pt")
    for again in (torch.load(tmp_path / "model.pt", weights_only=False), copy.deepcopy(model)):
        assert all(not cache.versions for cache in _caches(again))
        torch.testing.assert_close(_cached_logits(again), expected, rtol=0, atol=0)
    assert all(cache.versions for cache in _caches(model))


@torch.no_grad()
def test_a_refresh_lets_one_compiled_read_use_the_cache_updated_in_place():
    """Under torch.compile the weights' versions cannot be checked: a compiled read uses the cache only right after
    an eager `refresh`, and then recomputes until the next one. A refresh writes into the same buffer, the address
    a CUDA graph captured."""
    cache, weight = InferenceCache().eval(), torch.nn.Parameter(torch.ones(3))
    entry = ((weight,), lambda: weight * 2)
    compiled = torch.compile(lambda: cache.get("double", *entry), backend="eager", fullgraph=True)
    cache.refresh("double", *entry)
    buffer = cache.double_0
    assert torch.equal(compiled(), buffer)
    weight.add_(1)  # no refresh after it: the next compiled read computes
    assert torch.equal(compiled(), torch.full((3,), 4.0)) and torch.equal(buffer, torch.full((3,), 2.0))
    cache.refresh("double", *entry)
    assert cache.double_0 is buffer and torch.equal(buffer, torch.full((3,), 4.0))
    assert torch.equal(compiled(), buffer)


def test_refresh_adds_no_state_dict_keys_or_parameters():
    model = _model()
    keys, parameters = set(model.state_dict()), len(list(model.parameters()))
    model.refresh_inference_cache()
    _cached_logits(model)
    assert set(model.state_dict()) == keys and len(list(model.parameters())) == parameters
    assert any(cache._buffers for cache in _caches(model))


def test_eager_generate_refreshes_only_where_a_step_may_be_compiled(monkeypatch):
    """`generate` on a dynamic cache runs its steps eagerly, which check the cache as they read it: no refresh per step
    (its checks cost what a Llama step does not pay). On a static cache, whose steps `generate` may compile, each step
    is refreshed. Both follow an in-place weight change between two calls: the tokens of a copy with an empty cache."""
    model = _model()
    refreshes = [0]
    refresh = model.refresh_inference_cache
    monkeypatch.setattr(
        model, "refresh_inference_cache", lambda: refreshes.__setitem__(0, refreshes[0] + 1) or refresh()
    )
    prompt, steps = INPUT_IDS[:, :4], 3
    greedy = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    generated = []
    for _ in range(2):
        refreshes[0] = 0
        generated.append(model.generate(prompt, **greedy))
        assert refreshes[0] == 0
        static = model.generate(prompt, cache_implementation="static", disable_compile=True, **greedy)
        assert refreshes[0] == steps
        torch.testing.assert_close(static, generated[-1], rtol=0, atol=0)
        torch.testing.assert_close(copy.deepcopy(model).generate(prompt, **greedy), generated[-1], rtol=0, atol=0)
        with torch.no_grad():
            for layer in model.model.memory_layers:
                layer.retrieval.row_keys.mul_(-1.5)
                layer.retrieval.cores.add_(0.5)
    assert not torch.equal(*generated)


@pytest.mark.parametrize("taps_apart", [True, False], ids=["cpu-taps-apart", "accelerator-full-fold"])
def test_a_decode_steps_window_projection_is_the_conv_then_the_projection(taps_apart):
    """Both forms of the decode step's folded query (taps apart on CPU, folded into W'' on accelerators) compute the
    depthwise conv of the window, then the projection: checked here on CPU for the form a GPU runs too."""
    generator = torch.Generator().manual_seed(0)
    dim, taps, features = 6, 4, 5
    weight_t, bias = torch.randn(dim, features, generator=generator), torch.randn(features, generator=generator)
    conv_weight, conv_bias = torch.randn(dim, 1, taps, generator=generator), torch.randn(dim, generator=generator)
    window = torch.randn(3, dim, taps, generator=generator)  # (B, D, k)
    expected = torch.addmm(bias, (window * conv_weight[:, 0]).sum(-1) + conv_bias, weight_t)
    *kept, folded_weight_t, folded_bias = window_projection(weight_t, bias, conv_weight, conv_bias, taps_apart)
    assert len(kept) == int(taps_apart)
    inputs = (window * kept[0]).sum(-1) if taps_apart else window.reshape(3, -1)
    torch.testing.assert_close(torch.addmm(folded_bias, inputs, folded_weight_t), expected)
