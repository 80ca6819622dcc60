"""Decode steps inside `generate` (`UltraMemModel.fixed_weights`): each memory layer and n-gram memory builds its step
from its weights once per call and runs the forward's operators on them. Generation with them is generation through
the modules bit for bit; weights changed between calls are read; forwards with gradients keep the modules."""

import pytest
import torch
from model_support import NGRAM, VARIANTS, left_padded_batch, perturbed_model, perturbed_ngram_tables, small_config

from ultramem.modeling_ultramem import UltraMemMemoryLayer
from ultramem.ngram_memory import NGramMemory

CONFIGS = {
    "ultramem": {},
    "pkm": dict(retrieval_mode="product_key", tucker_rank=1, mcs_cores=1, memory_score_softmax=True),
    "ngram": dict(**NGRAM, eos_token_id=5),
    "ultramemv2": VARIANTS["ultramemv2"],  # PEER's pre-values in a shared pool, beside the MLP
    "memoryplus": VARIANTS["memoryplus"],  # Memory+'s gate, instead of the MLP
}


def _model(name: str, seed: int = 0):
    model = perturbed_model(small_config(**CONFIGS[name]), seed=seed).eval()
    return perturbed_ngram_tables(model) if model.model.ngram_memories else model


def _generate(model, input_ids, attention_mask, **kwargs) -> torch.Tensor:
    out = model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=6,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        **kwargs,
    )
    return torch.stack(out.scores, 1)


def _counted_steps(monkeypatch) -> list[int]:
    """Counts the calls of every decode step built from now on."""
    calls = [0]

    def counted(build):
        def wrapped(*args):
            built = build(*args)
            if built is None or not callable(built):
                return built

            def step(*step_args):
                calls[0] += 1
                return built(*step_args)

            return step

        return wrapped

    monkeypatch.setattr(UltraMemMemoryLayer, "decode_step", counted(UltraMemMemoryLayer.decode_step))
    monkeypatch.setattr(NGramMemory, "decode_step", counted(NGramMemory.decode_step))
    return calls


@pytest.mark.parametrize("name", list(CONFIGS))
def test_generation_with_decode_steps_is_generation_through_the_modules(name, monkeypatch):
    """Left padding, an EOS inside a prompt, greedy and beam search: the same scores, bit for bit."""
    model = _model(name)
    input_ids, attention_mask = left_padded_batch(97, [9, 4, 7])
    input_ids[0, 4] = 5
    calls = _counted_steps(monkeypatch)
    with_steps = _generate(model, input_ids, attention_mask)
    beams = model.generate(input_ids[:1], max_new_tokens=4, num_beams=3, do_sample=False)
    used = calls[0]
    monkeypatch.setattr(UltraMemMemoryLayer, "decode_step", lambda self, inputs: None)
    monkeypatch.setattr(NGramMemory, "decode_step", lambda self: None)
    assert torch.equal(with_steps, _generate(model, input_ids, attention_mask))
    assert torch.equal(beams, model.generate(input_ids[:1], max_new_tokens=4, num_beams=3, do_sample=False))
    layers = len(model.model.memory_layers) + len(model.model.ngram_memories)
    assert used == layers * (5 + 3)  # every layer at each decode step of both calls


def test_weights_changed_between_calls_are_read():
    """A step is built per `generate` call: an optimizer step between two calls is seen by the second."""
    model = _model("ngram")
    input_ids, attention_mask = left_padded_batch(97, [6, 3])
    first = _generate(model, input_ids, attention_mask)
    with torch.no_grad():
        for layer in model.model.memory_layers:
            layer.value_expansion.projector.weight.mul_(3.0)
            layer.query.proj.weight.add_(0.5)
        for ngram in model.model.ngram_memories:
            ngram.value_proj.weight.mul_(3.0)
            ngram.conv.weight.add_(0.5)
    second = _generate(model, input_ids, attention_mask)
    recomputed = _generate(model, input_ids, attention_mask, use_cache=False)
    assert not torch.allclose(second, first)
    torch.testing.assert_close(second, recomputed, rtol=1e-5, atol=1e-5)


def test_a_scope_inside_another_keeps_the_outer_ones_steps():
    model = _model("ngram")
    layers = [*model.model.memory_layers, *model.model.ngram_memories]
    input_ids, attention_mask = left_padded_batch(97, [5, 3])
    with torch.no_grad(), model.model.fixed_weights():
        model(input_ids, attention_mask=attention_mask, use_cache=True)  # (prefill: no step built)
        assert all(layer.fixed_weights and layer._decode is None for layer in layers)
        model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=2, do_sample=False)
        assert all(layer.fixed_weights and layer._decode is None for layer in layers)
    assert not any(layer.fixed_weights for layer in layers)


def test_a_forward_with_gradients_inside_the_scope_runs_the_modules():
    model = _model("ultramem")
    input_ids = torch.randint(1, 97, (2, 1))
    with model.model.fixed_weights():
        model(input_ids).logits.sum().backward()
    assert all(layer._decode is None for layer in model.model.memory_layers)
    assert model.model.memory_layers[0].query.proj.weight.grad is not None
